"""Our DSA inference network over packed tokens and paged caches (docs/architecture.md §2).

One forward = one engine step: T packed tokens of B sequences (see runtime/step_inputs.py), the
per-layer MLA and indexer pools as inputs that the cache-write ops update in place, logits for
the rows in ``logits_indices``. The DSA operators are ``torch.ops.dsa.*`` custom ops, so
torch.export keeps them as single nodes (TensorRT plugins / our CUDA kernels downstream).

Every token takes the same path, indexer -> top-k -> absorbed sparse MLA, whatever else is in
the step: a sequence's numerics never depend on its batch neighbours or on how it was chunked
(docs/architecture.md §8). A token with at most index_topk visible keys selects all of them, so
this equals dense causal attention there.
"""

from __future__ import annotations

import torch
from torch import nn

import dsa_trt.plugins.collectives  # noqa: F401  (registers torch.ops.dsa.all_reduce)
import dsa_trt.plugins.ops  # noqa: F401  (registers torch.ops.dsa.*)
from dsa_trt.cache_layout import PAGE_SIZE
from dsa_trt.config import ModelConfig
from dsa_trt.plugins.reference import quant_fp8_pow2

from .layers import (
    MoE,
    IndexerKNorm,
    RMSNorm,
    SwiGLU,
    block_linear,
    dequantised_linears,
    fuse_linears,
    fp32_linear,
    hadamard_buffers,
    linear,
    rope_cos_sin,
    rope_half_split,
    rope_interleaved,
    resolve_weight_format,
    stored_dtype,
)
from .sharding import check_tp, local_experts

CACHE_MODES = ("fp8", "bf16", "fp32")


def check_dequantised(net: nn.Module, weight_format: str, tp_size: int) -> list[str]:
    """The e4m3 Linears ``net`` dequantises because their tensor-parallel slice is off the 128-block
    grid: the list under "auto", an error naming them under an explicit "fp8"."""
    names = dequantised_linears(net)
    if names and weight_format == "fp8":
        raise ValueError(f"weight format fp8 at tp {tp_size}: {len(names)} linear(s) would be split off the "
                         f"128-wide scale block grid, e.g. {names[0]}; use --weight-format auto (dequantises "
                         "just those) or dequant, or a tp whose slices are multiples of 128")
    return names


