"""Building blocks of the DSA network that are not attention: norms, RoPE, Hadamard, FFN, MoE.

All modules hold their weights under the Hugging Face checkpoint names (``weight``, ``bias``,
``e_score_correction_bias``), so ``load_state_dict`` takes the checkpoint's names unchanged; the one
exception is a FusedFp8Linear (``x_proj``, ``cq_proj``, ``gate_up_proj``), whose weight stacks its
parts' (export/program.py checkpoint_tensors reads them by the parts' names).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import dsa_trt.plugins.fp8_ops  # noqa: F401  (registers torch.ops.dsa.moe_experts)
from dsa_trt.config import ModelConfig
from dsa_trt.engine_config import WEIGHT_FORMATS

FP8_BLOCK = 128  # the weight scale block (128 x 128) the fp8 ops take


class RMSNorm(nn.Module):
    """fp32 math, fp32 weight (docs/architecture.md §8), output in the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one aten.rms_norm node (x * rsqrt(mean(x^2) + eps) * weight, HF's formula) instead of six
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)


class IndexerKNorm(nn.Module):
    """The indexer's k_norm: a LayerNorm WITH bias (not an RMSNorm), eps 1e-6, fp32 (as the official reference)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight, self.bias, self.eps).to(x.dtype)


def linear(dim_in: int, dim_out: int, dtype: torch.dtype) -> nn.Linear:
    lin = nn.Linear(dim_in, dim_out, bias=False, dtype=dtype)
    lin.weight.requires_grad_(False)
    return lin


class Fp8Linear(nn.Module):
    """An fp8-block checkpoint Linear kept as stored: ``weight`` e4m3 [out, in] and
    ``weight_scale_inv`` fp32 [ceil(out/128), ceil(in/128)] (the checkpoint's names), run as the
    official W8A8 linear through dsa::fp8_block_linear; bf16 in, bf16 out."""

    def __init__(self, dim_in: int, dim_out: int, pow2_scales: bool):
        super().__init__()
        self.register_buffer("weight", torch.empty(dim_out, dim_in, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.empty(math.ceil(dim_out / 128), math.ceil(dim_in / 128)))
        self.pow2_scales = pow2_scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.dsa.fp8_block_linear(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale_inv,
                                           self.pow2_scales)
        return y.view(*lead, y.shape[-1])


class FusedFp8Linear(Fp8Linear):
    """Fp8Linears of one input as one W8A8 GEMM: the checkpoint's e4m3 weights (and their scales)
    stacked along the output dim in ``parts`` order, run as one dsa::fp8_block_linear (one
    activation quantisation, one GEMM, one split-K reduce instead of one each per part;
    benchmarks/RESULTS.md, "Fused projections"). ``parts``: (the
    part's module name relative to the fused module's parent, as the checkpoint names it; its
    output rows); each part but the last a multiple of 128 rows, so every 128 x 128 scale block
    stays one part's. forward returns the whole [.., sum(rows)] output; ``split`` cuts it."""

    def __init__(self, dim_in: int, parts: list[tuple[str, int]], pow2_scales: bool):
        if not _on_block_grid([rows for _, rows in parts]):
            raise ValueError(f"fused fp8 linear {parts}: every part but the last needs a multiple of {FP8_BLOCK} rows")
        super().__init__(dim_in, sum(rows for _, rows in parts), pow2_scales)
        self.parts = tuple(parts)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, [rows for _, rows in self.parts], dim=-1)


def _on_block_grid(rows: list[int]) -> bool:
    """Every part but the last a whole number of 128-row scale blocks (a stack of them keeps each block
    one part's)."""
    return all(r % FP8_BLOCK == 0 for r in rows[:-1])


def fuse_linears(owner: nn.Module, names: tuple[str, ...]) -> FusedFp8Linear | None:
    """One FusedFp8Linear replacing the block_linear submodules ``names`` of ``owner`` (dotted, all
    over the same input, stacked in this order), or None (they stay) unless they are all Fp8Linears
    of one scale format with every part but the last a multiple of 128 rows."""
    mods = [owner.get_submodule(n) for n in names]
    if not (all(type(m) is Fp8Linear for m in mods) and len({m.pow2_scales for m in mods}) == 1
            and _on_block_grid([m.weight.shape[0] for m in mods])):
        return None
    fused = FusedFp8Linear(mods[0].weight.shape[1], [(n, m.weight.shape[0]) for n, m in zip(names, mods)],
                           mods[0].pow2_scales)
    for n in names:
        parent, _, leaf = n.rpartition(".")
        delattr(owner.get_submodule(parent) if parent else owner, leaf)
    return fused


