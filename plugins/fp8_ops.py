"""The real-size linear operators, entries of the ``dsa`` schema table (plugins/ops.py ``define_op``).

Importing this module defines them with the plain-torch reference (plugins/fp8_reference.py) as the
composite implementation (every device) and fake kernels for torch.export / AOTInductor; the CUDA
kernels come from the C++ binding (plugins/torch_binding/moe_ops.cpp):

Op name (torch)          ONNX op_type / TensorRT plugin
dsa::fp8_block_linear    DsaFp8BlockLinear
dsa::moe_experts         DsaMoeExperts
dsa::f32_linear          (none: Cast + MatMul, builder/onnx_export.py)

dsa::f32_linear is the fp32-output linear of bf16 operands (the router, the indexer's weights_proj,
the lm_head: export/layers.py fp32_linear) on CUDA: one bf16 GEMM with fp32 output, or, with
DSA_F32_LINEAR_ROWS=R set (the deterministic mode sets it: runtime/knobs.py), the same GEMM on
fixed chunks of R rows, the last one zero-padded to R, so that cuBLAS runs one kernel for every
row at every token count and a row's sums do not depend on the step (benchmarks/row_invariance.py).

Semantics and layouts: plugins/csrc/dsa_moe_kernels.h (the CUDA kernels' contract). The CUDA
binding checks what ``check_fp8_block_linear`` and ``check_moe_experts(..., check_values=False)``
check; it cannot read expert ids on the host without a device synchronisation (which would break
CUDA-graph capture), so the kernel skips ids outside [0, num_experts).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import fp8_reference as ref
from .ops import OpDef, define_op

PLUGIN_NAMES = {
    "fp8_block_linear": "DsaFp8BlockLinear",
    "moe_experts": "DsaMoeExperts",
}

FP8 = ref.FP8


class Fp8OpError(ValueError):
    """Bad input to dsa::fp8_block_linear / dsa::moe_experts; the message names the argument."""


def _require(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise Fp8OpError(f"dsa::{op}: {msg}")


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _check_tensor(op: str, name: str, t: torch.Tensor, rank: int, dtypes: tuple[torch.dtype, ...],
                  contiguous: bool = True) -> None:
    _require(t.dim() == rank, op, f"{name} must be {rank}-D, got shape {_shape(t)}")
    _require(t.dtype in dtypes, op, f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if contiguous:
        _require(t.is_contiguous(), op, f"{name} must be contiguous (shape {_shape(t)}, stride {list(t.stride())}); "
                 "pass .contiguous()")


def check_fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """Dtypes, ranks, contiguity and the scale shape; raises Fp8OpError naming the argument."""
    op = "fp8_block_linear"
    _check_tensor(op, "x", x, 2, (torch.bfloat16,), contiguous=False)
    _require(x.stride(1) == 1, op, f"x must have unit inner stride, got stride {list(x.stride())}")
    _check_tensor(op, "weight", weight, 2, (FP8,))
    _check_tensor(op, "weight_scale", weight_scale, 2, (torch.float32,))
    n, k = weight.shape
    _require(x.shape[1] == k, op, f"x has K={x.shape[1]} columns but weight [N, K] is {_shape(weight)}")
    want = [ref.num_blocks(n), ref.num_blocks(k)]
    _require(_shape(weight_scale) == want, op,
             f"weight_scale must be [ceil(N/128), ceil(K/128)] = {want} for weight {_shape(weight)}, got "
             f"{_shape(weight_scale)} (the checkpoint's weight_scale_inv of this weight)")


def check_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
                      num_experts: int, expert_offset: int, check_values: bool = True) -> None:
    """Everything about the arguments that shapes and dtypes say; with ``check_values`` also the
    expert ids (each in [0, num_experts), none repeated within a token), which reads the ids
    (a device synchronisation for CUDA tensors)."""
    op = "moe_experts"
    _check_tensor(op, "x", x, 2, (torch.bfloat16,))
    _check_tensor(op, "topk_ids", topk_ids, 2, (torch.int32,))
    _check_tensor(op, "topk_weights", topk_weights, 2, (torch.float32,))
    tokens, hidden = x.shape
    _require(topk_ids.shape[0] == tokens, op, f"topk_ids has {topk_ids.shape[0]} rows, x has {tokens} tokens")
    _require(_shape(topk_weights) == _shape(topk_ids), op,
             f"topk_weights {_shape(topk_weights)} must have the shape of topk_ids {_shape(topk_ids)}")
    _require(topk_ids.shape[1] >= 1, op, "topk_ids must have at least one column (top_k >= 1)")
    fp8 = w13.dtype == FP8
    _check_tensor(op, "w13", w13, 3, (FP8, torch.bfloat16))
    _check_tensor(op, "w2", w2, 3, (w13.dtype,))
    num_local, two_inter, w13_hidden = w13.shape
    _require(two_inter % 2 == 0 and two_inter > 0, op,
             f"w13 [E_local, 2I, D] must have an even, non-zero row count (gate then up), got {_shape(w13)}")
    inter = two_inter // 2
    _require(w13_hidden == hidden, op, f"w13 {_shape(w13)} must be [E_local, 2I, D] with D={hidden} (x's width)")
    _require(_shape(w2) == [num_local, hidden, inter], op,
             f"w2 must be [E_local, D, I] = {[num_local, hidden, inter]} to match w13 {_shape(w13)}, got {_shape(w2)}")
    for name, scale, rows, cols in (("w13_scale", w13_scale, two_inter, hidden), ("w2_scale", w2_scale, hidden, inter)):
        if not fp8:
            _require(scale is None, op, f"{name} must be None for bf16 weights (the scales belong to e4m3 weights)")
            continue
        _require(scale is not None, op, f"{name} is required for e4m3 weights (the checkpoint's weight_scale_inv)")
        _check_tensor(op, name, scale, 3, (torch.float32,))
        want = [num_local, ref.num_blocks(rows), ref.num_blocks(cols)]
        _require(_shape(scale) == want, op, f"{name} must be {want} (128x128 blocks of each expert), got {_shape(scale)}")
    _require(num_experts >= 1, op, f"num_experts must be >= 1, got {num_experts}")
    _require(0 <= expert_offset and expert_offset + num_local <= num_experts, op,
             f"expert_offset={expert_offset} with E_local={num_local} local experts must lie in "
             f"[0, num_experts={num_experts}]")
    if not check_values or topk_ids.numel() == 0:
        return
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    if bool(bad.any()):
        t, j = (int(v) for v in torch.nonzero(bad)[0])
        raise Fp8OpError(f"dsa::{op}: topk_ids[{t}, {j}] = {int(topk_ids[t, j])} is out of [0, num_experts="
                         f"{num_experts}); the router must return global expert ids")
    ids = topk_ids.sort(dim=1).values
    repeated = ids[:, 1:] == ids[:, :-1]
    if bool(repeated.any()):
        t, j = (int(v) for v in torch.nonzero(repeated)[0])
        raise Fp8OpError(f"dsa::{op}: topk_ids row {t} names expert {int(ids[t, j])} twice; each token's top-k "
                         "experts must be distinct")


def _fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      pow2_scales: bool) -> torch.Tensor:
    check_fp8_block_linear(x, weight, weight_scale)
    return ref.fp8_block_linear(x, weight, weight_scale, pow2_scales)


def _fp8_block_linear_fake(x, weight, weight_scale, pow2_scales):
    check_fp8_block_linear(x, weight, weight_scale)
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def _moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                 w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None, num_experts: int,
                 expert_offset: int, pow2_scales: bool) -> torch.Tensor:
    check_moe_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, num_experts, expert_offset)
    return ref.moe_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, num_experts, expert_offset,
                           pow2_scales)


def _moe_experts_fake(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, num_experts, expert_offset,
                      pow2_scales):
    check_moe_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, num_experts, expert_offset,
                      check_values=False)
    return x.new_empty((x.shape[0], x.shape[1]), dtype=torch.float32)


F32_ROWS_KNOB = "DSA_F32_LINEAR_ROWS"
F32_ROWS_MAX = 65536


def f32_linear_rows(environ=None) -> int:
    """DSA_F32_LINEAR_ROWS: the row chunk of dsa::f32_linear, 0 when unset (one GEMM)."""
    env = os.environ if environ is None else environ
    text = env.get(F32_ROWS_KNOB, "")
    if text == "":
        return 0
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if not 1 <= rows <= F32_ROWS_MAX:
        raise Fp8OpError(f"{F32_ROWS_KNOB}={text!r} must be an integer in [1, {F32_ROWS_MAX}] (rows per GEMM of "
                         "dsa::f32_linear; unset: one GEMM)")
    return rows


def check_f32_linear(x: torch.Tensor, weight: torch.Tensor) -> None:
    _require(x.dim() == 2 and weight.dim() == 2, "f32_linear",
             f"x must be [T, K] and weight [N, K] (got {_shape(x)} and {_shape(weight)})")
    _require(x.shape[1] == weight.shape[1], "f32_linear",
             f"x has K={x.shape[1]} columns but weight [N, K] is {_shape(weight)}")
    _require(x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float32), "f32_linear",
             f"x and weight must both be bfloat16 or both float32 (got {x.dtype} and {weight.dtype})")


def _f32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in fp32: bf16 CUDA operands through the bf16 GEMM with fp32 output (in chunks of
    DSA_F32_LINEAR_ROWS rows when set, as the CUDA kernel does), anything else through the fp32
    GEMM of the cast operands (aten::mm.dtype has no CPU kernel)."""
    check_f32_linear(x, weight)
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return F.linear(x.float(), weight.float())
    rows = f32_linear_rows()
    if rows == 0 or x.shape[0] == 0:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    t = x.shape[0]
    padded = torch.zeros(-(-t // rows) * rows, x.shape[1], device=x.device, dtype=x.dtype)
    padded[:t] = x
    out = torch.cat([torch.mm(c, weight.t(), out_dtype=torch.float32) for c in padded.split(rows)])
    return out[:t].contiguous()


def _f32_linear_fake(x, weight):
    check_f32_linear(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


# the schema table's entries (plugins/ops.py OPS; the same strings in torch_binding/dsa_schemas.cpp)
define_op(OpDef("fp8_block_linear", "(Tensor x, Tensor weight, Tensor weight_scale, bool pow2_scales) -> Tensor",
                _fp8_block_linear, _fp8_block_linear_fake, PLUGIN_NAMES["fp8_block_linear"]))
define_op(OpDef("moe_experts", "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor? w13_scale, "
                "Tensor w2, Tensor? w2_scale, int num_experts, int expert_offset, bool pow2_scales) -> Tensor",
                _moe_experts, _moe_experts_fake, PLUGIN_NAMES["moe_experts"]))
define_op(OpDef("f32_linear", "(Tensor x, Tensor weight) -> Tensor", _f32_linear, _f32_linear_fake))
fp8_block_linear = torch.ops.dsa.fp8_block_linear
moe_experts = torch.ops.dsa.moe_experts
f32_linear = torch.ops.dsa.f32_linear
