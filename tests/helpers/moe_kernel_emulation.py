"""Plain-torch emulation of plugins/csrc/moe_experts.cu: the kernel's own data layout and index
arithmetic, step by step, so the CUDA kernel's mapping can be checked on a CPU.

What is emulated as the kernel does it (not as the reference does it):
- moe_prep: 32 warps, each over a contiguous run of ceil(P / 32) pairs, 32 lanes at a time; lanes
  of one local expert grouped (match_any), counts per (warp, expert), the block scan, the
  expert-sorted pair list (sorted_token / sorted_expert), pair -> position (pair_pos), and the
  tile table (tile_expert / tile_start, tiles of BN positions of one expert, BN from pick_bn).
- act_quant: e4m3 rows of nkb * 128 bytes (zero past K) + fp32 scales [rows, nkb].
- the grouped GEMM on flat weight memory: CTA (m_tile, tile) reads weight rows
  w + e * w_expert_stride + r * K (zero past N), scales ws + e * ws_expert_stride + m_tile * nkb,
  activation rows through a_index; per 128-wide K block 4 k32 MMA steps into a block
  accumulator, then total = fma(acc, s_w * s_x, total) in fp32; bf16 out[row, n].
- swiglu: h = bf16(silu(gate) * up), silu = g / (1 + exp(-g)) in fp32, re-quantised 1x128.
- combine: per token its local pairs by ascending position, acc = fp32(acc + fp32(w * y)).

The fp8 MMA's accumulator is a model (``tc_bits``): None sums exactly (the block sum rounded to
fp32 once); an integer emulates Hopper's e4m3 wgmma, which aligns the 32 products of a k32 step and
the running accumulator to the largest exponent and keeps ``tc_bits`` bits below it, truncating
the rest (DeepSeek-V3 report §3.5.2: "the highest 14 bits"; SageAttention2: an e8m13
accumulator). With tc_bits=13 the emulation reproduces the rate and size of the differences the
H200 shows against a float64 emulation (see tests/test_moe_kernel_emulation.py).

Never imports production code; runs on any device.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

BLOCK = 128
TILE_M = 128
PREP_WARPS = 32
MIN_BN = 8
E4M3_MAX = 448.0
MAX_INV = struct.unpack("f", struct.pack("f", 1.0 / E4M3_MAX))[0]  # fp32(1/448)
AMAX_FLOOR = 1e-4
FP8 = torch.float8_e4m3fn


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pick_bn(avg_pairs: int) -> int:
    for bn in (8, 16, 32, 64):
        if avg_pairs <= bn:
            return bn
    return 128


@dataclass
class Plan:
    pairs: int
    nkb_d: int
    nkb_i: int
    bn: int
    max_tiles: int   # the grid's tile dimension (static bound)
    table: int       # entries of the tile table in the workspace


def plan_moe(tokens: int, top_k: int, num_local: int, d: int, inter: int) -> Plan:
    pairs = tokens * top_k
    e = max(num_local, 1)
    bn = pick_bn(ceil_div(pairs, e))
    return Plan(pairs, ceil_div(d, BLOCK), ceil_div(inter, BLOCK), bn, ceil_div(pairs, bn) + e,
                ceil_div(pairs, MIN_BN) + e)


@dataclass
class Routing:
    sorted_token: torch.Tensor    # [P] int64 (entries >= total unused)
    sorted_expert: torch.Tensor   # [P]
    pair_pos: torch.Tensor        # [P] position of each pair, -1 if not local
    expert_offsets: torch.Tensor  # [E + 1]
    num_tiles: int
    tile_expert: torch.Tensor     # [table]
    tile_start: torch.Tensor      # [table]


def moe_prep(ids: torch.Tensor, num_experts: int, num_local: int, offset: int, plan: Plan) -> Routing:
    """The prep kernel's algorithm, warp by warp and lane group by lane group."""
    flat = ids.reshape(-1).tolist()
    top_k = ids.shape[1]
    p = len(flat)
    per_warp = ceil_div(p, PREP_WARPS)

    def local_expert(pidx: int, end: int) -> int:
        if pidx >= end:
            return -1
        le = flat[pidx] - offset
        return le if 0 <= flat[pidx] < num_experts and 0 <= le < num_local else -1

    cnt = [[0] * num_local for _ in range(PREP_WARPS)]
    for w in range(PREP_WARPS):  # pass 1: the leader of each lane group adds its popcount
        begin, end = w * per_warp, min(p, w * per_warp + per_warp)
        for base in range(begin, end, 32):
            les = [local_expert(base + lane, end) for lane in range(32)]
            for le in set(les):
                if le >= 0:
                    cnt[w][le] += les.count(le)
    tot = [sum(cnt[w][e] for w in range(PREP_WARPS)) for e in range(num_local)]
    ntile = [ceil_div(t, plan.bn) for t in tot]
    off = [sum(tot[:e]) for e in range(num_local)]
    toff = [sum(ntile[:e]) for e in range(num_local)]
    tile_expert = torch.full((plan.table,), -1, dtype=torch.int64)
    tile_start = torch.full((plan.table,), -1, dtype=torch.int64)
    for e in range(num_local):
        run = off[e]
        for w in range(PREP_WARPS):
            c = cnt[w][e]
            cnt[w][e] = run
            run += c
        for j in range(ntile[e]):
            tile_expert[toff[e] + j] = e
            tile_start[toff[e] + j] = off[e] + j * plan.bn
    sorted_token = torch.full((p,), -1, dtype=torch.int64)
    sorted_expert = torch.full((p,), -1, dtype=torch.int64)
    pair_pos = torch.full((p,), -1, dtype=torch.int64)
    for w in range(PREP_WARPS):  # pass 2: position = (warp, expert) base + rank among earlier lanes
        begin, end = w * per_warp, min(p, w * per_warp + per_warp)
        for base in range(begin, end, 32):
            les = [local_expert(base + lane, end) for lane in range(32)]
            pos = [cnt[w][le] + les[:lane].count(le) if le >= 0 else -1 for lane, le in enumerate(les)]
            for le in set(les):
                if le >= 0:
                    cnt[w][le] += les.count(le)
            for lane in range(32):
                pidx = base + lane
                if pidx < end:
                    pair_pos[pidx] = pos[lane]
                    if pos[lane] >= 0:
                        sorted_token[pos[lane]] = pidx // top_k
                        sorted_expert[pos[lane]] = les[lane]
    offsets = torch.tensor(off + [sum(tot)], dtype=torch.int64)
    return Routing(sorted_token, sorted_expert, pair_pos, offsets, sum(ntile), tile_expert, tile_start)