def resolve_weight_format(cfg: ModelConfig, dtype: torch.dtype, weight_format: str) -> str:
    """How a checkpoint's e4m3 weights live in the network: "fp8" (kept e4m3 with their scales,
    W8A8) or "dequant" (dequantised to the network dtype). ``"auto"``: "fp8" for an fp8-block
    checkpoint in a bf16 network; "dequant" for float32 networks (the exact mode compared with HF)
    and for bf16 checkpoints (nothing to keep)."""
    if weight_format not in ("auto", *WEIGHT_FORMATS):
        raise ValueError(f"weight format {weight_format!r}: choose one of auto, {', '.join(WEIGHT_FORMATS)}")
    fp8_ckpt = cfg.fp8_weight_block is not None and tuple(cfg.fp8_weight_block) == (FP8_BLOCK, FP8_BLOCK)
    if weight_format == "auto":
        return "fp8" if fp8_ckpt and dtype == torch.bfloat16 else "dequant"
    if weight_format == "fp8" and not fp8_ckpt:
        raise ValueError(f"weight format fp8: the checkpoint has no {FP8_BLOCK}x{FP8_BLOCK} fp8-block weights "
                         f"(fp8_weight_block={cfg.fp8_weight_block}), so there is nothing to keep in e4m3; "
                         "use --weight-format auto or dequant")
    if weight_format == "fp8" and dtype != torch.bfloat16:
        raise ValueError(f"weight format fp8 runs W8A8 linears on bf16 activations, but this network is {dtype}: "
                         "build with --dtype bfloat16, or use --weight-format dequant (or auto)")
    return weight_format


def block_linear(dim_in: int, dim_out: int, dtype: torch.dtype, cfg: ModelConfig | None,
                 split: int | None = None) -> nn.Module:
    """Fp8Linear when ``cfg`` is given (an fp8-block checkpoint kept W8A8; bf16 networks only), else
    a plain bias-free Linear in ``dtype``.

    ``split``: under tensor parallelism, the width of this rank's slice along the split dim (None:
    the rank holds the whole weight). A slice that is not a multiple of the 128-wide scale block
    would cut its scale blocks, so that linear is dequantised: a plain Linear marked
    ``fp8_dequantised`` (the network lists them: DSAForCausalLM.dequantised_linears)."""
    if cfg is None:
        return linear(dim_in, dim_out, dtype)
    if dtype != torch.bfloat16 or cfg.fp8_weight_block is None:
        raise ValueError(f"fp8 linears need an fp8-block checkpoint and a bf16 network (got {dtype}, "
                         f"fp8_weight_block={cfg.fp8_weight_block})")
    if split is not None and split % FP8_BLOCK:
        lin = linear(dim_in, dim_out, dtype)
        lin.fp8_dequantised = True
        return lin
    return Fp8Linear(dim_in, dim_out, cfg.fp8_scale_fmt == "ue8m0")


