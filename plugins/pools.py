"""Allocation of the paged dual caches in the layouts the DSA operators read (dsa_trt/cache_layout.py)."""

from __future__ import annotations

import torch

from dsa_trt.cache_layout import CACHE_MODES, index_page_shape, mla_page_shape, pool_dtype
from dsa_trt.config import ModelConfig


def allocate_pools(cfg: ModelConfig, cache_mode: str, num_pages: int, device="cpu", num_layers: int | None = None
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (mla_pools, index_pools); one page id indexes both pools of every layer.

    fp8: MLA [P, 64, 576] uint8 (e4m3, per-layer scale), indexer [P, 64*132] uint8.
    bf16 / fp32 (exact modes): MLA [P, 64, 576], indexer [P, 64, 128] in that dtype.
    """
    if cache_mode not in CACHE_MODES:
        raise ValueError(f"cache_mode {cache_mode!r} not in {CACHE_MODES}")
    n = cfg.num_hidden_layers if num_layers is None else num_layers
    dt = pool_dtype(cache_mode)
    mla = [torch.zeros(num_pages, *mla_page_shape(cache_mode), dtype=dt, device=device) for _ in range(n)]
    idx = [torch.zeros(num_pages, *index_page_shape(cache_mode), dtype=dt, device=device) for _ in range(n)]
    return mla, idx
