"""The C++ torch binding (plugins/torch_binding, plugins/cuda_ops.py): loading, no silent fallback,
one head-padding behaviour. The CPU tests check the knobs and errors without a GPU; the GPU
tests (H200) need `make kernels torch-ops`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsa_trt.plugins import cuda_ops, ops
from dsa_trt.plugins import reference as ref

@pytest.fixture
def fresh_library(monkeypatch):
    """cuda_ops with no library loaded yet (library() caches its result per process)."""
    monkeypatch.setattr(cuda_ops, "_lib", None)
    monkeypatch.setattr(cuda_ops, "_lib_error", None)
    return cuda_ops


# ---------------------------------------------------------------- CPU: knobs and errors
def test_mode_knob(monkeypatch):
    monkeypatch.setenv("DSA_KERNELS", "reference")
    assert cuda_ops.resolve_mode() == "reference"
    assert cuda_ops.load() is False  # reference: nothing loaded, the reference serves CUDA tensors
    for alias in ("auto", ""):
        monkeypatch.setenv("DSA_KERNELS", alias)
        assert cuda_ops.resolve_mode() == ("cuda" if torch.cuda.is_available() else "reference")
    monkeypatch.setenv("DSA_KERNELS", "fast")
    with pytest.raises(ValueError, match="DSA_KERNELS='fast' not in"):
        cuda_ops.resolve_mode()


def test_missing_library_is_an_error_naming_the_fix(fresh_library, monkeypatch, tmp_path):
    monkeypatch.setenv("DSA_TORCH_OPS_LIB", str(tmp_path / "libdsa_torch_ops.so"))
    with pytest.raises(RuntimeError, match=r"libdsa_torch_ops.so is missing.*make kernels torch-ops.*DSA_KERNELS=reference"):
        fresh_library.load("cuda")
    assert fresh_library.library() is None and "missing" in fresh_library.library_error()


def test_broken_library_is_an_error(fresh_library, monkeypatch, tmp_path):
    bad = tmp_path / "libdsa_torch_ops.so"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setenv("DSA_TORCH_OPS_LIB", str(bad))
    with pytest.raises(RuntimeError, match="failed to load"):
        fresh_library.load("cuda")


def test_reference_ops_mode_runs_the_reference(one_thread):
    """reference_ops() routes torch.ops.dsa.* to the table's reference (here on the CPU, where that
    is also the registered kernel: the results must be identical)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 576, generator=g)
    pool = torch.randn(2, 64, 576, generator=g)
    slots = torch.randint(0, 128, (3, 16), generator=g, dtype=torch.int32)
    want = ref.sparse_mla(q, pool, slots, 1.0, 0.1)
    with cuda_ops.reference_ops():
        got = torch.ops.dsa.sparse_mla(q, pool, slots, 1.0, 0.1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------- GPU: the binding itself
def _mla_case(tokens, heads, topk, pages, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, heads, 576, generator=g, device="cuda").to(torch.bfloat16)
    pool = torch.randint(0, 120, (pages, 64, 576), generator=g, device="cuda", dtype=torch.uint8)
    slots = torch.randint(0, pages * 64, (tokens, topk), generator=g, device="cuda", dtype=torch.int32)
    slots[:, -3:] = -1
    return q, pool, slots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)")
@pytest.mark.parametrize("heads,padded", [(4, 16), (20, 32), (100, 128)])
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_sparse_mla_pads_heads_in_the_launcher(heads, padded, fmt, tokens):
    """Any head count <= 128 runs: heads are independent, so the real heads of a padded run equal
    the same heads of a run at the instantiated count (bitwise: same kernel, same split plan)."""
    assert cuda_ops.load("cuda")
    q_full, pool, slots = _mla_case(tokens, padded, 300, 16, seed=heads)
    if fmt == "bf16":
        pool = torch.randn(16, 64, 576, device="cuda").to(torch.bfloat16)
    q = q_full[:, :heads].contiguous()
    out, lse = torch.ops.dsa.sparse_mla(q, pool, slots, 0.02, 0.1352)
    full_out, full_lse = torch.ops.dsa.sparse_mla(q_full, pool, slots, 0.02, 0.1352)
    assert out.shape == (tokens, heads, 512) and lse.shape == (tokens, heads)
    assert torch.equal(out, full_out[:, :heads]) and torch.equal(lse, full_lse[:, :heads])
    # a strided q (heads not adjacent) takes the per-head copies
    strided = q_full[:, :heads]
    s_out, s_lse = torch.ops.dsa.sparse_mla(strided, pool, slots, 0.02, 0.1352)
    assert torch.equal(s_out, out) and torch.equal(s_lse, lse)
    assert cuda_ops.library().sparse_mla_workspace_size(tokens, heads, 300, 0 if fmt == "fp8" else 1) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)")
