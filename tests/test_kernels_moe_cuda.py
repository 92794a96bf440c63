"""CUDA kernels of the fp8 block linear and the routed MoE experts (plugins/csrc/fp8_linear.cu,
moe_experts.cu, through the C API of plugins/csrc/dsa_moe_kernels.h via plugins/kernel_abi.py)
against a plain-torch emulation written here (independent of production code). Runs on the H200;
skips without CUDA.

Numerics, two tiers (STYLE.md):
* tight: the emulation quantises the activations exactly as the official act_quant does (same
  fp32 ops: amax, max(amax, 1e-4) * fp32(1/448), ue8m0 rounding, x / s, e4m3), so both sides multiply the
  same e4m3 values; the emulation then sums the dequantised products in fp64. What remains is the
  kernel's accumulation (the fp8 tensor cores keep ~14 mantissa bits inside a 128-wide K block,
  then fp32) and the bf16 rounding of the output. Per element:
      |got - want| <= 2^-8 |want| + 2^-11 * sum_k |x_k w_k|       (linear)
  plus a relative-RMS bound over the whole output (catches small systematic errors).
* loose: against the unquantised bf16 x @ dequant(W)^T, relative RMS < 6% (e4m3 rounding of x).
The MoE has no per-element bound against the fp64 emulation: the fp8 MMA keeps ~13 bits of its
running sum, and the bf16 / e4m3 re-roundings of gate, up and h turn those differences into
e4m3 steps of h that move all D outputs of a pair (tests/helpers/moe_tiers.py explains; the CPU
test tests/test_moe_kernel_emulation.py reproduces the H200's rates with an emulation of this
kernel). Its tiers: exact against the kernel itself on pair-expanded input (top_k = 1, every pair a
token), and statistical against the fp64 emulation (relative L2 over the output and per token).
The bf16-weight MoE (CUDA-core fp32) keeps the per-element bound relative to sum_j |w_j y_j|.

A failing linear case prints its parameters, the count of bad elements, the worst one and its
bound; every MoE case prints one line (pytest -s) with both tiers and its worst element.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dsa_trt.plugins.kernel_abi import (ERR_INVALID_ARG, ERR_UNSUPPORTED, MOE_BF16, MOE_FP8_BLOCK,
                                        Fp8BlockLinearParams, KernelLibrary, MoeExpertsParams, library_path)
from tests.helpers.moe_tiers import (MOE_REL_L2, MOE_TOKEN_REL_L2, describe_pairwise, expand_pairs,
                                  recombine, statistical)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)"),
]

DEV = "cuda"
BLOCK = 128
E4M3_MAX = 448.0
E4M3_MAX_INV = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).item()
AMAX_FLOOR = 1e-4
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lib() -> KernelLibrary:
    path = library_path()
    assert path.exists(), f"{path} missing: build the kernel library first (make kernels)"
    return KernelLibrary(path)


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


# ---------------------------------------------------------------- launch helpers
def run_linear(lib: KernelLibrary, x, w8, ws, pow2: bool, out_pad: int = 0, status_only: bool = False):
    """x [T, K] bf16 (any row stride), w8 [N, K] e4m3, ws fp32 -> out [T, N] bf16 (a view of a
    [T, N + out_pad] buffer, so out_stride > N when out_pad > 0)."""
    t, k = x.shape
    n = w8.shape[0]
    out_buf = torch.full((t, n + out_pad), float("nan"), device=DEV, dtype=torch.bfloat16)
    wsz = lib.dll.dsa_fp8_block_linear_workspace_size(t, n, k)
    work = torch.empty(max(wsz, 16), device=DEV, dtype=torch.uint8)
    p = Fp8BlockLinearParams(ptr(x), ptr(w8), ptr(ws), ptr(out_buf), t, n, k, x.stride(0), out_buf.stride(0),
                             int(pow2), ptr(work))
    status = lib.dll.dsa_launch_fp8_block_linear(ctypes.byref(p), lib.stream())
    if status_only:
        return status
    assert status == 0, lib.error()
    torch.cuda.synchronize()
    return out_buf[:, :n]


@dataclass
class Moe:
    x: torch.Tensor        # [T, D] bf16
    ids: torch.Tensor      # [T, k] int32, global ids (other ranks' and invalid ones included)
    weights: torch.Tensor  # [T, k] fp32
    w13: torch.Tensor      # [E, 2I, D] e4m3 or bf16
    s13: torch.Tensor | None
    w2: torch.Tensor       # [E, D, I]
    s2: torch.Tensor | None
    num_experts: int
    offset: int
    pow2: bool

    @property
    def fmt(self) -> int:
        return MOE_BF16 if self.w13.dtype == torch.bfloat16 else MOE_FP8_BLOCK


def run_moe(lib: KernelLibrary, m: Moe, status_only: bool = False, **override):
    t, k = m.ids.shape
    e, two_i, d = m.w13.shape
    i = two_i // 2
    out = torch.full((t, d), float("nan"), device=DEV, dtype=torch.float32)
    wsz = lib.dll.dsa_moe_experts_workspace_size(t, k, e, d, i, m.fmt)
    work = torch.empty(max(wsz, 16), device=DEV, dtype=torch.uint8)
    fields = dict(x=ptr(m.x), topk_ids=ptr(m.ids), topk_weights=ptr(m.weights), w13=ptr(m.w13), w13_scale=ptr(m.s13),
                  w2=ptr(m.w2), w2_scale=ptr(m.s2), out=ptr(out), num_tokens=t, top_k=k, num_experts=m.num_experts,
                  num_local_experts=e, expert_offset=m.offset, hidden=d, inter=i, weight_format=m.fmt,
                  pow2_act_scales=int(m.pow2), workspace=ptr(work))
    fields.update(override)
    p = MoeExpertsParams(**fields)
    status = lib.dll.dsa_launch_moe_experts(ctypes.byref(p), lib.stream())
    if status_only:
        return status
    assert status == 0, lib.error()
    torch.cuda.synchronize()
    return out


# ---------------------------------------------------------------- the emulation (plain torch)
def act_quant_emul(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The official act_quant, fp32 ops as the reference runs them: -> (dequantised fp64 [T, K],
    scales fp32 [T, nkb])."""
    t, k = x.shape
    nkb = -(-k // BLOCK)
    xp = torch.zeros(t, nkb * BLOCK, device=x.device, dtype=torch.float32)
    xp[:, :k] = x.float()
    g = xp.view(t, nkb, BLOCK)
    s = g.abs().amax(-1).clamp(min=AMAX_FLOOR) * E4M3_MAX_INV  # the official fp32 reciprocal multiply
    if pow2:  # 2^ceil(log2 s) on the bits: add the mantissa mask, drop the mantissa
        bits = s.view(torch.int32).to(torch.int64)
        s = ((bits + 0x7FFFFF) & 0xFF800000).to(torch.int32).view(torch.float32)
    q = (g / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    deq = (q.double() * s.double()[..., None]).view(t, nkb * BLOCK)[:, :k]
    return deq, s


def dequant_weight(w8: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    n, k = w8.shape
    full = ws.double().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return w8.double() * full


def random_fp8_weight(shape: tuple[int, ...], g: torch.Generator, pow2: bool, fan_in: int):
    """e4m3 values of N(0, 1.5^2) and per-128x128-block scales around 1/sqrt(fan_in) (ue8m0
    checkpoints store powers of two)."""
    *lead, n, k = shape
    w8 = (torch.randn(*shape, generator=g, device=DEV) * 1.5).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    sshape = (*lead, -(-n // BLOCK), -(-k // BLOCK))
    base = 1.0 / (1.5 * math.sqrt(fan_in))
    if pow2:
        exps = torch.randint(-1, 2, sshape, generator=g, device=DEV).float()
        ws = torch.exp2(torch.round(torch.log2(torch.tensor(base))) + exps)
    else:
        ws = base * (0.5 + torch.rand(sshape, generator=g, device=DEV))
    return w8.contiguous(), ws.float().contiguous()


def describe_bad(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, case: str) -> str:
    err = (got.double() - want).abs()
    bad = err > bound
    idx = int((err - bound).flatten().argmax())
    where = tuple(int(v) for v in torch.unravel_index(torch.tensor(idx), got.shape))
    return (f"{case}: {int(bad.sum())} of {bad.numel()} outside the bound; worst at {where}: got "
            f"{got[where].item():.6g} want {want[where].item():.6g} err {err[where].item():.3g} "
            f"bound {bound[where].item():.3g}")


def check_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, rms_rel: float, case: str) -> None:
    assert torch.isfinite(got).all(), f"{case}: non-finite outputs at {(~torch.isfinite(got)).nonzero()[:4].tolist()}"
    err = (got.double() - want).abs()
    assert (err <= bound).all(), describe_bad(got, want, bound, case)
    rel = (err.square().mean().sqrt() / want.square().mean().sqrt().clamp(min=1e-30)).item()
    assert rel <= rms_rel, f"{case}: relative RMS error {rel:.3g} > {rms_rel:.3g}"


# ---------------------------------------------------------------- linear: designed cases
def linear_case(lib, t, n, k, pow2, seed, x_pad=0, out_pad=0, special=False):
    g = gen(seed)
    case = f"linear T={t} N={n} K={k} pow2={pow2} x_pad={x_pad} out_pad={out_pad} seed={seed}"
    x = (torch.randn(t, k + x_pad, generator=g, device=DEV)).to(torch.bfloat16)[:, :k]
    if special and t >= 4:
        x[0] = 0  # amax floor: scale 1e-4 / 448, all-zero row
        x[1] *= 1e3
        x[2] *= 1e-6  # amax below the 1e-4 floor: the clamped scale
        x[3, :k // 2] = 0
    w8, ws = random_fp8_weight((n, k), g, pow2, k)
    got = run_linear(lib, x, w8, ws, pow2, out_pad)
    xd, _ = act_quant_emul(x, pow2)
    wd = dequant_weight(w8, ws)
    want = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    check_close(got, want, 2.0**-8 * want.abs() + 2.0**-11 * mag + 1e-30, 2.0**-8, case)
    loose = x.double() @ wd.T
    rel = ((got.double() - loose).square().mean().sqrt() / loose.square().mean().sqrt().clamp(min=1e-30)).item()
    assert rel < 0.06, f"{case}: loose tier: relative RMS {rel:.3g} vs the unquantised product"
    return got


# Token counts around every token-tile width (8, 16, 32, 64, 128) and shapes with partial N tiles
# (200, 576) and partial K blocks (400 = 3 * 128 + 16, 144); (576, 1024) at small T splits K.
LINEAR_T = [1, 7, 8, 9, 16, 17, 32, 33, 63, 64, 65, 129]
LINEAR_NK = [(128, 128), (200, 400), (576, 1024), (64, 144)]


@pytest.mark.parametrize("t", LINEAR_T)
@pytest.mark.parametrize("nk", LINEAR_NK, ids=lambda v: f"{v[0]}x{v[1]}")
def test_linear_tiles(lib, t, nk):
    linear_case(lib, t, nk[0], nk[1], pow2=(t + nk[0]) % 2 == 0, seed=t * 7 + nk[1], special=True)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("t,n,k,x_pad,out_pad", [
    (4096, 256, 384, 0, 0),     # many token tiles, grouped raster
    (1, 1536, 7168, 0, 0),      # q_a at decode: K split 14 ways
    (9, 576, 7168, 0, 0),       # kv_a: 5 scale rows, the last tile half empty
    (65, 24576, 1536, 0, 0),    # q_b
    (16, 7168, 2048, 0, 0),     # o_proj-like K, 56 weight tiles
    (130, 300, 256, 40, 24),    # strided x and out rows (out_stride not a multiple of 8)
    (3, 200, 400, 16, 8),       # strided, split K
])
def test_linear_shapes(lib, pow2, t, n, k, x_pad, out_pad):
    linear_case(lib, t, n, k, pow2, seed=n + k + t, x_pad=x_pad, out_pad=out_pad)


@pytest.mark.parametrize("t", [1, 9, 70, 300])
def test_linear_permutation_weight(lib, t):
    """W = a permutation matrix, unit scales, ue8m0 activations: out[t, n] = dequant(x)[t, perm[n]]
    exactly (an e4m3 value times a power of two is a bf16), so act_quant and the GEMM's operand
    layout (swizzle, fragment order, epilogue transpose) are checked bit for bit; a layout bug
    shows up as the wrong source column, which the message names."""
    n = k = 384
    g = gen(40 + t)
    x = torch.randn(t, k, generator=g, device=DEV).to(torch.bfloat16)
    perm = torch.randperm(k, generator=g, device=DEV)
    w8 = torch.zeros(n, k, device=DEV, dtype=torch.float32)
    w8[torch.arange(n, device=DEV), perm] = 1.0
    w8 = w8.to(torch.float8_e4m3fn)
    ws = torch.ones(n // BLOCK, k // BLOCK, device=DEV)
    got = run_linear(lib, x, w8, ws, True).double()
    want = act_quant_emul(x, True)[0][:, perm]
    bad = (got != want).nonzero()
    if bad.numel():
        r, c = (int(v) for v in bad[0])
        src = (act_quant_emul(x, True)[0][r] == got[r, c]).nonzero().flatten()[:4].tolist()
        raise AssertionError(f"T={t}: {bad.shape[0]} outputs differ; first [{r}, {c}]: got {got[r, c].item()} want "
                             f"{want[r, c].item()} (column perm[{c}]={int(perm[c])}; got matches columns {src})")


@pytest.mark.parametrize("t,n,k", [(1, 1536, 7168), (200, 576, 1024), (4096, 384, 256)])
def test_linear_deterministic(lib, t, n, k):
    g = gen(11)
    x = torch.randn(t, k, generator=g, device=DEV).to(torch.bfloat16)
    w8, ws = random_fp8_weight((n, k), g, True, k)
    a = run_linear(lib, x, w8, ws, True)
    b = run_linear(lib, x, w8, ws, True)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"T={t} N={n} K={k}: two runs differ"


def test_linear_zero_tokens(lib):
    x = torch.empty(0, 256, device=DEV, dtype=torch.bfloat16)
    w8, ws = random_fp8_weight((128, 256), gen(1), True, 256)
    assert run_linear(lib, x, w8, ws, True).shape == (0, 128)


def test_linear_bad_input(lib):
    g = gen(2)
    x = torch.randn(4, 100, generator=g, device=DEV).to(torch.bfloat16)
    w8 = torch.zeros(128, 100, device=DEV, dtype=torch.float8_e4m3fn)
    ws = torch.ones(1, 1, device=DEV)
    assert run_linear(lib, x, w8, ws, True, status_only=True) == ERR_UNSUPPORTED
    assert "k=100" in lib.error(), lib.error()
    p = Fp8BlockLinearParams(None, None, None, None, 4, 128, 128, 128, 128, 1, None)
    assert lib.dll.dsa_launch_fp8_block_linear(ctypes.byref(p), lib.stream()) == ERR_INVALID_ARG
    assert "NULL" in lib.error(), lib.error()
    p = Fp8BlockLinearParams(None, None, None, None, 4, 128, 128, 64, 128, 1, None)
    assert lib.dll.dsa_launch_fp8_block_linear(ctypes.byref(p), lib.stream()) == ERR_INVALID_ARG
    p = Fp8BlockLinearParams(None, None, None, None, -1, 128, 128, 128, 128, 1, None)
    assert lib.dll.dsa_launch_fp8_block_linear(ctypes.byref(p), lib.stream()) == ERR_INVALID_ARG
    assert "num_tokens=-1" in lib.error(), lib.error()


# ---------------------------------------------------------------- MoE: emulation and cases
def moe_emul(m: Moe) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out fp64 [T, D], scale fp64 [T, D]: sum_j |w_j| |y_j| for the per-element bound)."""
    t, k = m.ids.shape
    e_local, two_i, d = m.w13.shape
    i = two_i // 2
    fp8 = m.fmt == MOE_FP8_BLOCK
    xd = act_quant_emul(m.x, m.pow2)[0] if fp8 else m.x.double()
    out = torch.zeros(t, d, device=DEV, dtype=torch.float64)
    mag = torch.zeros_like(out)
    for e in range(e_local):
        toks, slots = (m.ids == m.offset + e).nonzero(as_tuple=True)
        if toks.numel() == 0:
            continue
        w13 = dequant_weight(m.w13[e], m.s13[e]) if fp8 else m.w13[e].double()
        w2 = dequant_weight(m.w2[e], m.s2[e]) if fp8 else m.w2[e].double()
        gu = (xd[toks] @ w13.T).to(torch.bfloat16)
        h = (F.silu(gu[:, :i].float()) * gu[:, i:].float()).to(torch.bfloat16)
        hd = act_quant_emul(h, m.pow2)[0] if fp8 else h.double()
        y = (hd @ w2.T).to(torch.bfloat16).double()
        wj = m.weights[toks, slots].double()[:, None]
        out.index_add_(0, toks, wj * y)
        mag.index_add_(0, toks, wj.abs() * y.abs())
    return out, mag


def moe_bound(want: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    """bf16 weights only (fp32 CUDA-core sums): per element 2% of sum_j |w_j y_j| (rare bf16
    neighbour roundings of gate, up and h between fp32 and fp64 sums; a wrong expert, slot or K
    block costs O(100%)), plus 2^-20 of the output's RMS for exact cancellations."""
    return 0.02 * mag + 2.0**-20 * want.square().mean().sqrt() + 1e-30


def make_moe(seed, t, k, num_experts, e_local, offset, d, i, pow2, fmt=MOE_FP8_BLOCK, routing="uniform") -> Moe:
    g = gen(seed)
    x = torch.randn(t, d, generator=g, device=DEV).to(torch.bfloat16)
    # k distinct ids per token over all experts (most of them other ranks' when e_local < num_experts)
    ids = torch.rand(t, num_experts, generator=g, device=DEV).argsort(dim=1)[:, :k].to(torch.int32)
    if routing == "hot":  # every token sends slot 0 to local expert 1 (so others lose pairs)
        hot = offset + 1
        ids = torch.where(ids == hot, ids[:, :1].expand_as(ids), ids)
        ids[:, 0] = hot
    elif routing == "local_only":  # every pair on a local expert, half of them empty
        ids = offset + (torch.rand(t, e_local, generator=g, device=DEV)[:, : e_local // 2].argsort(1)[:, :k] * 2)
        ids = ids.to(torch.int32)
    elif routing == "invalid":  # ids outside [0, num_experts) are skipped by the kernel
        ids[::3, -1] = -1
        ids[1::3, -1] = num_experts + 5
    weights = torch.rand(t, k, generator=g, device=DEV) * 2.5 / k
    if fmt == MOE_FP8_BLOCK:
        w13, s13 = random_fp8_weight((e_local, 2 * i, d), g, pow2, d)
        w2, s2 = random_fp8_weight((e_local, d, i), g, pow2, i)
    else:
        w13 = (torch.randn(e_local, 2 * i, d, generator=g, device=DEV) / math.sqrt(d)).to(torch.bfloat16)
        w2 = (torch.randn(e_local, d, i, generator=g, device=DEV) / math.sqrt(i)).to(torch.bfloat16)
        s13 = s2 = None
    return Moe(x, ids.contiguous(), weights.contiguous(), w13, s13, w2, s2, num_experts, offset, pow2)


def moe_pairwise(lib, m: Moe) -> torch.Tensor:
    """The kernel on every local pair as a token of its own (moe_tiers.expand_pairs), recombined in
    the kernel's combine order: what the T x top_k call must return bit for bit."""
    x1, ids1, w1, tok, slot = expand_pairs(m.x, m.ids, m.w13.shape[0], m.offset)
    m1 = Moe(x1, ids1, w1, m.w13, m.s13, m.w2, m.s2, m.num_experts, m.offset, m.pow2)
    y = run_moe(lib, m1)[: tok.numel()]  # fp32(1 * y): the pair's bf16 y
    return recombine(y, m.ids, m.weights, tok, slot, m.offset)


def moe_case(lib, m: Moe, case: str):
    got = run_moe(lib, m)
    assert torch.isfinite(got).all(), f"{case}: non-finite outputs at {(~torch.isfinite(got)).nonzero()[:4].tolist()}"
    # tokens with no local pair must be exactly 0
    none_local = ~((m.ids >= m.offset) & (m.ids < m.offset + m.w13.shape[0])).any(1)
    assert (got[none_local] == 0).all(), f"{case}: tokens without a local pair are not 0"
    oracle = moe_pairwise(lib, m)
    want, mag = moe_emul(m)
    total, worst, worst_tok = statistical(got, want)
    err = (got.double() - want).abs()
    at = tuple(int(v) for v in torch.unravel_index(err.argmax(), err.shape))
    summary = (f"{case}: pairwise {describe_pairwise(got, oracle)}; vs fp64 emulation: rel L2 {total:.3g} "
               f"(<= {MOE_REL_L2}), worst token {worst_tok} rel L2 {worst:.3g} (<= {MOE_TOKEN_REL_L2}), worst "
               f"element {at}: got {got[at].item():.6g} want {want[at].item():.6g}")
    print(summary)
    assert torch.equal(got, oracle), summary
    assert total <= MOE_REL_L2 and worst <= MOE_TOKEN_REL_L2, summary
    if m.fmt == MOE_BF16:
        check_close(got, want, moe_bound(want, mag), 2.0**-7, case)
    return got


@pytest.fixture(params=["legacy", "tma", "tma-pipe", "tma-fused", "tma-fused-nomc"])
def gemm_path(request, monkeypatch):
    """Both expert GEMMs at every size (DSA_MOE_GEMM_PATH; auto takes tma-fused, in CTA pairs, above
    64 pairs per expert, tma-pipe where I % 128 != 0): the pairwise oracle of a case runs under the
    same path."""
    monkeypatch.setenv("DSA_MOE_GEMM_PATH", request.param)
    return request.param


@pytest.mark.parametrize("t", [1, 3, 7, 8, 9, 63, 64, 65, 129, 4096])
def test_moe_tokens(lib, gemm_path, t):
    # all experts local; the token counts cross the tile widths (P / E_local picks BN); 4096: BN = 128
    m = make_moe(100 + t, t, 4, 16, 16, 0, 256, 128, pow2=t % 2 == 1)
    moe_case(lib, m, f"moe T={t} k=4 E=16/16 D=256 I=128 {lib.moe_path(t, 4, 16, 128)}")


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("t,k,num_experts,e_local,offset,d,i,routing", [
    (37, 6, 32, 8, 8, 320, 192, "uniform"),     # partial D and I blocks, other ranks' ids, offset 8
    (41, 6, 32, 8, 8, 320, 256, "uniform"),     # partial D block, whole I groups (tma-fused stays fused)
    (129, 4, 16, 8, 4, 256, 128, "hot"),        # every token on one expert, some experts empty
    (257, 1, 8, 8, 0, 256, 128, "hot"),         # k = 1, one expert with all 257 pairs
    (96, 3, 16, 8, 8, 256, 128, "local_only"),  # half the local experts get no pair
    (50, 5, 24, 12, 12, 384, 256, "invalid"),   # -1 and >= num_experts ids skipped
    (4096, 8, 64, 16, 16, 512, 256, "uniform"),  # prefill: BN = 128 tiles, many per expert
    (2100, 1, 8, 8, 0, 256, 128, "hot"),        # 2 prep chunks, every pair on one expert
    (3000, 2, 24, 12, 12, 256, 128, "invalid"),  # 3 prep chunks with skipped ids
])
def test_moe_routing(lib, gemm_path, pow2, t, k, num_experts, e_local, offset, d, i, routing):
    m = make_moe(t + k + d, t, k, num_experts, e_local, offset, d, i, pow2, routing=routing)
    moe_case(lib, m, f"moe T={t} k={k} E={e_local}/{num_experts}@{offset} D={d} I={i} {routing} pow2={pow2} "
             f"{lib.moe_path(t, k, e_local, i)}")


@pytest.mark.parametrize("t", [1, 32, 129])
def test_moe_real_dims(lib, gemm_path, t):
    # V3.2's expert shapes (D 7168, I 2048, 256 experts, top-8); 8 of them on this "rank"
    m = make_moe(7 + t, t, 8, 256, 8, 64, 7168, 2048, pow2=True)
    m.ids[:, 0] = 64 + torch.arange(t, device=DEV, dtype=torch.int32) % 8  # at least one local pair per token
    m.ids[:, 1:] = torch.where(m.ids[:, 1:] == m.ids[:, :1], (m.ids[:, 1:] + 100) % 256, m.ids[:, 1:])
    moe_case(lib, m, f"moe real dims T={t} {lib.moe_path(t, 8, 8)}")


@pytest.mark.parametrize("t,e_local,d,i", [(1, 16, 256, 128), (65, 16, 384, 256), (700, 32, 256, 128),
                                           (129, 8, 7168, 2048)])
def test_moe_paths_agree_bitwise(lib, monkeypatch, t, e_local, d, i):
    """Both GEMMs sum each row in the same order (K blocks in order, one fp32 promotion per block):
    a row's bits do not depend on which path the step's size picks."""
    m = make_moe(40 + t, t, 8, 64, e_local, 8, d, i, pow2=t % 2 == 0)
    monkeypatch.setenv("DSA_MOE_GEMM_PATH", "legacy")
    a = run_moe(lib, m)
    for path in ("tma", "tma-pipe", "tma-fused", "tma-fused-nomc"):
        monkeypatch.setenv("DSA_MOE_GEMM_PATH", path)
        b = run_moe(lib, m)
        diff = (a - b).abs()
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (
            f"T={t} E={e_local} D={d} I={i} {path}: {int((diff > 0).sum())} elements differ, "
            f"max {diff.max().item():.3g}")


@pytest.mark.parametrize("t", [1, 9, 65])
def test_moe_bf16(lib, t):
    m = make_moe(300 + t, t, 4, 16, 8, 8, 256, 160, pow2=False, fmt=MOE_BF16)
    moe_case(lib, m, f"moe bf16 T={t}")


@pytest.mark.parametrize("fmt", [MOE_FP8_BLOCK, MOE_BF16])
def test_moe_deterministic(lib, fmt):
    m = make_moe(5, 513, 8, 64, 32, 16, 256, 128, pow2=True, fmt=fmt)
    a, b = run_moe(lib, m), run_moe(lib, m)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"fmt={fmt}: two runs differ"


def test_moe_zero_tokens(lib):
    m = make_moe(6, 1, 2, 8, 8, 0, 128, 128, pow2=True)
    m.x, m.ids, m.weights = m.x[:0], m.ids[:0], m.weights[:0]
    assert run_moe(lib, m).shape == (0, 128)


def test_moe_bad_input(lib, monkeypatch):
    m = make_moe(8, 4, 2, 16, 8, 0, 256, 128, pow2=True)
    monkeypatch.setenv("DSA_MOE_GEMM_PATH", "fastest")
    assert run_moe(lib, m, status_only=True) == ERR_INVALID_ARG
    assert "DSA_MOE_GEMM_PATH=fastest" in lib.error(), lib.error()
    monkeypatch.delenv("DSA_MOE_GEMM_PATH")
    assert run_moe(lib, m, status_only=True, expert_offset=9) == ERR_INVALID_ARG
    assert "expert_offset=9" in lib.error(), lib.error()
    assert run_moe(lib, m, status_only=True, top_k=33) == ERR_INVALID_ARG
    assert "top_k=33" in lib.error(), lib.error()
    assert run_moe(lib, m, status_only=True, hidden=200) == ERR_UNSUPPORTED
    assert "hidden=200" in lib.error(), lib.error()
    assert run_moe(lib, m, status_only=True, w13_scale=None) == ERR_INVALID_ARG
    assert "w13_scale" in lib.error(), lib.error()
    assert run_moe(lib, m, status_only=True, weight_format=7) == ERR_INVALID_ARG
    assert "weight_format=7" in lib.error(), lib.error()


# ---------------------------------------------------------------- the compiled torch ops
@pytest.fixture(scope="module")
def torch_ops():
    path = ROOT / "build" / "libdsa_torch_ops.so"
    if not path.exists():
        pytest.skip(f"{path} not built (make torch-ops)")
    try:
        from dsa_trt.plugins import ops  # noqa: F401  (the schemas)
    except ImportError:
        pass
    torch.ops.load_library(str(path))
    if not hasattr(torch.ops.dsa, "fp8_block_linear") or not hasattr(torch.ops.dsa, "moe_experts"):
        pytest.skip("torch.ops.dsa.fp8_block_linear / moe_experts schemas are not defined")
    return torch.ops.dsa


def test_torch_op_linear_matches_launcher(lib, torch_ops):
    g = gen(21)
    x = torch.randn(33, 400, generator=g, device=DEV).to(torch.bfloat16)
    w8, ws = random_fp8_weight((200, 400), g, True, 400)
    got = torch_ops.fp8_block_linear(x, w8, ws, True)
    want = run_linear(lib, x, w8, ws, True)
    assert got.dtype == torch.bfloat16 and got.shape == (33, 200)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_torch_op_moe_matches_launcher(lib, torch_ops):
    m = make_moe(22, 40, 4, 32, 8, 8, 256, 128, pow2=False)
    got = torch_ops.moe_experts(m.x, m.ids, m.weights, m.w13, m.s13, m.w2, m.s2, m.num_experts, m.offset, False)
    want = run_moe(lib, m)
    assert got.dtype == torch.float32 and torch.equal(got, want)
