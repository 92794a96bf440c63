"""Independent float64 emulation of the official W8A8 recipe (spec/MODEL.md §6) for the fp8 tests.

Never imports production code. e4m3 rounding is done by hand (round half to even on 3 mantissa
bits, subnormals below 2^-6, saturation at 448), so it does not share torch's float8 cast with
the code under test; the products and the per-block sums are exact in float64.

- act_quant64: official act_quant (1x128 groups, amax clamped at 1e-4, s = amax * fp32(1/448) in
  fp32, ceil to a power of two for ue8m0), q = e4m3(fp32(x / s)).
- fp8_linear64: sum_kb s_x * s_w * sum_k q * w, rounded once to bf16.
- moe64: a plain loop over tokens and their top-k experts, with the bf16 roundings of [R]
  (linear outputs, SiLU(gate) * up before the down linear), combined in float64.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128
E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6
E4M3_MANTISSA_BITS = 3
AMAX_FLOOR = 1e-4
MAX_INV_FP32 = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))  # [R]'s fp8_max_inv


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 values -> the nearest e4m3fn value (ties to even), saturating at +-448, in float64."""
    v = v.double()
    a = v.abs()
    exp = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a))))
    exp = exp.clamp_min(E4M3_MIN_NORMAL_EXP)  # subnormals share the smallest normal's quantum
    quantum = torch.exp2(exp - E4M3_MANTISSA_BITS)
    r = torch.round(a / quantum) * quantum  # torch.round is half-to-even
    return torch.sign(v) * r.clamp(max=E4M3_MAX)


def to_fp32(v: torch.Tensor) -> torch.Tensor:
    return v.float().double()


def to_bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).double()


def act_quant64(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] float64 holding e4m3 values, s [T, ceil(K/128)] float64 holding fp32)."""
    x = x.double()
    tokens, k = x.shape
    kb = math.ceil(k / BLOCK)
    s = torch.empty(tokens, kb, dtype=torch.float64)
    q = torch.empty_like(x)
    for b in range(kb):
        g = x[:, b * BLOCK : (b + 1) * BLOCK]
        sb = to_fp32(to_fp32(g.abs().amax(dim=1).clamp_min(AMAX_FLOOR)) * MAX_INV_FP32)  # [R]: all in fp32
        if pow2:
            sb = torch.exp2(torch.ceil(torch.log2(sb)))  # exact in float64 (log2 of 2^k(1+2^-23) > k)
        s[:, b] = sb
        # [R] divides in fp32 and then casts: the fp32 quotient often is an exact e4m3 tie.
        q[:, b * BLOCK : (b + 1) * BLOCK] = round_e4m3(to_fp32(g / sb[:, None]))
    return q, s


def quantize_weight64(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A master weight [N, K] -> (e4m3 weight as torch float8, fp32 scale [ceil(N/128), ceil(K/128)]).

    Per 128x128 block: s = amax / 448 (power of two rounded up for ue8m0), q = e4m3(w / s). The
    float8 cast of an already-e4m3 value is exact."""
    w = w.double()
    n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    s = torch.empty(nb, kb, dtype=torch.float64)
    q = torch.empty_like(w)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            sb = to_fp32(blk.abs().amax().clamp_min(AMAX_FLOOR) / E4M3_MAX)
            if pow2:
                sb = torch.exp2(torch.ceil(torch.log2(sb)))
            s[i, j] = sb
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = round_e4m3(blk / sb)
    return q.to(torch.float8_e4m3fn), s.float()


def dequantize64(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    full = scale.double().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return w.double() * full


def fp8_gemm64(q: torch.Tensor, s_x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float64 [T, N]: sum over K blocks of s_x * s_w * (exact sum of e4m3 products)."""
    n, k = w.shape
    wd = w.double()
    s_w = w_scale.double().repeat_interleave(BLOCK, 0)[:n]  # [N, KB]
    out = torch.zeros(q.shape[0], n, dtype=torch.float64)
    for b in range(math.ceil(k / BLOCK)):
        cols = slice(b * BLOCK, (b + 1) * BLOCK)
        out += (q[:, cols] @ wd[:, cols].T) * to_fp32(s_x[:, b : b + 1] * s_w[:, b])  # [R]: s_a * s_b in fp32
    return out


def fp8_linear64(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, pow2: bool) -> torch.Tensor:
    """The official fp8 linear: bf16 x [T, K] -> float64 [T, N] holding bf16 values."""
    q, s = act_quant64(x, pow2)
    return to_bf16(fp8_gemm64(q, s, w, w_scale))


def linear64_unquantised(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x times the dequantised weight, no activation quantisation: the loose tier's target."""
    return x.double() @ dequantize64(w, w_scale).T


def _silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1.0 + torch.exp(-v))


def moe64(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset: int, pow2: bool,
          quantise_acts: bool = True) -> torch.Tensor:
    """Routed experts of one rank, one (token, expert) pair at a time -> float64 [T, D].

    fp8 weights (scales given): fp8 linears as fp8_linear64 (with ``quantise_acts=False`` the
    activations stay unquantised: the loose tier). bf16 weights (scales None): exact products,
    outputs rounded to bf16."""
    tokens, hidden = x.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(tokens, hidden, dtype=torch.float64)

    def linear(v, w, s):
        if s is None:
            return to_bf16(v.double() @ w.double().T)
        if quantise_acts:
            return fp8_linear64(v, w, s, pow2)
        return to_bf16(linear64_unquantised(v, w, s))

    for t in range(tokens):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j]) - expert_offset
            if not 0 <= e < num_local:
                continue
            xt = x[t : t + 1]
            s13 = None if w13_scale is None else w13_scale[e]
            gate_up = linear(xt, w13[e], s13)  # [1, 2I]
            h = to_bf16(_silu(gate_up[:, :inter]) * gate_up[:, inter:])
            y = linear(h.to(torch.bfloat16), w2[e], None if w2_scale is None else w2_scale[e])
            out[t] += float(topk_weights[t, j]) * y[0]
    return out
