"""The paged dual-cache layout: the one definition of every size the kernels, the TensorRT plugins,
the exported programs and the runtime agree on (docs/architecture.md §5).

The kernel library states the same numbers as ``#define DSA_*`` in plugins/csrc/dsa_kernels.h
(and dsa_moe_kernels.h); tests/test_cache_layout.py parses those headers and checks that they
equal the constants here, so a change on one side fails the tests until the other side follows.

    MLA pool, per layer      [num_pages, 64, 576]   fp8 mode: uint8 e4m3 (value = e4m3 * kv_scale)
                                                    bf16 / fp32 modes: that dtype
    indexer pool, per layer  [num_pages, 64*132]    fp8 mode: uint8, the page's 64x128 e4m3 keys
                                                    first, then its 64 fp32 scales (8448 B/page)
                             [num_pages, 64, 128]   bf16 / fp32 modes: that dtype

One page id indexes both pools of every layer, so a token's two cache entries live, are shared
and are freed together.
"""

from __future__ import annotations

import torch

PAGE_SIZE = 64  # tokens per page; a cache slot is page * 64 + offset, slot -1 = "do not write"

# MLA latent cache: [c_kv (kv_lora_rank) ; k_pe (qk_rope_head_dim)] per token
MLA_NOPE_DIM = 512  # kv_lora_rank; also the value width of the absorbed attention output
MLA_ROPE_DIM = 64  # qk_rope_head_dim
MLA_LATENT_DIM = MLA_NOPE_DIM + MLA_ROPE_DIM  # 576
MLA_V_DIM = MLA_NOPE_DIM  # sparse MLA output width: the latent's first 512 dims are the values

# Indexer key cache, fp8 mode: per token one e4m3 key row and one fp32 scale (block 128)
INDEX_DIM = 128  # index_head_dim
INDEX_SCALE_BYTES = 4  # one fp32 scale per token
INDEX_K_ROW_BYTES = INDEX_DIM + INDEX_SCALE_BYTES  # 132 bytes per token
INDEX_KEYS_BYTES = PAGE_SIZE * INDEX_DIM  # 8192: the page's key matrix, then its scales
INDEX_PAGE_BYTES = PAGE_SIZE * INDEX_K_ROW_BYTES  # 8448

FP8_E4M3_MAX = 448.0  # OCP e4m3fn
FP8_BLOCK = 128  # block edge of the fp8 block-scaled weights and of act_quant's groups

# DsaCacheFormat of the kernel library (the cache_format field of the plugins)
CACHE_FORMATS = {"fp8": 0, "bf16": 1}

CACHE_MODES = ("fp8", "bf16", "fp32")
EXACT_POOL_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BYTES_PER_INT32 = 4  # fp8 byte pools cross the TensorRT boundary as INT32 carriers (PLUGINS.md)


def _check_mode(cache_mode: str) -> None:
    if cache_mode not in CACHE_MODES:
        raise ValueError(f"cache_mode {cache_mode!r} not in {CACHE_MODES}")


def pool_dtype(cache_mode: str) -> torch.dtype:
    """Element dtype of both pools: uint8 bytes in fp8 mode, the float dtype in the exact modes."""
    _check_mode(cache_mode)
    return torch.uint8 if cache_mode == "fp8" else EXACT_POOL_DTYPES[cache_mode]


def mla_page_shape(cache_mode: str) -> tuple[int, ...]:
    """Shape of one page of the MLA pool (the pool is [num_pages, *this])."""
    _check_mode(cache_mode)
    return (PAGE_SIZE, MLA_LATENT_DIM)


def index_page_shape(cache_mode: str) -> tuple[int, ...]:
    """Shape of one page of the indexer pool (the pool is [num_pages, *this])."""
    _check_mode(cache_mode)
    return (INDEX_PAGE_BYTES,) if cache_mode == "fp8" else (PAGE_SIZE, INDEX_DIM)


def mla_bytes_per_token(cache_mode: str) -> int:
    """Bytes per token per layer of the MLA pool: 576 (fp8), 1152 (bf16), 2304 (fp32)."""
    return MLA_LATENT_DIM * pool_dtype(cache_mode).itemsize


def index_bytes_per_token(cache_mode: str) -> int:
    """Bytes per token per layer of the indexer pool: 132 (fp8), 256 (bf16), 512 (fp32)."""
    return INDEX_K_ROW_BYTES if cache_mode == "fp8" else INDEX_DIM * pool_dtype(cache_mode).itemsize
