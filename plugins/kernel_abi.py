"""The kernel library's C API for the linear operators (plugins/csrc/dsa_moe_kernels.h) through ctypes.

For the tests and benchmarks that need what ``torch.ops.dsa.fp8_block_linear`` / ``moe_experts``
do not expose: the plan a linear runs (``dsa_fp8_block_linear_path``), workspace sizes, launches on
caller-owned buffers with the launchers' raw status codes. Everything that only runs an operator
goes through the torch ops (plugins/cuda_ops.py); the engine never imports this module.

The params structs below mirror the header's, field by field; tests/test_kernel_abi.py parses the
header and compiles it to check names, order, types, offsets and sizes. Loading needs no GPU (the
plan and workspace functions are host code), and importing this module loads nothing.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_char_p, c_int, c_int64, c_size_t, c_void_p
from pathlib import Path

import torch

LIB_ENV = "DSA_KERNEL_LIB"
DEFAULT_LIB = Path(__file__).resolve().parents[1] / "build" / "libdsa_kernels.so"
HEADER = Path(__file__).resolve().parent / "csrc" / "dsa_moe_kernels.h"

# enum DsaStatus (dsa_kernels.h) and DsaMoeWeightFormat
OK, ERR_INVALID_ARG, ERR_UNSUPPORTED, ERR_CUDA = 0, -1, -2, -3
MOE_FP8_BLOCK, MOE_BF16 = 0, 1


class Fp8BlockLinearParams(ctypes.Structure):
    """DsaFp8BlockLinearParams."""

    _fields_ = [
        ("x", c_void_p), ("weight", c_void_p), ("weight_scale", c_void_p), ("out", c_void_p),
        ("num_tokens", c_int64), ("n", c_int), ("k", c_int), ("x_stride", c_int64), ("out_stride", c_int64),
        ("pow2_act_scales", c_int), ("workspace", c_void_p),
    ]


class MoeExpertsParams(ctypes.Structure):
    """DsaMoeExpertsParams."""

    _fields_ = [
        ("x", c_void_p), ("topk_ids", c_void_p), ("topk_weights", c_void_p), ("w13", c_void_p),
        ("w13_scale", c_void_p), ("w2", c_void_p), ("w2_scale", c_void_p), ("out", c_void_p),
        ("num_tokens", c_int64), ("top_k", c_int), ("num_experts", c_int), ("num_local_experts", c_int),
        ("expert_offset", c_int), ("hidden", c_int), ("inter", c_int), ("weight_format", c_int),
        ("pow2_act_scales", c_int), ("workspace", c_void_p),
    ]


STRUCTS = {"DsaFp8BlockLinearParams": Fp8BlockLinearParams, "DsaMoeExpertsParams": MoeExpertsParams}

# function -> (restype, argtypes) as declared in dsa_kernels.h / dsa_moe_kernels.h
SIGNATURES = {
    "dsa_last_error_message": (c_char_p, []),
    "dsa_fp8_block_linear_workspace_size": (c_size_t, [c_int64, c_int, c_int]),
    "dsa_launch_fp8_block_linear": (c_int, [POINTER(Fp8BlockLinearParams), c_void_p]),
    "dsa_fp8_block_linear_path": (c_char_p, [c_int64, c_int, c_int]),
    "dsa_moe_experts_workspace_size": (c_size_t, [c_int64, c_int, c_int, c_int, c_int, c_int]),
    "dsa_launch_moe_experts": (c_int, [POINTER(MoeExpertsParams), c_void_p]),
    "dsa_moe_experts_path": (c_char_p, [c_int64, c_int, c_int, c_int]),
    "dsa_sparse_mla_workspace_size": (c_size_t, [c_int64, c_int, c_int, c_int]),
}


def library_path() -> Path:
    """DSA_KERNEL_LIB, else build/libdsa_kernels.so of this checkout."""
    return Path(os.environ.get(LIB_ENV) or DEFAULT_LIB)


class KernelLibrary:
    """The loaded kernel library with the signatures above declared (``dll``), and its helpers."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else library_path()
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path} missing: build the kernel library first (make kernels), "
                                    f"or point {LIB_ENV} at one")
        self.dll = ctypes.CDLL(str(self.path))
        missing = [name for name in SIGNATURES if not hasattr(self.dll, name)]
        if missing:
            raise RuntimeError(f"{self.path} is a stale build (no {', '.join(missing)}): "
                               "rebuild it with `make kernels`")
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(self.dll, name)
            fn.restype, fn.argtypes = restype, argtypes

    def error(self) -> str:
        """dsa_last_error_message() of this thread."""
        return self.dll.dsa_last_error_message().decode()

    def linear_path(self, num_tokens: int, n: int, k: int) -> str:
        """The plan a (T, N, K) launch runs, e.g. "tma 128x128 split 1" (honours DSA_FP8_LINEAR_PATH)."""
        return self.dll.dsa_fp8_block_linear_path(num_tokens, n, k).decode()

    def moe_path(self, num_tokens: int, top_k: int, num_local_experts: int, inter: int = 2048) -> str:
        """The expert GEMMs an fp8 MoE launch runs, e.g. "tma-fused 128x128" or "legacy 128xBN"
        (honours DSA_MOE_GEMM_PATH; inter: the experts' intermediate size, V3.2's by default)."""
        return self.dll.dsa_moe_experts_path(num_tokens, top_k, num_local_experts, inter).decode()

    @staticmethod
    def stream() -> c_void_p:
        """torch's current CUDA stream, as the launchers take it."""
        return c_void_p(torch.cuda.current_stream().cuda_stream)
