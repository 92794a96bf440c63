"""The DSA operators as torch custom ops, namespace ``dsa`` (docs/architecture.md §4).

Importing this module registers ``torch.ops.dsa.*`` with the plain-torch reference
(plugins/reference.py) as the implementation for every device, plus fake (meta) kernels so
torch.export / AOTInductor can trace them. ``dsa_trt.plugins.cuda_ops`` overrides the CUDA
implementations with our kernel library when it is built (``DSA_KERNELS``, see README).

Op name (torch)              ONNX op_type / TensorRT plugin
dsa::mla_cache_write         DsaMlaCacheWrite
dsa::indexer_k_cache_write   DsaIndexerKCacheWrite
dsa::indexer_logits          DsaIndexerLogits
dsa::topk_translate          DsaTopkTranslate
dsa::sparse_mla              DsaSparseMla
"""

from __future__ import annotations

import torch

from dsa_trt.config import PAGE_SIZE

from . import reference as ref

MLA_V_DIM = ref.MLA_V_DIM

PLUGIN_NAMES = {
    "mla_cache_write": "DsaMlaCacheWrite",
    "indexer_k_cache_write": "DsaIndexerKCacheWrite",
    "indexer_logits": "DsaIndexerLogits",
    "topk_translate": "DsaTopkTranslate",
    "sparse_mla": "DsaSparseMla",
}


@torch.library.custom_op("dsa::mla_cache_write", mutates_args=("pool",))
def mla_cache_write(
    kv_latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor, pool: torch.Tensor, kv_scale: float
) -> None:
    ref.mla_cache_write(kv_latent, k_pe, slot_mapping, pool, kv_scale)


@mla_cache_write.register_fake
def _(kv_latent, k_pe, slot_mapping, pool, kv_scale) -> None:
    return None


@torch.library.custom_op("dsa::indexer_k_cache_write", mutates_args=("pool",))
def indexer_k_cache_write(index_k: torch.Tensor, slot_mapping: torch.Tensor, pool: torch.Tensor) -> None:
    ref.indexer_k_cache_write(index_k, slot_mapping, pool)


@indexer_k_cache_write.register_fake
def _(index_k, slot_mapping, pool) -> None:
    return None


@torch.library.custom_op("dsa::indexer_logits", mutates_args=())
def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    pool: torch.Tensor,
    page_table: torch.Tensor,
    req_idx: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    return ref.indexer_logits(q, weights, pool, page_table, req_idx, seq_lens)


@indexer_logits.register_fake
def _(q, weights, pool, page_table, req_idx, seq_lens):
    return q.new_empty((q.shape[0], page_table.shape[1] * PAGE_SIZE), dtype=torch.float32)


@torch.library.custom_op("dsa::topk_translate", mutates_args=())
def topk_translate(
    logits: torch.Tensor, lengths: torch.Tensor, page_table: torch.Tensor, req_idx: torch.Tensor, k: int
) -> torch.Tensor:
    return ref.topk_translate(logits, lengths, page_table, req_idx, k)[0]


@topk_translate.register_fake
def _(logits, lengths, page_table, req_idx, k):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("dsa::sparse_mla", mutates_args=())
def sparse_mla(
    q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, kv_scale: float, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.sparse_mla(q, pool, slots, kv_scale, sm_scale)


@sparse_mla.register_fake
def _(q, pool, slots, kv_scale, sm_scale):
    num_tokens, heads = q.shape[0], q.shape[1]
    return q.new_empty((num_tokens, heads, MLA_V_DIM)), q.new_empty((num_tokens, heads), dtype=torch.float32)
