"""The DSA operators as torch ops, namespace ``dsa``, defined from ONE schema table (docs/architecture.md §4).

Importing this module defines ``torch.ops.dsa.*`` from the schema strings of ``OPS``, with the
plain-torch reference (plugins/reference.py) as the CompositeExplicitAutograd kernel (every
device, CUDA tensors included under ``DSA_KERNELS=reference``) and a fake kernel so torch.export
/ AOTInductor can trace them. The CUDA kernels are registered from C++
(plugins/torch_binding/dsa_torch_ops.cpp, ``TORCH_LIBRARY_IMPL(dsa, CUDA, m)``) when
``dsa_trt.plugins.cuda_ops.load()`` loads build/libdsa_torch_ops.so; a backend kernel takes
precedence over the composite one, so the reference then serves the CPU only.

A process without Python (runtime/cpp/dsa_step.cpp) defines the same schemas in C++:
plugins/torch_binding/dsa_schemas.cpp, which tests/test_op_schemas.py keeps equal to ``OPS``.

Adding an operator: one ``define_op(OpDef(...))`` call (here or in a sibling module such as
plugins/fp8_ops.py, listed in tests/test_op_schemas.py OP_MODULES), its ``m.def`` line in
dsa_schemas.cpp, and its CUDA ``m.impl`` in the binding (steps in the header of
plugins/torch_binding/dsa_torch_ops.cpp).

Op name (torch)              ONNX op_type / TensorRT plugin
dsa::mla_cache_write         DsaMlaCacheWrite
dsa::indexer_k_cache_write   DsaIndexerKCacheWrite
dsa::indexer_logits          DsaIndexerLogits
dsa::topk_translate          DsaTopkTranslate
dsa::sparse_mla              DsaSparseMla
dsa::fp8_block_linear        DsaFp8BlockLinear   (plugins/fp8_ops.py)
dsa::moe_experts             DsaMoeExperts       (plugins/fp8_ops.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dsa_trt.config import PAGE_SIZE

from . import reference as ref

MLA_V_DIM = ref.MLA_V_DIM
NAMESPACE = "dsa"


@dataclass(frozen=True)
class OpDef:
    """One operator: ``dsa::<name><schema>``, its reference (any device) and fake (tracing) kernels."""

    name: str
    schema: str  # "(args) -> returns" in the dispatcher's schema language, identical in dsa_schemas.cpp
    reference: Callable
    fake: Callable
    plugin: str | None = None  # ONNX op_type / TensorRT plugin name (None: no plugin)


OPS: dict[str, OpDef] = {}
# FRAGMENT, not DEF: other modules (collectives.py, fp8_ops.py) add ops to the same namespace.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_op(op: OpDef) -> None:
    """Define ``dsa::<op.name>`` from its schema, with the reference and fake kernels."""
    if op.name in OPS:
        raise ValueError(f"dsa::{op.name} is defined twice (plugins/ops.py OPS already has it)")
    _LIB.define(op.name + op.schema)
    _LIB.impl(op.name, op.reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{op.name}", op.fake, lib=_LIB)
    OPS[op.name] = op


# ---------------------------------------------------------------- the five DSA operators
def _none_fake(*args) -> None:
    return None


def _indexer_logits_fake(q, weights, pool, page_table, req_idx, seq_lens):
    return q.new_empty((q.shape[0], page_table.shape[1] * PAGE_SIZE), dtype=torch.float32)


def _topk_translate_ref(logits, lengths, page_table, req_idx, k):
    return ref.topk_translate(logits, lengths, page_table, req_idx, k)[0]


def _topk_translate_fake(logits, lengths, page_table, req_idx, k):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


def _sparse_mla_fake(q, pool, slots, kv_scale, sm_scale):
    num_tokens, heads = q.shape[0], q.shape[1]
    return q.new_empty((num_tokens, heads, MLA_V_DIM)), q.new_empty((num_tokens, heads), dtype=torch.float32)


for _op in (
    OpDef("mla_cache_write",
          "(Tensor kv_latent, Tensor k_pe, Tensor slot_mapping, Tensor(a!) pool, float kv_scale) -> ()",
          ref.mla_cache_write, _none_fake, "DsaMlaCacheWrite"),
    OpDef("indexer_k_cache_write", "(Tensor index_k, Tensor slot_mapping, Tensor(a!) pool) -> ()",
          ref.indexer_k_cache_write, _none_fake, "DsaIndexerKCacheWrite"),
    OpDef("indexer_logits",
          "(Tensor q, Tensor weights, Tensor pool, Tensor page_table, Tensor req_idx, Tensor seq_lens) -> Tensor",
          ref.indexer_logits, _indexer_logits_fake, "DsaIndexerLogits"),
    OpDef("topk_translate", "(Tensor logits, Tensor lengths, Tensor page_table, Tensor req_idx, SymInt k) -> Tensor",
          _topk_translate_ref, _topk_translate_fake, "DsaTopkTranslate"),
    OpDef("sparse_mla", "(Tensor q, Tensor pool, Tensor slots, float kv_scale, float sm_scale) -> (Tensor, Tensor)",
          ref.sparse_mla, _sparse_mla_fake, "DsaSparseMla"),
):
    define_op(_op)

from . import fp8_ops  # noqa: E402,F401  (the real-size linear ops: fp8_block_linear, moe_experts)

# The ONNX op_type / TensorRT plugin of each op (builder/onnx_export.py, tests/test_tensorrt_plugins.py).
PLUGIN_NAMES = {name: op.plugin for name, op in OPS.items() if op.plugin}