class Indexer(nn.Module):
    """Lightning indexer: q from c_q, k = LayerNorm(x Wk), RoPE on the first 64 dims. In an fp8
    network the attention runs wq_b and wk inside its fused projections (DSAAttention) and hands
    their outputs in (``q_proj``, ``k_proj``); the indexer then holds neither."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8: ModelConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.wq_b = block_linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype, fp8)
        self.wk = block_linear(cfg.hidden_size, cfg.index_head_dim, dtype, fp8)
        self.k_norm = IndexerKNorm(cfg.index_head_dim)
        # stored bf16, applied in fp32 to fp32 x (docs/architecture.md §8; layers.fp32_linear)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False, dtype=stored_dtype(dtype))
        self.weights_proj.weight.requires_grad_(False)
        for name, t in hadamard_buffers(cfg.index_head_dim).items():
            self.register_buffer(name, t, persistent=False)
        # Test hook (tests/test_w8a8.py): key positions [T, k] in each token's own sequence (-1 or
        # beyond the token's position: none) to attend instead of this indexer's top-k, so an eager
        # forward replays another implementation's selection. Never set in exported programs.
        self.replay_positions: torch.Tensor | None = None

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x @ H, the orthonormal Hadamard rotation over the last dim, in fp32, back to x's dtype. Bf16
        on CUDA: a bf16 GEMM against the exact +-1 matrix with fp32 output, then the 1 / sqrt(d)
        scale (rows invariant to the row count, half cuBLAS fp32's time at 4096 x 64 rows:
        benchmarks/RESULTS.md, "Row invariance")."""
        if x.is_cuda and x.dtype == torch.bfloat16:
            d = x.shape[-1]
            y = torch.mm(x.reshape(-1, d), self.hadamard_signs, out_dtype=torch.float32) * d**-0.5
            return y.view(x.shape).to(x.dtype)
        return (x.float() @ self.hadamard).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.cfg.qk_rope_head_dim
        rope = rope_interleaved if self.cfg.indexer_rope_interleave else rope_half_split
        return torch.cat([rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x, c_q, cos, sin, slot_mapping, pool, page_table, req_idx, seq_lens, fp8: bool, gather=None,
                q_proj=None, k_proj=None):
        cfg = self.cfg
        num_tokens = x.shape[0]
        q = (self.wq_b(c_q) if q_proj is None else q_proj).view(num_tokens, cfg.index_n_heads, cfg.index_head_dim)
        k = self.k_norm(self.wk(x) if k_proj is None else k_proj)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        # Hadamard rotation: orthogonal, so q.k is unchanged; it spreads outliers before fp8.
        q, k = self._rotate(q), self._rotate(k)
        torch.ops.dsa.indexer_k_cache_write(k if gather is None else gather(k), slot_mapping, pool)
        w = fp32_linear(x, self.weights_proj.weight) * (cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)
        if fp8:
            q, q_scale = quant_fp8_pow2(q)  # one power-of-two scale per (token, head)
            w = w * q_scale
        logits = torch.ops.dsa.indexer_logits(q, w, pool, page_table, req_idx, seq_lens)
        if self.replay_positions is not None:
            return self._replayed_slots(page_table, req_idx, seq_lens)
        return torch.ops.dsa.topk_translate(logits, seq_lens, page_table, req_idx, cfg.index_topk)

    def _replayed_slots(self, page_table, req_idx, seq_lens) -> torch.Tensor:
        """replay_positions -> cache slots [T, k] int32 (-1: none), as topk_translate translates them."""
        pos = self.replay_positions.to(page_table.device).long()
        valid = (pos >= 0) & (pos < seq_lens[:, None])
        pos = pos.clamp(min=0)
        pages = page_table.long()[req_idx.long()[:, None], pos // PAGE_SIZE]
        slots = pages * PAGE_SIZE + pos % PAGE_SIZE
        return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)


class KVCacheQuantizerSlot(nn.Module):
    """Identity on the MLA cache write's input (c_kv, k_pe): adds no node to the exported program.

    It marks the one place where the 576-d latent enters the fp8 cache, so calibration can attach
    a ModelOpt fp8 quantizer here by module type and name (calibration/modelopt_kv.py).
    """

    def forward(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return c_kv, k_pe


class DSAAttention(nn.Module):
    """MLA with DSA. Sparse path in the absorbed (MQA) form over the 576-d latent cache.

    Tensor parallel: this rank holds num_attention_heads / tp_size heads; the latent, the caches
    and the indexer are replicated; o_proj's output is a partial sum, all-reduced over the ranks.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1, weight_format: str = "dequant"):
        super().__init__()
        self.cfg = cfg
        self.tp_size = tp_size
        self.num_heads = cfg.num_attention_heads // tp_size  # local heads
        h = self.num_heads
        fp8 = cfg if weight_format == "fp8" else None
        split = tp_size > 1  # q_b's rows and o_proj's columns are this rank's heads
        self.q_a_proj = block_linear(cfg.hidden_size, cfg.q_lora_rank, dtype, fp8)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
        self.q_b_proj = block_linear(cfg.q_lora_rank, h * cfg.qk_head_dim, dtype, fp8,
                                     h * cfg.qk_head_dim if split else None)
        self.kv_a_proj_with_mqa = block_linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype, fp8)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        # kv_b stays a dequantised bf16 weight: the absorbed decode reads it as W_uk / W_uv ([R] does too)
        self.kv_b_proj = linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype)
        self.o_proj = block_linear(h * cfg.v_head_dim, cfg.hidden_size, dtype, fp8, h * cfg.v_head_dim if split else None)
        self.indexer = Indexer(cfg, dtype, fp8)  # replicated: whole weights on every rank
        self.kv_cache_quantizer = KVCacheQuantizerSlot()
        self.kv_scale = 1.0  # per-layer MLA cache scale (fp8 mode), set from calibration
        # fp8: the linears of one input as one GEMM each (FusedFp8Linear), where their rows allow
        self.x_proj = fuse_linears(self, ("q_a_proj", "indexer.wk", "kv_a_proj_with_mqa"))
        self.cq_proj = fuse_linears(self, ("q_b_proj", "indexer.wq_b"))

    def forward(self, x, cos, sin, meta: dict, mla_pool, index_pool, cache_mode: str):
        cfg, h = self.cfg, self.num_heads
        num_tokens = x.shape[0]
        k_idx = q_idx = None  # the indexer's wk(x) and wq_b(c_q) where the fused projections ran them
        if self.x_proj is not None:
            c_q, k_idx, kv = self.x_proj.split(self.x_proj(x))
        else:
            c_q, kv = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        c_q = self.q_a_layernorm(c_q)
        if self.cq_proj is not None:
            q, q_idx = self.cq_proj.split(self.cq_proj(c_q))
        else:
            q = self.q_b_proj(c_q)
        q = q.view(num_tokens, h, cfg.qk_head_dim)
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        q_pe = rope_interleaved(q_pe, cos, sin)
        c_kv = self.kv_a_layernorm(kv[:, : cfg.kv_lora_rank])
        k_pe = rope_interleaved(kv[:, cfg.kv_lora_rank :], cos, sin)
        c_kv, k_pe = self.kv_cache_quantizer(c_kv, k_pe)
        gather = meta.get("gather_cache_rows")  # context parallel (export/parallel.py): every rank's rows
        if gather is not None:
            c_kv, k_pe = gather(c_kv), gather(k_pe)
        torch.ops.dsa.mla_cache_write(c_kv, k_pe, meta["slot_mapping"], mla_pool, self.kv_scale)

        w_kvb = self.kv_b_proj.weight.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w_kvb[:, : cfg.qk_nope_head_dim], w_kvb[:, cfg.qk_nope_head_dim :]
        slots = self.indexer(
            x, c_q, cos, sin, meta["slot_mapping"], index_pool, meta["page_table"], meta["req_idx"],
            meta["seq_lens"], cache_mode == "fp8", gather, q_proj=q_idx, k_proj=k_idx,
        )
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_uk)  # [T, H, 512]
        q_abs = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, 576]
        o_lat, _ = torch.ops.dsa.sparse_mla(q_abs, mla_pool, slots, self.kv_scale, cfg.softmax_scale)
        out = torch.einsum("thc,hvc->thv", o_lat.to(x.dtype), w_uv)  # [T, H, v]
        out = self.o_proj(out.reshape(num_tokens, h * cfg.v_head_dim))
        return torch.ops.dsa.all_reduce(out, self.tp_size) if self.tp_size > 1 else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                 expert_op: bool = False, weight_format: str = "dequant"):
        super().__init__()
        self.tp_size = tp_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSAAttention(cfg, dtype, tp_size, weight_format)
        self.dense_mlp = layer_idx < cfg.first_k_dense_replace
        if self.dense_mlp:  # intermediate dim split; the MoE all-reduces its own (fp32) sum
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size // tp_size, dtype,
                              cfg if weight_format == "fp8" else None, sharded=tp_size > 1)
        else:
            self.mlp = MoE(cfg, dtype, local_experts(cfg, tp_rank, tp_size), tp_size, expert_op, weight_format)

    def forward(self, h, cos, sin, meta, mla_pool, index_pool, cache_mode):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, mla_pool, index_pool, cache_mode)
        m = self.mlp(self.post_attention_layernorm(h))
        if self.dense_mlp and self.tp_size > 1:
            m = torch.ops.dsa.all_reduce(m, self.tp_size)
        return h + m


class DSAModelBody(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                 expert_op: bool = False, weight_format: str = "dequant"):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, dtype, tp_rank, tp_size, expert_op, weight_format)
             for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def step_meta(cfg: ModelConfig, inv_freq: torch.Tensor, positions, req_idx, page_table, slot_mapping):
    """(cos, sin, meta): RoPE of the step's positions and what every layer reads of the step
    (the main network's and the MTP draft's)."""
    cos, sin = rope_cos_sin(positions, inv_freq, cfg.rope_attention_scaling())
    meta = {
        "positions": positions,
        "req_idx": req_idx,
        "page_table": page_table,
        "slot_mapping": slot_mapping,
        "seq_lens": (positions + 1).to(torch.int32),  # causal: keys [0, pos] of own sequence
    }
    return cos, sin, meta


class DSAForCausalLM(nn.Module):
    """Parameter names equal the HF checkpoint's (``model.layers.0.self_attn.q_a_proj.weight``...), but
    for an fp8 network's fused projections (export/layers.py FusedFp8Linear: ``self_attn.x_proj``,
    ``self_attn.cq_proj``, ``mlp.gate_up_proj``), stacked from their parts at load.

    ``tp_rank``/``tp_size``: this module is rank ``tp_rank``'s shard of a tensor-parallel engine
    (export/sharding.py says which slice of each checkpoint tensor it holds); every rank returns
    the same full logits. ``expert_op``: the MoE layers' routed experts run as one dsa::moe_experts
    call each (export/layers.py StackedExperts; bf16 networks only); None: on for bf16 networks.
    ``weight_format`` (export/layers.py resolve_weight_format; the resolved value is
    ``self.weight_format``): "fp8" keeps every Linear an fp8-block checkpoint stores in e4m3 (but
    kv_b, read as a matrix by the absorbed decode) as an Fp8Linear (W8A8 through
    dsa::fp8_block_linear; bf16 networks) and the stacked experts e4m3; a tensor-parallel slice off
    the 128-block grid is dequantised under "auto" (``dequantised_linears`` names them) and an
    error under "fp8". "dequant": the e4m3 weights dequantised to ``dtype``.
    """

    def __init__(self, cfg: ModelConfig, cache_mode: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                 tp_rank: int = 0, tp_size: int = 1, expert_op: bool | None = None, weight_format: str = "auto"):
        super().__init__()
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode {cache_mode!r} not in {CACHE_MODES}")
        check_tp(cfg, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} not in [0, {tp_size})")
        self.cfg, self.cache_mode, self.dtype = cfg, cache_mode, dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight_format = resolve_weight_format(cfg, dtype, weight_format)
        self.expert_op = dtype == torch.bfloat16 if expert_op is None else expert_op
        self.model = DSAModelBody(cfg, dtype, tp_rank, tp_size, self.expert_op, self.weight_format)
        self.dequantised_linears = check_dequantised(self, weight_format, tp_size)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)
        # True in engines built for speculative decoding: forward returns (logits, hidden) (dsa_trt/step.py)
        self.return_hidden = False

    def set_kv_scales(self, scales: list[float]) -> None:
        for layer, s in zip(self.model.layers, scales, strict=True):
            layer.self_attn.kv_scale = float(s)

    def forward(self, input_ids, positions, req_idx, page_table, slot_mapping, logits_indices,
                mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor]) -> torch.Tensor:
        cos, sin, meta = step_meta(self.cfg, self.inv_freq, positions, req_idx, page_table, slot_mapping)
        h = self.model.embed_tokens(input_ids)
        for layer, mla_pool, index_pool in zip(self.model.layers, mla_pools, index_pools):
            h = layer(h, cos, sin, meta, mla_pool, index_pool, self.cache_mode)
        if self.return_hidden:  # the MTP draft program's input: every token's final-norm state (dsa_trt/step.py)
            h = self.model.norm(h)  # row-wise, so norm(h)[rows] == norm(h[rows])
            return fp32_linear(h[logits_indices], self.lm_head.weight), h
        h = self.model.norm(h[logits_indices])
        return fp32_linear(h, self.lm_head.weight)  # lm_head in fp32 (docs/architecture.md §8)