def test_every_op_is_served_from_cpp():
    assert cuda_ops.load("cuda")
    for name in ops.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dsa::{name}", "CUDA"), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)")
def test_unsupported_combinations_raise():
    assert cuda_ops.load("cuda")
    q, pool, slots = _mla_case(2, 16, 64, 4)
    with pytest.raises(NotImplementedError, match=r"pool dtype torch.float32 has no CUDA kernel.*DSA_KERNELS=reference"):
        torch.ops.dsa.sparse_mla(q, pool.float(), slots, 1.0, 0.1)
    with pytest.raises(NotImplementedError, match=r"q dtype torch.float32"):
        torch.ops.dsa.sparse_mla(q.float(), pool, slots, 1.0, 0.1)
    with pytest.raises(ValueError, match=r"slots dtype torch.int64 not in \(torch.int32,\)"):
        torch.ops.dsa.sparse_mla(q, pool, slots.long(), 1.0, 0.1)
    # the precision reference of such a combination is explicit
    with cuda_ops.reference_ops():
        out, _ = torch.ops.dsa.sparse_mla(q.float(), pool.float(), slots, 1.0, 0.1)
    assert out.is_cuda and out.dtype == torch.float32


SUBPROCESS = r"""
import torch
from dsa_trt.plugins import cuda_ops
try:
    cuda_ops.load()
    print("LOADED")
except RuntimeError as e:
    print("ERROR", e)
q = torch.randn(2, 4, 576, device="cuda")
pool = torch.randn(2, 64, 576, device="cuda")
slots = torch.zeros(2, 8, dtype=torch.int32, device="cuda")
print("REF", tuple(torch.ops.dsa.sparse_mla(q, pool, slots, 1.0, 0.1)[0].shape))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)")
def test_gpu_without_library_errors_and_reference_still_works(tmp_path):
    env = dict(os.environ, DSA_TORCH_OPS_LIB=str(tmp_path / "absent.so"))
    env.pop("DSA_KERNELS", None)
    run = subprocess.run([sys.executable, "-c", SUBPROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert "ERROR" in run.stdout and "make kernels torch-ops" in run.stdout, run.stdout + run.stderr
    env["DSA_KERNELS"] = "reference"
    run = subprocess.run([sys.executable, "-c", SUBPROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "REF (2, 4, 512)" in run.stdout, run.stdout + run.stderr


def test_dsat_round_trip(tmp_path):
    """The raw tensor format of runtime/cpp/dsa_step.cpp, as benchmarks/step_runner_check.py writes and reads it
    (header layout: magic, count, then dtype code, ndim, dims, nbytes, bytes per tensor)."""
    import importlib.util
    import struct
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_runner_check.py"
    spec = importlib.util.spec_from_file_location("step_runner_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 1000, (5,), generator=g), torch.randn(2, 3, generator=g).to(torch.bfloat16),
               torch.randint(0, 255, (2, 64, 8), generator=g, dtype=torch.uint8), torch.tensor(3, dtype=torch.int32),
               torch.randn(4, generator=g).to(torch.float8_e4m3fn), torch.empty(0, 576)]
    f = tmp_path / "x.dsat"
    mod.write_dsat(f, tensors)
    back = mod.read_dsat(f)
    assert len(back) == len(tensors)
    for a, b in zip(tensors, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else a,
                                                                          b.view(torch.uint8) if b.dim() else b)
    raw = f.read_bytes()
    assert raw[:8] == b"DSATENS1" and struct.unpack_from("<qqqq", raw, 8) == (6, 4, 1, 5)  # int64 = c10 Long = 4