def dequantised_linears(net: nn.Module) -> list[str]:
    """The Linears of ``net`` stored e4m3 in the checkpoint but dequantised (a shard not on the
    128-block grid; see block_linear)."""
    return [name for name, m in net.named_modules() if getattr(m, "fp8_dequantised", False)]


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with fp32 output from bf16-stored operands, as the official numerics apply the
    lm_head, the router and the indexer's weights_proj in fp32 (docs/architecture.md §8). Bf16
    operands on CUDA: dsa::f32_linear (plugins/fp8_ops.py), one bf16 GEMM with fp32 output: bf16
    products are exact in fp32 and the GEMM sums in fp32, so it is the fp32 GEMM of the cast
    operands up to summation order, without fp32 copies of the operands (the lm_head's: 3.5 ms per
    step at V3.2's head against 0.44 ms) and at a third to a tenth of cuBLAS fp32's time for the
    router and weights_proj. Its rows are invariant to the step's row count up to ~80 rows
    (router) as it is, and at every count in the deterministic mode, which runs it on fixed row
    chunks (DSA_F32_LINEAR_ROWS; benchmarks/RESULTS.md, "Row invariance"). aten::mm.dtype has no
    CPU kernel, so the CPU keeps the cast; the ONNX graph gets Cast + MatMul
    (builder/onnx_export.py)."""
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        return torch.ops.dsa.f32_linear(x, weight)
    return F.linear(x.float(), weight.float())


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the weights the official numerics store in bf16 and apply in fp32 (router,
    weights_proj): bf16 in bf16 networks (fp32_linear's GEMM; the checkpoint's own bf16, so loading
    is exact), fp32 in float32 networks."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] positions -> cos, sin [T, rope_dim/2] fp32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return torch.cos(freqs) * scaling, torch.sin(freqs) * scaling


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style: pairs (2i, 2i+1) rotated by freq_i; output stays interleaved ([R] layout).

    x [T, ..., 2n]; cos/sin [T, n]. Used by MLA (q_pe, k_pe) and by GLM's indexer.
    """
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], -1, 2)
    c = cos.reshape(cos.shape[0], *([1] * (x.dim() - 2)), -1)
    s = sin.reshape(sin.shape[0], *([1] * (x.dim() - 2)), -1)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    return out.reshape(shape).to(x.dtype)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX style (V3.2's indexer): pairs (j, j + n) rotated by freq_j."""
    n = x.shape[-1] // 2
    xf = x.float()
    c = cos.reshape(cos.shape[0], *([1] * (x.dim() - 2)), -1)
    s = sin.reshape(sin.shape[0], *([1] * (x.dim() - 2)), -1)
    x0, x1 = xf[..., :n], xf[..., n:]
    return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).to(x.dtype)


def hadamard_matrix(n: int) -> torch.Tensor:
    """Normalised Walsh-Hadamard matrix H_n / sqrt(n) (n a power of two), fp32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard_buffers(n: int) -> dict[str, torch.Tensor]:
    """The indexer's rotation buffers: ``hadamard`` (H_n / sqrt(n), fp32) and ``hadamard_signs`` (its
    exact +-1 entries in bf16, the operand of the bf16 GEMM on CUDA: Indexer._rotate)."""
    h = hadamard_matrix(n)
    return {"hadamard": h, "hadamard_signs": h.sign().to(torch.bfloat16)}


class SwiGLU(nn.Module):
    """Dense FFN / one expert: down(silu(gate x) * up x); silu*up in fp32 (docs/architecture.md §8)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype, fp8_cfg: ModelConfig | None = None,
                 sharded: bool = False):
        super().__init__()
        split = inter if sharded else None  # tensor parallel: gate/up rows and down columns are split
        self.gate_proj = block_linear(dim, inter, dtype, fp8_cfg, split)
        self.up_proj = block_linear(dim, inter, dtype, fp8_cfg, split)
        self.down_proj = block_linear(inter, dim, dtype, fp8_cfg, split)
        self.gate_up_proj = fuse_linears(self, ("gate_proj", "up_proj"))  # fp8: one GEMM for both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        h = F.silu(gate.float()) * up.float()
        return self.down_proj(h.to(x.dtype))


