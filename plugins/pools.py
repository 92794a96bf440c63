"""Allocation of the paged dual caches in the layouts the DSA operators read (docs/architecture.md §5)."""

from __future__ import annotations

import torch

from dsa_trt.config import INDEX_K_ROW_BYTES, MLA_LATENT_DIM, PAGE_SIZE, ModelConfig

POOL_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def allocate_pools(cfg: ModelConfig, cache_mode: str, num_pages: int, device="cpu", num_layers: int | None = None
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (mla_pools, index_pools); one page id indexes both pools of every layer.

    fp8: MLA [P, 64, 576] uint8 (e4m3, per-layer scale), indexer [P, 64*132] uint8.
    bf16 / fp32 (exact modes): MLA [P, 64, 576], indexer [P, 64, 128] in that dtype.
    """
    n = cfg.num_hidden_layers if num_layers is None else num_layers
    if cache_mode == "fp8":
        mla_shape, idx_shape, dt, idt = (PAGE_SIZE, MLA_LATENT_DIM), (PAGE_SIZE * INDEX_K_ROW_BYTES,), torch.uint8, torch.uint8
    elif cache_mode in POOL_DTYPES:
        dt = idt = POOL_DTYPES[cache_mode]
        mla_shape, idx_shape = (PAGE_SIZE, MLA_LATENT_DIM), (PAGE_SIZE, cfg.index_head_dim)
    else:
        raise ValueError(f"cache_mode {cache_mode!r} not in ('fp8', 'bf16', 'fp32')")
    mla = [torch.zeros(num_pages, *mla_shape, dtype=dt, device=device) for _ in range(n)]
    idx = [torch.zeros(num_pages, *idx_shape, dtype=idt, device=device) for _ in range(n)]
    return mla, idx
