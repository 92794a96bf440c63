"""torch.ops.dsa.fp8_block_linear / moe_experts on CUDA tensors (served by the CUDA kernels of
plugins/csrc/fp8_*.cu, moe_*.cu once bound; by the reference until then) against the production
reference (plugins/fp8_reference.py) on CPU copies of the same inputs. Runs on the H200; skips
without CUDA. The reference itself is checked against the float64 recipe in tests/test_fp8_ops.py.

Tolerances (the kernel and the reference compute the same recipe; only the order of the fp32
sums differs):
- linear: each bf16 output within one bf16 ulp of the reference plus an fp32 accumulation bound
  (2^-22 of sum |x||w|, for outputs that cancel to near zero), and at most 1% of outputs differ
  at all (a different summation order crosses a bf16 rounding boundary rarely, ~1e-4 per output).
- MoE: a one-ulp flip of a bf16 intermediate can move its 1x128 group's amax, which requantises
  that group (an e4m3 step, 2^-4, on up to 128 values of one pair); such events are rare, so
  rel L2 over the output <= 5e-3 and per token <= 3e-2. Routing/offset bugs give errors >= 0.1.
"""

from __future__ import annotations

import math

import pytest
import torch

import dsa_trt.plugins.fp8_ops  # noqa: F401  (registers the ops)
from dsa_trt.plugins import fp8_reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)"),
]

DEV = "cuda"
LINEAR_MAX_DIFFERING = 0.01
MOE_REL_L2 = 5e-3
MOE_TOKEN_REL_L2 = 3e-2

# V3.2 (N, K): q_a, q_b, kv_a, kv_b, o_proj, indexer wq_b, dense gate+up, dense down
REAL_LINEAR_SHAPES = [(1536, 7168), (24576, 1536), (576, 7168), (32768, 512), (7168, 16384), (8192, 1536),
                      (36864, 7168), (7168, 18432)]


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


def assert_linear_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                        case: str) -> None:
    got, want = got.float().cpu(), want.float()
    a = want.abs().clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(a)) - 7)
    w_abs = (w.float() * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]).abs()
    bound = ulp + 2.0**-22 * (x.float().abs() @ w_abs.T)
    diff = (got - want).abs()
    bad = diff > bound
    if bad.any():
        t, n = (int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"{case}: {int(bad.sum())} outputs off, e.g. [{t}, {n}] got {got[t, n].item()} "
                             f"want {want[t, n].item()} (bound {bound[t, n].item():.3g})")
    differing = (diff > 0).float().mean().item()
    assert differing <= LINEAR_MAX_DIFFERING, f"{case}: {differing:.2%} of outputs differ"


LINEAR_CASES = [(t, n, k, p) for t in (1, 3, 64, 129) for (n, k) in ((576, 200), (300, 384), (64, 1000))
                for p in (True, False)] + [(4096, 192, 200, True), (4096, 576, 7168, False)]


@pytest.mark.parametrize("tokens,n,k,pow2", LINEAR_CASES)
def test_fp8_block_linear_designed(tokens, n, k, pow2):
    g = gen(tokens * 131 + n + k)
    x = random_x(tokens, k, g)
    w, s = random_fp8_weight(n, k, g, pow2)
    got = torch.ops.dsa.fp8_block_linear(x, w, s, pow2)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n) and got.device.type == DEV
    xc, wc, sc = x.cpu(), w.cpu(), s.cpu()
    assert_linear_close(got, ref.fp8_block_linear(xc, wc, sc, pow2), xc, wc, sc, f"T={tokens} N={n} K={k} pow2={pow2}")
    assert torch.equal(got, torch.ops.dsa.fp8_block_linear(x, w, s, pow2)), "not deterministic"


@pytest.mark.parametrize("n,k", REAL_LINEAR_SHAPES)
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_fp8_block_linear_real_shapes(tokens, n, k):
    g = gen(n + k + tokens)
    x = random_x(tokens, k, g)
    w, s = random_fp8_weight(n, k, g, True)
    got = torch.ops.dsa.fp8_block_linear(x, w, s, True)
    xc, wc, sc = x.cpu(), w.cpu(), s.cpu()
    assert_linear_close(got, ref.fp8_block_linear(xc, wc, sc, True), xc, wc, sc, f"T={tokens} N={n} K={k}")