class Router(nn.Module):
    """Sigmoid + correction bias + group-limited top-k (docs/architecture.md §8); math in fp32, the
    weight stored as stored_dtype(dtype)."""

    def __init__(self, cfg: ModelConfig, num_experts: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, cfg.hidden_size, dtype=stored_dtype(dtype)),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.cfg = cfg
        # Test hook (tests/test_w8a8.py): global expert ids [T, k] to use instead of this router's
        # choice, so an eager forward replays another implementation's routing; the combine weights
        # are still this router's scores at those ids. Never set in exported programs.
        self.replay_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> dense combine weights [T, E] fp32 (zero for unselected experts)."""
        idx, w = self.select(x)
        return torch.zeros(x.shape[0], self.weight.shape[0], dtype=torch.float32, device=x.device).scatter(1, idx, w)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (global expert ids [T, k] int64, combine weights [T, k] fp32)."""
        cfg = self.cfg
        scores = torch.sigmoid(fp32_linear(x, self.weight))  # [T, E]
        idx = self.replay_ids.to(x.device) if self.replay_ids is not None else self._choose(scores)
        w = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
        return idx, w

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """sigmoid scores [T, E] -> the chosen global expert ids [T, k] int64."""
        cfg = self.cfg
        choice = scores + self.e_score_correction_bias
        num_tokens, num_experts = scores.shape
        grouped = choice.view(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        # sorted=False for the group selection (a sum of two, then a mask: no order needed), so on
        # CUDA torch skips its sort kernel after each; the experts stay sorted by score (the
        # expert-parallel exchange's capacity drops a token's last columns first)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1, sorted=False).values.sum(-1)  # [T, G]
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        return choice.topk(cfg.num_experts_per_tok, dim=-1).indices  # [T, k]


class StackedExperts(nn.Module):
    """This rank's routed experts [lo, hi) as one dsa::moe_experts call (plugins/fp8_ops.py): one
    graph node whatever the expert count, only the routed (token, expert) pairs computed.

    Buffers in the op's layout (Checkpoint.stacked_experts fills them): ``w13`` [E, 2I, D] (gate
    rows, then up rows) and ``w2`` [E, D, I]; with ``fp8`` (weight format "fp8" of an fp8-block
    checkpoint) e4m3 with fp32 128x128 ``w13_scale`` / ``w2_scale`` (W8A8, never dequantised),
    else bf16 without scales (a bf16 checkpoint, or an fp8 one dequantised)."""

    BUFFERS = ("w13", "w13_scale", "w2", "w2_scale")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, lo: int, hi: int, fp8: bool = False):
        super().__init__()
        if dtype != torch.bfloat16:
            raise ValueError(f"stacked experts (dsa::moe_experts) take bf16 activations; this network is {dtype}: "
                             "build with dtype bfloat16, or without the expert op")
        d, inter, n = cfg.hidden_size, cfg.moe_intermediate_size, hi - lo
        self.fp8 = fp8
        self.pow2_scales = cfg.fp8_scale_fmt == "ue8m0"
        self.num_experts, self.expert_offset = cfg.n_routed_experts, lo
        wdtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        self.register_buffer("w13", torch.empty(n, 2 * inter, d, dtype=wdtype))
        self.register_buffer("w2", torch.empty(n, d, inter, dtype=wdtype))
        if self.fp8:
            self.register_buffer("w13_scale", torch.empty(n, math.ceil(2 * inter / 128), math.ceil(d / 128)))
            self.register_buffer("w2_scale", torch.empty(n, math.ceil(d / 128), math.ceil(inter / 128)))
        else:
            self.w13_scale = self.w2_scale = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D] bf16, ids [T, k] global, weights [T, k] fp32 -> this rank's partial sum, fp32 [T, D]."""
        return torch.ops.dsa.moe_experts(x, ids.to(torch.int32), weights, self.w13, self.w13_scale, self.w2,
                                         self.w2_scale, self.num_experts, self.expert_offset, self.pow2_scales)


class MoE(nn.Module):
    """Routed experts + shared experts, fp32 combine.

    ``expert_op=False``: every local expert runs on every token and is weighted by the (mostly
    zero) combine weights: no data-dependent shapes, so the graph exports and compiles as is, at
    E/top_k times the routed FLOPs and ~20 graph nodes per expert (the float32 networks).
    ``expert_op=True``: the routed experts are one StackedExperts (dsa::moe_experts) call: a
    constant number of nodes per layer (bf16 networks). ``weight_format``: "fp8" keeps the e4m3
    weights of the experts and shared experts with their scales (layers.resolve_weight_format).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, expert_range: tuple[int, int] | None = None,
                 tp_size: int = 1, expert_op: bool = False, weight_format: str = "dequant"):
        super().__init__()
        self.gate = Router(cfg, cfg.n_routed_experts, dtype)
        lo, hi = expert_range or (0, cfg.n_routed_experts)
        self.expert_lo, self.expert_hi = lo, hi
        self.tp_size = tp_size
        self.expert_op = expert_op
        fp8 = cfg if weight_format == "fp8" else None
        if expert_op:
            self.stacked_experts = StackedExperts(cfg, dtype, lo, hi, fp8=fp8 is not None)
        else:
            self.experts = nn.ModuleDict(
                {str(e): SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size, dtype, fp8) for e in range(lo, hi)}
            )
        # tensor parallel: this rank's experts [lo, hi) and 1/tp of the shared experts' width
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts // tp_size, dtype, fp8,
                   sharded=tp_size > 1)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert_op:
            out = self.stacked_experts(x, *self.gate.select(x))  # fp32 [T, D]
        else:
            combine = self.gate(x)  # [T, E]
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for e in range(self.expert_lo, self.expert_hi):
                out = out + combine[:, e : e + 1] * self.experts[str(e)](x).float()
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        if self.tp_size > 1:  # partial sums of the ranks, added in fp32
            out = torch.ops.dsa.all_reduce(out, self.tp_size)
        return out.to(x.dtype)
