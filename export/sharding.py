"""Tensor-parallel sharding of a checkpoint: a declarative HF-name -> shard-dim table (docs/architecture.md §7).

Rank r of N holds:
* MLA: heads [r*H/N, (r+1)*H/N): rows of q_b_proj and kv_b_proj (per head, contiguous), columns
  of o_proj. q_a / kv_a projections, their norms and the indexer are replicated: the 576-d latent
  and the indexer keys are per token, not per head, so every rank writes the same caches and the
  indexer's top-k (a sum over its heads) is computed identically everywhere.
* dense MLP and shared experts: gate/up rows, down columns (intermediate dim split).
* routed experts: experts [r*E/N, (r+1)*E/N) whole; the router is replicated.
* embedding, final norm and lm_head: replicated (simple; a vocab-parallel lm_head would save
  memory on the 671B model at the cost of an all-gather).
Row-parallel outputs (o_proj, down projections, the expert sum) are partial sums, added by
``dsa::all_reduce`` in the network. e4m3 weights are sliced as stored, with their block scales
(shard_dim); dequantised ones after dequantisation.
"""

from __future__ import annotations

import re

import torch

from dsa_trt.config import ConfigError, ModelConfig

REPLICATED = None
COLUMN = 0  # split the output features (rows of the [out, in] weight)
ROW = 1  # split the input features (columns): the output is a partial sum

# (pattern on the HF parameter name, shard dim); first match wins; no match = replicated.
SHARD_DIMS: tuple[tuple[str, int | None], ...] = (
    (r"\.self_attn\.q_b_proj\.weight$", COLUMN),
    (r"\.self_attn\.kv_b_proj\.weight$", COLUMN),
    (r"\.self_attn\.o_proj\.weight$", ROW),
    (r"\.self_attn\.indexer\.", REPLICATED),
    (r"\.mlp\.(shared_experts\.)?(gate|up)_proj\.weight$", COLUMN),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", ROW),
    # routed experts are split by index: the network only has (and loads) its local ones
    (r"\.mlp\.experts\.\d+\.", REPLICATED),
)
_COMPILED = tuple((re.compile(p), d) for p, d in SHARD_DIMS)


def shard_dim(name: str) -> int | None:
    """The dim along which parameter ``name`` is split across ranks, or None when replicated.

    An e4m3 weight's ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] splits along its weight's
    dim: rank r's slice of the weight keeps whole 128x128 blocks when its width is a multiple of
    128 (the network dequantises the linears whose slice is not: layers.block_linear), and the
    scale rows (or columns) of those blocks are then slice r of the scale."""
    name = name.removesuffix("_scale_inv")
    for pattern, dim in _COMPILED:
        if pattern.search(name):
            return dim
    return REPLICATED


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s slice of the full checkpoint tensor ``name`` (contiguous)."""
    dim = shard_dim(name)
    if tp_size == 1 or dim is None:
        return full
    if full.shape[dim] % tp_size:
        raise ConfigError(f"{name}: dim {dim} of shape {tuple(full.shape)} is not divisible by tp={tp_size}")
    return full.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def local_experts(cfg: ModelConfig, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[lo, hi) of the routed experts rank ``tp_rank`` holds."""
    per_rank = cfg.n_routed_experts // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """Every split dimension must divide evenly; the message names the ones that do not."""
    if tp_size < 1:
        raise ConfigError(f"tp={tp_size}: must be >= 1")
    splits = {
        "num_attention_heads": cfg.num_attention_heads,
        "n_routed_experts": cfg.n_routed_experts,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size * n_shared_experts": cfg.moe_intermediate_size * cfg.n_shared_experts,
    }
    bad = [f"{k} = {v}" for k, v in splits.items() if v % tp_size]
    if bad:
        raise ConfigError(f"tp={tp_size} does not divide {', '.join(bad)}; choose a tp that divides them")