def act_scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    s = amax.float().clamp_min(AMAX_FLOOR) * MAX_INV
    if pow2:  # add the mantissa mask, drop the mantissa: 2^ceil(log2 s) for a positive normal s
        bits = s.view(torch.int32).to(torch.int64)
        s = ((bits + 0x7FFFFF) & 0xFF800000).to(torch.int32).view(torch.float32)
    return s


def act_quant_rows(v: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [R, K] -> (e4m3 rows [R, nkb * 128], zero past K; fp32 scales [R, nkb])."""
    r, k = v.shape
    nkb = ceil_div(k, BLOCK)
    g = torch.zeros(r, nkb * BLOCK, dtype=torch.float32, device=v.device)
    g[:, :k] = v.float()
    g = g.view(r, nkb, BLOCK)
    s = act_scale(g.abs().amax(-1), pow2)
    q = (g / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(r, nkb * BLOCK), s


def mma_block(a: torch.Tensor, w: torch.Tensor, tc_bits: int | None) -> torch.Tensor:
    """One 128-wide K block: a [BN, 128], w [128 rows, 128] (e4m3 values in float64) -> the fp32
    block accumulator [BN, 128], four k32 steps (exact, or the truncating-accumulator model)."""
    if tc_bits is None:
        return (a @ w.T).float()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64, device=a.device)
    for s in range(BLOCK // 32):
        prod = a[:, None, 32 * s:32 * s + 32] * w[None, :, 32 * s:32 * s + 32]  # exact
        top = torch.maximum(acc.abs(), prod.abs().amax(-1))
        exp = torch.floor(torch.log2(torch.where(top > 0, top, torch.ones_like(top))))
        quantum = torch.exp2(exp - tc_bits)
        acc = (torch.trunc(prod / quantum[..., None]).sum(-1) + torch.trunc(acc / quantum)) * quantum
    return acc.float()


@dataclass
class GemmArgs:
    w: torch.Tensor           # flat e4m3 weight memory [E * N * K]
    w_scale: torch.Tensor     # flat fp32 [E * ceil(N/128) * nkb]
    w_expert_stride: int
    ws_expert_stride: int
    n: int
    k: int
    nkb: int
    a: torch.Tensor           # e4m3 [rows, nkb * 128]
    a_scale: torch.Tensor     # fp32 [rows, nkb]
    a_index: torch.Tensor | None


def grouped_gemm(g: GemmArgs, route: Routing, bn: int, max_tiles: int, out_rows: int,
                 tc_bits: int | None) -> torch.Tensor:
    """moe_gemm_kernel over its grid (ceil(N / 128), max_tiles) -> bf16 [out_rows, N] (rows no
    tile covers stay NaN, as an unwritten workspace would hold garbage)."""
    out = torch.full((out_rows, g.n), float("nan"), dtype=torch.bfloat16)
    m_tiles = ceil_div(g.n, TILE_M)
    wf = g.w.to(torch.float64) if g.w.dtype != FP8 else g.w.float().double()
    af = g.a.float().double()
    for tile in range(max_tiles):
        if tile >= route.num_tiles:
            continue  # CTA exits
        e = int(route.tile_expert[tile])
        rb = int(route.tile_start[tile])
        re = min(rb + bn, int(route.expert_offsets[e + 1]))
        rows = torch.arange(rb, re)
        arow = g.a_index[rows] if g.a_index is not None else rows
        for m_tile in range(m_tiles):
            m0 = m_tile * TILE_M
            nrows = min(TILE_M, g.n - m0)  # rows past N are zero-filled
            wt = torch.zeros(TILE_M, g.nkb * BLOCK, dtype=torch.float64)
            base = e * g.w_expert_stride + m0 * g.k
            wt[:nrows, :g.k] = wf[base:base + nrows * g.k].view(nrows, g.k)
            ws0 = e * g.ws_expert_stride + m_tile * g.nkb
            total = torch.zeros(len(rows), TILE_M, dtype=torch.float32)
            for kb in range(g.nkb):
                acc = mma_block(af[arow, kb * BLOCK:(kb + 1) * BLOCK], wt[:, kb * BLOCK:(kb + 1) * BLOCK], tc_bits)
                scale = (g.w_scale[ws0 + kb] * g.a_scale[arow, kb]).float()  # fp32 s_w * s_x per token
                total = (acc.double() * scale.double()[:, None] + total.double()).float()  # fmaf
            out[rb:re, m0:m0 + nrows] = total[:, :nrows].to(torch.bfloat16)
    return out


def swiglu_quant(gu: torch.Tensor, total: int, inter: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = gu[:total, :inter].float()
    u = gu[:total, inter:2 * inter].float()
    silu = g / (1.0 + torch.exp(-g))
    h = (silu * u).to(torch.bfloat16)
    return act_quant_rows(h.float(), pow2)


def combine(y: torch.Tensor, route: Routing, weights: torch.Tensor) -> torch.Tensor:
    t, k = weights.shape
    out = torch.zeros(t, y.shape[1], dtype=torch.float32)
    pos = route.pair_pos.view(t, k)
    for tok in range(t):
        local = sorted((int(pos[tok, j]), j) for j in range(k) if pos[tok, j] >= 0)
        acc = torch.zeros(y.shape[1], dtype=torch.float32)
        for p, j in local:
            acc = acc + (weights[tok, j].float() * y[p].float())  # fp32 product, then fp32 add
        out[tok] = acc
    return out


def moe_experts_kernel_emulation(x, ids, weights, w13, w13_scale, w2, w2_scale, num_experts: int,
                                 offset: int, pow2: bool, tc_bits: int | None = None) -> torch.Tensor:
    """The fp8 path of dsa_launch_moe_experts on CPU tensors -> fp32 [T, D]."""
    x, ids, weights = x.cpu(), ids.cpu(), weights.cpu()
    e_local, two_i, d = w13.shape
    inter = two_i // 2
    t, k = ids.shape
    plan = plan_moe(t, k, e_local, d, inter)
    route = moe_prep(ids, num_experts, e_local, offset, plan)
    total = int(route.expert_offsets[-1])
    qx, sx = act_quant_rows(x.float(), pow2)
    g1 = GemmArgs(w13.cpu().reshape(-1), w13_scale.cpu().float().reshape(-1), 2 * inter * d,
                  ceil_div(2 * inter, BLOCK) * plan.nkb_d, 2 * inter, d, plan.nkb_d, qx, sx, route.sorted_token)
    gu = grouped_gemm(g1, route, plan.bn, plan.max_tiles, plan.pairs, tc_bits)
    qh, sh = swiglu_quant(gu, total, inter, pow2)
    g2 = GemmArgs(w2.cpu().reshape(-1), w2_scale.cpu().float().reshape(-1), d * inter,
                  ceil_div(d, BLOCK) * plan.nkb_i, d, inter, plan.nkb_i, qh, sh, None)
    y = grouped_gemm(g2, route, plan.bn, plan.max_tiles, plan.pairs, tc_bits)
    return combine(y, route, weights)


def fp8_linear_emulation(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, pow2: bool,
                         tc_bits: int | None = None) -> torch.Tensor:
    """The linear launcher without K splits (one expert, identity rows) -> bf16 [T, N]: the
    building block of the composition oracle in tests/test_kernels_moe_cuda.py."""
    t, k = x.shape
    n = w8.shape[0]
    qx, sx = act_quant_rows(x.float(), pow2)
    rows = torch.arange(t)
    route = Routing(rows, torch.zeros(t, dtype=torch.int64), rows, torch.tensor([0, t]), 1,
                    torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    g = GemmArgs(w8.cpu().reshape(-1), ws.cpu().float().reshape(-1), n * k, 0, n, k, ceil_div(k, BLOCK), qx, sx,
                 None)
    return grouped_gemm(g, route, max(t, 1), 1, t, tc_bits)
