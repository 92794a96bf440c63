"""Plain-torch production references of the fp8 block-scaled linear and the routed MoE experts.

They emulate the official DeepSeek-V3.2 recipe (spec/MODEL.md §6) exactly up to fp32 summation
order, run on any device, and are what CPU engines execute; the CUDA kernels (plugins/csrc,
contract in dsa_moe_kernels.h) compute the same functions.

- ``act_quant``: per token, 1x128 groups along K (the last group may be partial), s = max(amax,
  1e-4) * fp32(1/448), rounded up to a power of two when the checkpoint's scale_fmt is ue8m0,
  q = e4m3(fp32(x / s)) (the official kernel's fp32 division, then the cast).
- ``fp8_block_linear``: e4m3 products summed in fp32 per 128-wide K block, each block's sum scaled
  by s_x[t, kb] * s_w[n // 128, kb] and accumulated in fp32, output bf16.
- ``moe_experts``: the (token, expert) pairs whose expert is on this rank, grouped by expert with
  one sort; gate/up linear, SiLU(gate) * up in fp32, cast to bf16, down linear, combine weighted in
  fp32. Pairs of other ranks' experts add nothing (expert-parallel ranks sum their outputs).

No argument validation here: the torch ops (plugins/fp8_ops.py) validate at the boundary.
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F

FP8_BLOCK = 128  # 1x128 activation groups and 128x128 weight blocks
FP8_E4M3_MAX = 448.0
ACT_AMAX_FLOOR = 1e-4  # the official act_quant's clamp: an all-zero group gets a finite scale
# The official kernel multiplies by the fp32 reciprocal (s = amax * fp8_max_inv), which differs
# from amax / 448 in the last bit, and x / s then often lands exactly on an e4m3 tie.
FP8_MAX_INV = struct.unpack("f", struct.pack("f", 1.0 / FP8_E4M3_MAX))[0]  # fp32(1/448); import-safe under meta
FP8 = torch.float8_e4m3fn


def num_blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s (s > 0, fp32), from the exponent bits as the official
    fast_log2_ceil does: fp32 log2 rounds 2^k * (1 + 2^-23) to exactly k, so ceil(log2) would not."""
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, s, torch.ldexp(torch.ones_like(s), exponent))


def act_quant(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q e4m3 [T, K], s fp32 [T, ceil(K/128)]) with x ~= q * s per group."""
    tokens, k = x.shape
    kb = num_blocks(k)
    xf = x.float()
    if kb * FP8_BLOCK != k:  # zero padding leaves every group's amax unchanged
        xf = F.pad(xf, (0, kb * FP8_BLOCK - k))
    groups = xf.view(tokens, kb, FP8_BLOCK)
    s = groups.abs().amax(dim=2).clamp_min(ACT_AMAX_FLOOR) * FP8_MAX_INV  # [T, KB] fp32
    if pow2:
        s = pow2_ceil(s)
    q = (groups / s[:, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)
    return q.view(tokens, kb * FP8_BLOCK)[:, :k].contiguous(), s


def fp8_gemm(q: torch.Tensor, s_x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Quantised activations (q [T, K] e4m3, s_x [T, KB]) x weight [N, K] e4m3 -> fp32 [T, N]."""
    tokens, k = q.shape
    n = weight.shape[0]
    # [N, KB]: each output row's scale per K block (a partial last row block covers the rest).
    s_w = weight_scale.float().repeat_interleave(FP8_BLOCK, dim=0)[:n]
    qf, wf = q.float(), weight.float()
    acc = torch.zeros(tokens, n, dtype=torch.float32, device=q.device)
    for b in range(num_blocks(k)):
        lo, hi = b * FP8_BLOCK, min(k, (b + 1) * FP8_BLOCK)
        # Products of two e4m3 values are exact in fp32; the 128-term sum is the kernel's fp32 MMA.
        partial = qf[:, lo:hi] @ wf[:, lo:hi].T  # [T, N]
        acc += partial * (s_x[:, b : b + 1] * s_w[:, b])  # the official C += C_blk * (s_a * s_b)
    return acc


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, pow2: bool
) -> torch.Tensor:
    """bf16 x [T, K] x e4m3 weight [N, K] (scale [ceil(N/128), ceil(K/128)]) -> bf16 [T, N]."""
    q, s_x = act_quant(x, pow2)
    return fp8_gemm(q, s_x, weight, weight_scale).to(torch.bfloat16)


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 x [T, K] x bf16 weight [N, K] with fp32 accumulation -> bf16 [T, N]."""
    return (x.float() @ weight.float().T).to(torch.bfloat16)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    num_experts: int,
    expert_offset: int,
    pow2: bool,
) -> torch.Tensor:
    """Routed experts of this rank -> fp32 [T, D] (see the module docstring and dsa_moe_kernels.h).

    x [T, D] bf16, topk_ids [T, k] int32 global ids, topk_weights [T, k] fp32, w13 [E_local, 2I, D]
    (gate rows, then up rows), w2 [E_local, D, I]; e4m3 with fp32 128x128 scales, or bf16 with both
    scales None. ``num_experts`` is the global count; the op validated ids against it."""
    tokens, hidden = x.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    top_k = topk_ids.shape[1]
    local = topk_ids.reshape(-1).long() - expert_offset  # [T * k]
    pair = torch.nonzero((local >= 0) & (local < num_local)).squeeze(1)  # pairs of this rank
    if pair.numel() == 0:
        return out
    expert_of_pair = local[pair]
    order = torch.argsort(expert_of_pair, stable=True)  # group pairs by expert, tokens ascending
    pair, expert_of_pair = pair[order], expert_of_pair[order]
    counts = torch.bincount(expert_of_pair, minlength=num_local).tolist()
    token_of_pair = pair // top_k
    weight_of_pair = topk_weights.reshape(-1)[pair].float()  # [P]
    fp8 = w13_scale is not None
    if fp8:
        # act_quant is per token, so every expert's gate/up sees the same quantised row.
        qx, sx = act_quant(x, pow2)
    start = 0
    for e, count in enumerate(counts):  # ascending experts: the official combine order
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        tok = token_of_pair[rows]
        if fp8:
            gate_up = fp8_gemm(qx[tok], sx[tok], w13[e], w13_scale[e]).to(torch.bfloat16)  # [P_e, 2I]
        else:
            gate_up = _bf16_linear(x[tok], w13[e])
        gate, up = gate_up[:, :inter].float(), gate_up[:, inter:].float()
        h = (F.silu(gate) * up).to(torch.bfloat16)  # [P_e, I]; [R] casts to bf16 before w2
        y = fp8_block_linear(h, w2[e], w2_scale[e], pow2) if fp8 else _bf16_linear(h, w2[e])  # bf16 [P_e, D]
        out.index_add_(0, tok, y.float() * weight_of_pair[rows, None])
    return out