def test_fp8_block_linear_strided_x_and_zero_tokens():
    g = gen(9)
    wide = random_x(17, 1024, g)
    w, s = random_fp8_weight(512, 700, g, True)
    x = wide[:, 100:800]
    got = torch.ops.dsa.fp8_block_linear(x, w, s, True)
    assert torch.equal(got, torch.ops.dsa.fp8_block_linear(x.contiguous(), w, s, True))
    assert torch.ops.dsa.fp8_block_linear(x[:0], w, s, True).shape == (0, 512)


def distinct_ids(tokens: int, num_experts: int, top_k: int, g: torch.Generator, always: int | None = None):
    ids = torch.rand(tokens, num_experts, generator=g, device=DEV).argsort(dim=1)[:, :top_k]
    if always is not None:
        has = (ids == always).any(dim=1)
        ids[~has, 0] = always
    weights = torch.rand(tokens, top_k, generator=g, device=DEV)
    return ids.to(torch.int32).contiguous(), weights


def assert_moe_close(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    got = got.cpu().double()
    want = want.double()
    total = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    per_token = ((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30))
    live = want.norm(dim=1) > 0
    assert torch.all(got[~live] == 0), f"{case}: tokens without a local expert must be zero"
    worst = per_token[live].max().item() if live.any() else 0.0
    assert total <= MOE_REL_L2 and worst <= MOE_TOKEN_REL_L2, f"{case}: rel L2 {total:.2e}, worst token {worst:.2e}"


MOE_CASES = [  # (label, T, num_experts, E_local, offset, top_k, D, I, pow2, always)
    ("all local", 3, 8, 8, 0, 2, 256, 128, True, None),
    ("subset at offset", 1, 16, 5, 6, 4, 512, 256, True, None),
    ("subset at offset fp32 scales", 64, 16, 5, 6, 4, 512, 256, False, None),
    ("last rank", 129, 32, 8, 24, 8, 384, 256, True, None),
    ("every token on one expert", 129, 16, 6, 4, 2, 256, 128, False, 7),
    ("no tokens", 0, 8, 4, 0, 2, 256, 128, True, None),
]


@pytest.mark.parametrize("label,tokens,num_experts,num_local,offset,top_k,hidden,inter,pow2,always", MOE_CASES,
                         ids=[c[0] for c in MOE_CASES])
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_moe_experts_designed(fmt, label, tokens, num_experts, num_local, offset, top_k, hidden, inter, pow2,
                              always):
    g = gen(tokens * 7 + num_local + offset)
    x = random_x(tokens, hidden, g)
    ids, weights = distinct_ids(tokens, num_experts, top_k, g, always)
    w13, s13 = random_fp8_weight(2 * inter, hidden, g, pow2, (num_local,))
    w2, s2 = random_fp8_weight(hidden, inter, g, pow2, (num_local,))
    if fmt == "bf16":
        w13 = (w13.float() * 2**-8).bfloat16()
        w2 = (w2.float() * 2**-8).bfloat16()
        s13 = s2 = None
    got = torch.ops.dsa.moe_experts(x, ids, weights, w13, s13, w2, s2, num_experts, offset, pow2)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    cpu = [t.cpu() if t is not None else None for t in (x, ids, weights, w13, s13, w2, s2)]
    want = ref.moe_experts(*cpu, num_experts, offset, pow2)
    assert_moe_close(got, want, f"{fmt} {label}")
    assert torch.equal(got, torch.ops.dsa.moe_experts(x, ids, weights, w13, s13, w2, s2, num_experts, offset, pow2))


@pytest.mark.parametrize("tokens", [1, 32, 512])
def test_moe_experts_real_dims(tokens):
    """256 experts, top-8, D 7168, I 2048, uniform random routing, all experts on one rank."""
    num_experts, top_k, hidden, inter = 256, 8, 7168, 2048
    g = gen(tokens)
    x = random_x(tokens, hidden, g)
    ids, weights = distinct_ids(tokens, num_experts, top_k, g)
    w13, s13 = random_fp8_weight(2 * inter, hidden, g, True, (num_experts,))
    w2, s2 = random_fp8_weight(hidden, inter, g, True, (num_experts,))
    got = torch.ops.dsa.moe_experts(x, ids, weights, w13, s13, w2, s2, num_experts, 0, True)
    cpu = [t.cpu() for t in (x, ids, weights, w13, s13, w2, s2)]
    assert_moe_close(got, ref.moe_experts(*cpu, num_experts, 0, True), f"real dims T={tokens}")
