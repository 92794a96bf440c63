"""torch.ops.dsa.fp8_block_linear on CUDA tensors, served by the CUDA kernels of the
C++ binding (build/libdsa_torch_ops.so over plugins/csrc/fp8_*.cu, moe_*.cu; the module fixture
loads it and fails when it is missing, so the reference never stands in for the kernels here),
against the production reference (plugins/fp8_reference.py) on CPU copies of the same inputs, or
on the GPU with TF32 off for the real V3.2 shapes at T >= 129 (the same fp32 recipe; the CPU would
take minutes). Runs on the H200; skips without CUDA. The reference itself is checked against the
float64 recipe in tests/test_fp8_ops.py.

Every GEMM of the linear is forced in turn (DSA_FP8_LINEAR_PATH = tma, tma-nomc, tma-pipe,
tma-store, tma-swap, legacy; the kernel library reads it at each launch) on designed shapes: partial N and K blocks
(K a multiple of 16, as the kernels require), T in {1, 3, 64, 129, 300, 4096}, K splits; the
automatic choice runs every real V3.2 shape (which plan each T gets: tests/test_fp8_linear_plan.py, on any machine).

Tolerance: each bf16 output within one bf16 ulp of the reference plus 2^-12 of sum |x||w| (the
scaled absolute products). The reference sums in fp32; Hopper's e4m3 wgmma keeps fewer bits in its
running sum (DeepSeek-V3 report §3.5.2: about 14), and every path of the kernel shares that
accumulator, so outputs that cancel miss an fp32-only bound (seen on the H200: up to ~2^-15 of
sum |x||w|, identical across the four paths). A wrong scale block, K tile or row gives errors of
the order of the output itself (>= ~1e-2 of sum |x||w| at these K), far outside. The MoE op's
kernel tests are tests/test_kernels_moe_cuda.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsa_trt.plugins.fp8_ops  # noqa: F401  (registers the ops)
from dsa_trt.plugins import cuda_ops
from dsa_trt.plugins import fp8_reference as ref
from dsa_trt.plugins.kernel_abi import KernelLibrary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)"),
]

DEV = "cuda"
PATH_KNOB = "DSA_FP8_LINEAR_PATH"
LINEAR_PATHS = ["tma", "tma-nomc", "tma-pipe", "tma-store", "tma-swap", "legacy"]
TC_ACCUMULATION = 2.0**-12  # of sum |x||w|: the fp8 tensor core's running sum (see above)

# V3.2 (N, K): q_a, q_b, kv_a, kv_b, o_proj, indexer wq_b, dense gate+up, dense down
REAL_LINEAR_SHAPES = [(1536, 7168), (24576, 1536), (576, 7168), (32768, 512), (7168, 16384), (8192, 1536),
                      (36864, 7168), (7168, 18432)]


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels():
    assert cuda_ops.load("cuda"), "the CUDA kernels must serve torch.ops.dsa here (make kernels torch-ops)"


def kernel_library() -> KernelLibrary:
    """The kernel library itself, for the plan a launch runs (the op does not report it)."""
    return KernelLibrary()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def random_x(tokens: int, k: int, g: torch.Generator) -> torch.Tensor:
    scale = torch.exp2(torch.randint(-6, 4, (tokens, 1), generator=g, device=DEV).float())
    return (torch.randn(tokens, k, generator=g, device=DEV) * scale).bfloat16()


def random_fp8_weight(rows: int, cols: int, g: torch.Generator, pow2: bool, lead: tuple[int, ...] = ()):
    """e4m3 values of a unit normal (clamped, no NaN) with random per-block scales."""
    w = (torch.randn(*lead, rows, cols, generator=g, device=DEV) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (*lead, math.ceil(rows / 128), math.ceil(cols / 128))
    if pow2:
        s = torch.exp2(torch.randint(-16, -10, shape, generator=g, device=DEV).float())
    else:
        s = torch.rand(shape, generator=g, device=DEV) * 2**-10 + 2**-14
    return w, s


def reference_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, pow2: bool, on_gpu: bool) -> torch.Tensor:
    """The reference on CPU copies, or on the GPU in plain fp32 (TF32 off: the recipe's fp32 sums)."""
    if not on_gpu:
        return ref.fp8_block_linear(x.cpu(), w.cpu(), s.cpu(), pow2)
    keep = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return ref.fp8_block_linear(x, w, s, pow2)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = keep


def assert_linear_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                        case: str) -> None:
    """On want's device; x, w, s are moved there."""
    dev = want.device
    got, want, x, w, s = got.float().to(dev), want.float(), x.to(dev), w.to(dev), s.to(dev)
    a = want.abs().clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(a)) - 7)
    w_abs = (w.float() * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]).abs()
    keep = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        bound = ulp + TC_ACCUMULATION * (x.float().abs() @ w_abs.T)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = keep
    diff = (got - want).abs()
    assert not torch.isnan(got).any(), f"{case}: NaN in the output"
    bad = diff > bound
    if bad.any():
        t, n = (int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"{case}: {int(bad.sum())} outputs off, e.g. [{t}, {n}] got {got[t, n].item()} "
                             f"want {want[t, n].item()} (bound {bound[t, n].item():.3g})")


def check_linear(tokens: int, n: int, k: int, pow2: bool, seed: int, case: str, gpu_reference: bool = False) -> None:
    g = gen(seed)
    x = random_x(tokens, k, g)
    w, s = random_fp8_weight(n, k, g, pow2)
    got = torch.ops.dsa.fp8_block_linear(x, w, s, pow2)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n) and got.device.type == DEV
    assert_linear_close(got, reference_linear(x, w, s, pow2, gpu_reference), x, w, s, case)
    assert torch.equal(got, torch.ops.dsa.fp8_block_linear(x, w, s, pow2)), f"{case}: not deterministic"


