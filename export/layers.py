"""Building blocks of the DSA network that are not attention: norms, RoPE, Hadamard, FFN, MoE.

All modules hold their weights under the Hugging Face checkpoint names (``weight``, ``bias``,
``e_score_correction_bias``), so ``load_state_dict`` takes the checkpoint's names unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsa_trt.config import ModelConfig


class RMSNorm(nn.Module):
    """fp32 math, fp32 weight (docs/architecture.md §8), output in the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


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


class SwiGLU(nn.Module):
    """Dense FFN / one expert: down(silu(gate x) * up x); silu*up in fp32 (docs/architecture.md §8)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = linear(dim, inter, dtype)
        self.up_proj = linear(dim, inter, dtype)
        self.down_proj = linear(inter, dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x).float()) * self.up_proj(x).float()
        return self.down_proj(h.to(x.dtype))


class Router(nn.Module):
    """Sigmoid + correction bias + group-limited top-k (docs/architecture.md §8); weights and math in fp32."""

    def __init__(self, cfg: ModelConfig, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, cfg.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> dense combine weights [T, E] fp32 (zero for unselected experts)."""
        cfg = self.cfg
        scores = torch.sigmoid(x.float() @ self.weight.float().t())  # [T, E]
        choice = scores + self.e_score_correction_bias
        num_tokens, num_experts = scores.shape
        grouped = choice.view(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
        group_idx = group_scores.topk(cfg.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1).indices  # [T, k]
        w = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
        return torch.zeros_like(scores).scatter(1, idx, w)


class MoE(nn.Module):
    """Routed experts + shared experts, fp32 combine.

    Every local expert runs on every token and is weighted by the (mostly zero) combine weights:
    no data-dependent shapes, so the graph exports and compiles as is. The cost is E/top_k times
    the routed FLOPs, which is fine for the small models this path serves; a grouped-GEMM expert
    op is the place to change that for the 671B model.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, expert_range: tuple[int, int] | None = None,
                 tp_size: int = 1):
        super().__init__()
        self.gate = Router(cfg, cfg.n_routed_experts)
        lo, hi = expert_range or (0, cfg.n_routed_experts)
        self.expert_lo, self.expert_hi = lo, hi
        self.tp_size = tp_size
        self.experts = nn.ModuleDict(
            {str(e): SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size, dtype) for e in range(lo, hi)}
        )
        # tensor parallel: this rank's experts [lo, hi) and 1/tp of the shared experts' width
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts // tp_size, dtype)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        combine = self.gate(x)  # [T, E]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.expert_lo, self.expert_hi):
            out = out + combine[:, e : e + 1] * self.experts[str(e)](x).float()
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        if self.tp_size > 1:  # partial sums of the ranks, added in fp32
            out = torch.ops.dsa.all_reduce(out, self.tp_size)
        return out.to(x.dtype)
