"""Independent float64 reference of DsaSparseMla for the kernel tests and the benchmark.

Never imports dsa_trt. Two functions:

* ``sparse_mla_ref``: the operator's semantics (docs/architecture.md §4) in float64 on whatever inputs it is
  given: gather the 576-d latent rows by slot (-1 and out-of-range slots skipped), dequantise
  (e4m3 * kv_scale for a uint8 pool, as-is for a float pool), scores = sm_scale * q . kv,
  softmax over the selected keys, out = P . kv[:512]; lse natural log; a row with no valid slot
  gives out 0 and lse -inf.
* ``sparse_mla_fp8_emulated``: the same operator computed the way the fp8 kernel computes it
  (q quantised per head to e4m3 with scale amax / 448 -- in float32, bit-exact with the kernel --,
  online softmax over tiles of 64 keys in the log2 domain with the exact running max m,
  P = 2^(z - m + 8) stored as e4m3), in float64 elsewhere. The kernel should match it up to fp32
  accumulation order and ex2.approx, so the tight test tier measures kernel bugs, not
  quantisation error. A split-KV run (``chunks``: the key ranges of the launcher's chunks, whole
  64-key tiles) is replayed chunk by chunk -- each chunk has its own running max, so its P rounds
  to e4m3 differently from the unsplit run's -- and the chunks are merged by lse in float64, as
  the combine kernel does in fp32.
* ``fp8_split_chunks``: those key ranges, by the launcher's rule (sparse_mla.cu choose_splits).
"""

from __future__ import annotations

import math

import torch

MLA_DIM = 576
MLA_V_DIM = 512
PAGE_SIZE = 64
FP8_MAX = 448.0
TILE_KEYS = 64  # the fp8 kernel's key tile (online-softmax granularity)
P_OFFSET = 8.0  # P is scaled by 2^8 before e4m3
Q_AMAX_FLOOR = 1e-20
LOG2E_F32 = 1.4426950408889634  # the kernel's kLog2e (rounded to float32 when multiplied)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (RNE, saturate to +-448, NaN stays NaN) and return float64."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float64)


def gather_rows(pool: torch.Tensor, slots: torch.Tensor, kv_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv [T, k, 576] float64 dequantised, valid [T, k] bool). Invalid rows are zero."""
    flat = pool.reshape(-1, MLA_DIM)
    slots = slots.long()
    valid = (slots >= 0) & (slots < flat.shape[0])
    rows = flat[torch.where(valid, slots, 0)]
    if rows.dtype == torch.uint8:
        kv = rows.view(torch.float8_e4m3fn).to(torch.float64) * kv_scale
    else:
        kv = rows.to(torch.float64)
    return kv.masked_fill(~valid[..., None], 0.0), valid


def _finish(scores: torch.Tensor, valid: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]; -inf for all-invalid rows
    probs = torch.exp(scores - lse[..., None])
    probs = torch.where(valid[:, None, :], probs, torch.zeros_like(probs))  # keeps NaN of valid keys
    out = torch.einsum("thk,tkd->thd", probs, v)
    empty = ~valid.any(dim=-1)  # [T]
    out = out.masked_fill(empty[:, None, None], 0.0)
    return out, lse


def sparse_mla_ref(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, kv_scale: float,
                   sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, 512] float64, lse [T, H] float64)."""
    kv, valid = gather_rows(pool, slots, kv_scale)
    scores = torch.einsum("thd,tkd->thk", q.to(torch.float64), kv) * sm_scale
    return _finish(scores, valid, kv[..., :MLA_V_DIM])


WAVE_CTAS = 132  # sparse_mla.cu kWaveCtas
MAX_SPLIT_CTAS = 2 * WAVE_CTAS  # kMaxSplitCtas
ITEM_FIXED_TILES, COMBINE_TILES = 3, 2  # kItemFixedTiles, kCombineTiles