# (N, K) with partial N and K blocks (K % 16 == 0); (64, 1008): one weight tile, so K is split;
# (200, 256): a partial second 64-column half of the last weight tile (tma-store clips it)
DESIGNED_SHAPES = [(576, 208), (300, 384), (64, 1008), (200, 256)]
LINEAR_CASES = [(t, n, k, p) for t in (1, 3, 64, 129) for (n, k) in DESIGNED_SHAPES for p in (True, False)] + [
    (4096, 192, 208, True), (4096, 576, 7168, False), (4096, 300, 1008, True)]


@pytest.mark.parametrize("tokens,n,k,pow2", LINEAR_CASES)
def test_fp8_block_linear_designed(tokens, n, k, pow2):
    check_linear(tokens, n, k, pow2, tokens * 131 + n + k, f"auto T={tokens} N={n} K={k} pow2={pow2}")


@pytest.mark.parametrize("path", LINEAR_PATHS)
@pytest.mark.parametrize("tokens", [1, 3, 64, 129, 300, 4096])  # 300: an odd count of 128-token tiles
@pytest.mark.parametrize("n,k", DESIGNED_SHAPES)
def test_fp8_block_linear_forced_path(monkeypatch, path, tokens, n, k):
    monkeypatch.setenv(PATH_KNOB, path)
    assert kernel_library().linear_path(tokens, n, k).startswith(path + " ")
    pow2 = (tokens + n) % 2 == 0
    check_linear(tokens, n, k, pow2, tokens * 7 + n + 3 * k, f"{path} T={tokens} N={n} K={k} pow2={pow2}")


@pytest.mark.parametrize("n,k", REAL_LINEAR_SHAPES)
@pytest.mark.parametrize("tokens", [1, 16, 64, 129, 512, 4096])
def test_fp8_block_linear_real_shapes(tokens, n, k):
    path = kernel_library().linear_path(tokens, n, k)
    check_linear(tokens, n, k, True, n + k + tokens, f"T={tokens} N={n} K={k} ({path})", gpu_reference=tokens >= 129)


@pytest.mark.parametrize("path", LINEAR_PATHS)
def test_fp8_block_linear_real_shapes_forced(monkeypatch, path):
    """Each GEMM on the shapes its plan splits (kv_a: 5 weight tiles) or not (q_b), small and large T."""
    monkeypatch.setenv(PATH_KNOB, path)
    for tokens, (n, k) in ((1, (576, 7168)), (64, (24576, 1536)), (129, (576, 7168)), (512, (32768, 512))):
        check_linear(tokens, n, k, False, tokens + n, f"{path} T={tokens} N={n} K={k}")


def test_fp8_block_linear_bad_path_knob(monkeypatch):
    g = gen(5)
    x = random_x(4, 256, g)
    w, s = random_fp8_weight(128, 256, g, True)
    monkeypatch.setenv(PATH_KNOB, "fastest")
    with pytest.raises(ValueError, match="DSA_FP8_LINEAR_PATH=fastest"):
        torch.ops.dsa.fp8_block_linear(x, w, s, True)


@pytest.mark.parametrize("tokens", [5, 300])
@pytest.mark.parametrize("path", LINEAR_PATHS)
def test_fp8_block_linear_cuda_graph(monkeypatch, path, tokens):
    """Captured once and replayed on new inputs in place (the TMA descriptors are kernel
    parameters, built at capture time from the same buffers): equal to eager calls."""
    monkeypatch.setenv(PATH_KNOB, path)
    g = gen(17)
    x = random_x(tokens, 7168, g)
    w, s = random_fp8_weight(576, 7168, g, True)
    torch.ops.dsa.fp8_block_linear(x, w, s, True)  # warm-up: kernel attributes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsa.fp8_block_linear(x, w, s, True)
    for seed in (1, 2):
        x.copy_(random_x(tokens, 7168, gen(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.ops.dsa.fp8_block_linear(x, w, s, True)), f"{path}: replay {seed} differs"


def test_fp8_block_linear_strided_x_and_zero_tokens():
    g = gen(9)
    wide = random_x(17, 1024, g)
    w, s = random_fp8_weight(512, 704, g, True)
    x = wide[:, 100:804]
    got = torch.ops.dsa.fp8_block_linear(x, w, s, True)
    assert torch.equal(got, torch.ops.dsa.fp8_block_linear(x.contiguous(), w, s, True))
    assert torch.ops.dsa.fp8_block_linear(x[:0], w, s, True).shape == (0, 512)


@pytest.mark.parametrize("tokens,n,k", [(129, 576, 7168), (300, 300, 1008), (200, 200, 256), (4096, 1536, 7168)])
def test_prefill_paths_agree_bitwise(monkeypatch, tokens, n, k):
    """The prefill tiles sum each output in the same K order with the same fp32 promotion (the
    pipelined mainloop only reorders when the scales are read and the wgmmas are waited for): with
    one K split, every prefill path's bits are those of `tma`."""
    g = gen(tokens + n)
    x = random_x(tokens, k, g)
    w, s = random_fp8_weight(n, k, g, True)
    monkeypatch.setenv("DSA_FP8_LINEAR_SPLITS", "1")
    outs = {}
    for path in ("tma", "tma-nomc", "tma-pipe", "tma-store"):
        monkeypatch.setenv(PATH_KNOB, path)
        outs[path] = torch.ops.dsa.fp8_block_linear(x, w, s, True)
    for path, out in outs.items():
        diff = (out.float() - outs["tma"].float()).abs()
        assert torch.equal(out.view(torch.int16), outs["tma"].view(torch.int16)), (
            f"T={tokens} N={n} K={k}: {path} differs from tma in {int((diff > 0).sum())} outputs")