def _whole_tile_chunks(tiles: int, want: int) -> int:
    n = max(1, min(want, tiles))
    per = -(-tiles // n)
    return -(-tiles // per)


def fp8_auto_splits(num_tokens: int, num_heads: int, topk: int, sm_count: int) -> int:
    """The launcher's auto chunk count (sparse_mla.cu auto_splits): one wave of min(sm_count, 132)
    CTAs with at least two chunks per token, as many as fit; else, within MAX_SPLIT_CTAS items, the
    count minimising ceil(items / wave) x (chunk tiles + ITEM_FIXED_TILES) + COMBINE_TILES (1: unsplit)."""
    tiles = -(-topk // TILE_KEYS)
    ctas = num_tokens * -(-num_heads // 64)
    wave = min(max(sm_count, 1), WAVE_CTAS)
    if 2 * ctas <= wave:
        n = _whole_tile_chunks(tiles, wave // ctas)
        if n > 1:
            return n
    best, best_cost = 1, -(-ctas // wave) * (tiles + ITEM_FIXED_TILES)
    for want in range(2, min(tiles, 32) + 1):
        n = _whole_tile_chunks(tiles, want)
        if n != want:
            continue
        if ctas * n > MAX_SPLIT_CTAS:
            break
        cost = -(-ctas * n // wave) * (-(-tiles // n) + ITEM_FIXED_TILES) + COMBINE_TILES
        if cost < best_cost:
            best, best_cost = n, cost
    return best


def fp8_split_chunks(num_tokens: int, num_heads: int, topk: int, num_splits: int, sm_count: int,
                     workspace: bool = True) -> list[tuple[int, int]]:
    """Key ranges [k0, k1) of the chunks the fp8 launcher runs (sparse_mla.cu choose_splits); one range
    (0, topk) when it runs unsplit. num_splits: 0 = auto (fp8_auto_splits; unsplit without a
    workspace), n >= 1 = about n chunks. Chunks are whole 64-key tiles: ceil(tiles / n) each, the
    last one shorter."""
    tiles = -(-topk // TILE_KEYS)
    if num_splits == 0:
        n = fp8_auto_splits(num_tokens, num_heads, topk, sm_count) if workspace else 1
    else:
        n = _whole_tile_chunks(tiles, num_splits)
    per = -(-tiles // n)  # n is whole-tile already: ceil(tiles / per) == n
    if n == 1:
        return [(0, topk)]
    return [(c * per * TILE_KEYS, min(topk, (c + 1) * per * TILE_KEYS)) for c in range(n)]


def combine_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-chunk (out [T, H, 512], lse [T, H]) by lse in float64 (the combine kernel's math): w_s =
    exp(lse_s - max lse), out = sum w_s out_s / sum w_s, lse = max + log sum w_s. A -inf chunk weighs 0,
    all -inf gives out 0 / lse -inf, a NaN chunk makes the row NaN."""
    if len(parts) == 1:
        return parts[0]
    po = torch.stack([p[0] for p in parts]).to(torch.float64)
    pl = torch.stack([p[1] for p in parts]).to(torch.float64)
    mx = pl.amax(dim=0)  # NaN if any chunk is NaN
    w = torch.where(pl == -math.inf, torch.zeros_like(pl), torch.exp(pl - mx))
    ws = w.sum(dim=0)
    empty = ws == 0
    out = torch.where(empty[..., None], torch.zeros_like(po[0]), (w[..., None] * po).sum(0) / ws[..., None])
    lse = torch.where(empty, torch.full_like(mx, -math.inf), mx + torch.log(ws))
    return out, lse


def sparse_mla_fp8_emulated(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, kv_scale: float,
                            sm_scale: float, chunks: list[tuple[int, int]] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 kernel's arithmetic in float64 (see module docstring). pool must be uint8. chunks: the key
    ranges of a split-KV run (fp8_split_chunks), each replayed alone and merged by lse; None = unsplit."""
    if chunks is not None and len(chunks) > 1:
        return combine_lse([sparse_mla_fp8_emulated(q, pool, slots[:, k0:k1].contiguous(), kv_scale, sm_scale)
                            for k0, k1 in chunks])
    assert pool.dtype == torch.uint8
    flat = pool.reshape(-1, MLA_DIM)
    slots = slots.long()
    valid = (slots >= 0) & (slots < flat.shape[0])
    kv8 = flat[torch.where(valid, slots, 0)].view(torch.float8_e4m3fn).to(torch.float64)  # raw e4m3 values
    kv8 = kv8.masked_fill(~valid[..., None], 0.0)
    # q -> e4m3 exactly as the kernel does it, in float32: inv = 448 / max(amax, floor), q8 = rne(q * inv)
    # (float64 here would move products that sit on an e4m3 rounding midpoint)
    q32 = q.to(torch.float32)
    amax = q32.abs().nan_to_num(nan=0.0).amax(dim=-1).clamp(min=Q_AMAX_FLOOR)  # [T, H] float32
    inv = FP8_MAX / amax
    q8 = e4m3(q32 * inv[..., None])
    # log2-domain score per unit of the e4m3 dot product, float32 in the kernel's order
    f = ((amax / FP8_MAX) * sm_scale * kv_scale * LOG2E_F32).to(torch.float64)
    num_tokens, heads = q.shape[:2]
    k = slots.shape[1]
    m = torch.full((num_tokens, heads), -math.inf, dtype=torch.float64, device=q.device)
    l = torch.zeros_like(m)
    o = torch.zeros((num_tokens, heads, MLA_V_DIM), dtype=torch.float64, device=q.device)
    for k0 in range(0, k, TILE_KEYS):
        kt = kv8[:, k0:k0 + TILE_KEYS]
        vt = valid[:, k0:k0 + TILE_KEYS]
        z = torch.einsum("thd,tkd->thk", q8, kt) * f[..., None]
        z = z.masked_fill(~vt[:, None, :], -math.inf)
        m_new = torch.maximum(m, z.nan_to_num(nan=-math.inf).amax(dim=-1))
        alpha = torch.where(m == -math.inf, torch.zeros_like(m), torch.exp2(m - m_new))
        bias = torch.where(m_new == -math.inf, torch.zeros_like(m_new), P_OFFSET - m_new)
        p = torch.exp2(z + bias[..., None])
        l = l * alpha + p.sum(dim=-1)
        o = o * alpha[..., None] + torch.einsum("thk,tkd->thd", e4m3(p), kt[..., :MLA_V_DIM])
        m = m_new
    empty = l == 0
    out = torch.where(empty[..., None], torch.zeros_like(o), o * kv_scale / l[..., None])
    lse = torch.where(empty, torch.full_like(m, -math.inf), (m - P_OFFSET + torch.log2(l)) * math.log(2.0))
    return out, lse
