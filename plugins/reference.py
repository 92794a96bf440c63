"""Plain-torch implementations of the five DSA operators (docs/architecture.md §4): the spec.

They run on any device and are the CPU implementation of ``torch.ops.dsa.*``. The CUDA kernels
(plugins/csrc) and TensorRT plugins are tested against these semantics. Pools:

* MLA pool ``[num_pages, 64, 576]``: uint8 holding e4m3 (value = e4m3 * kv_scale) in fp8 mode,
  or a float dtype (bf16 / fp32) in the exact modes.
* Indexer pool: fp8 mode ``[num_pages, 64*132]`` uint8 — the page's 64x128 e4m3 keys first,
  then its 64 fp32 scales; exact modes ``[num_pages, 64, 128]`` float.
"""

from __future__ import annotations

import torch

from dsa_trt.cache_layout import FP8_E4M3_MAX, INDEX_DIM, INDEX_KEYS_BYTES, MLA_LATENT_DIM, MLA_V_DIM, PAGE_SIZE

FP8_AMAX_FLOOR = 1e-4


# ---------------------------------------------------------------- fp8 helpers
def quant_fp8_pow2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) e4m3 quantisation with power-of-two scales (ue8m0, as [R] act_quant).

    Returns (x_fp8 [..., d] float8_e4m3fn, scale [...] fp32) with x ~= x_fp8 * scale.
    """
    amax = x.float().abs().amax(dim=-1).clamp(min=FP8_AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def index_pool_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 indexer pool [P, 8448] uint8 -> (keys [P, 64, 128] e4m3 view, scales [P, 64] fp32 view)."""
    num_pages = pool.shape[0]
    keys = pool[:, :INDEX_KEYS_BYTES].view(num_pages, PAGE_SIZE, INDEX_DIM).view(torch.float8_e4m3fn)
    scales = pool[:, INDEX_KEYS_BYTES:].view(torch.float32)
    return keys, scales


def _is_fp8_pool(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.uint8


def _gather_index_keys(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Dequantised indexer keys of the given pages, [n_pages * 64, 128] fp32 (scale folded in)."""
    if _is_fp8_pool(pool):
        keys, scales = index_pool_views(pool)
        k = keys[pages].float() * scales[pages].unsqueeze(-1)
    else:
        k = pool[pages].float()
    return k.reshape(-1, INDEX_DIM)


def dequant_mla(rows: torch.Tensor, kv_scale: float) -> torch.Tensor:
    """MLA pool rows (uint8 e4m3 or float) -> fp32."""
    if rows.dtype == torch.uint8:
        return rows.view(torch.float8_e4m3fn).float() * kv_scale
    return rows.float()


# ---------------------------------------------------------------- the five operators
def mla_cache_write(
    kv_latent: torch.Tensor,  # [T, 512]
    k_pe: torch.Tensor,  # [T, 64]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    pool: torch.Tensor,  # [P, 64, 576]
    kv_scale: float,
) -> None:
    rows = torch.cat([kv_latent.float(), k_pe.float()], dim=-1)  # [T, 576]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat = pool.view(-1, MLA_LATENT_DIM)
    if _is_fp8_pool(pool):
        q = (rows[valid] / kv_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        flat[slots] = q.view(torch.uint8)
    else:
        flat[slots] = rows[valid].to(pool.dtype)


def indexer_k_cache_write(
    index_k: torch.Tensor,  # [T, 128]
    slot_mapping: torch.Tensor,  # [T] int64
    pool: torch.Tensor,
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    page, off = slots // PAGE_SIZE, slots % PAGE_SIZE
    k = index_k[valid]
    if _is_fp8_pool(pool):
        keys, scales = index_pool_views(pool)
        q, s = quant_fp8_pow2(k)
        keys[page, off] = q
        scales[page, off] = s
    else:
        pool[page, off] = k.to(pool.dtype)


def indexer_logits(
    q: torch.Tensor,  # [T, H, 128] e4m3 (fp8 pool) or float
    weights: torch.Tensor,  # [T, H] fp32, all scales folded in
    pool: torch.Tensor,
    page_table: torch.Tensor,  # [B, max_pages] int32
    req_idx: torch.Tensor,  # [T] int32
    seq_lens: torch.Tensor,  # [T] int32
) -> torch.Tensor:
    """logits[t, s] = sum_h w[t,h] relu(q[t,h].k[s]) for s < seq_lens[t], else -inf. [T, max_pages*64] fp32."""
    num_tokens = q.shape[0]
    max_len = page_table.shape[1] * PAGE_SIZE
    out = torch.full((num_tokens, max_len), float("-inf"), dtype=torch.float32, device=q.device)
    qf = q.float()
    for b in torch.unique(req_idx).tolist():
        rows = (req_idx == b).nonzero().squeeze(-1)
        k = _gather_index_keys(pool, page_table[b].long())  # [S, 128]
        scores = torch.relu(torch.einsum("thd,sd->ths", qf[rows], k))
        out[rows] = torch.einsum("ths,th->ts", scores, weights[rows].float())
    cols = torch.arange(max_len, device=q.device)
    return out.masked_fill(cols[None, :] >= seq_lens[:, None].long(), float("-inf"))


def topk_translate(
    logits: torch.Tensor,  # [rows, S] fp32
    lengths: torch.Tensor,  # [rows] int32
    page_table: torch.Tensor,  # [B, max_pages] int32
    req_idx: torch.Tensor,  # [rows] int32
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, indices) int32 [rows, k]: top-k positions among [0, lengths) translated through the
    page table; -1 where the row has fewer than k candidates."""
    rows, width = logits.shape
    kk = min(k, width)
    cols = torch.arange(width, device=logits.device)
    masked = logits.masked_fill(cols[None, :] >= lengths[:, None].long(), float("-inf"))
    idx = masked.topk(kk, dim=-1).indices  # [rows, kk]
    # -inf candidates beyond the length sort last; re-check validity by position (a -inf score is a valid key)
    valid = idx < lengths[:, None].long()
    pages = page_table.long()[req_idx.long()[:, None], idx // PAGE_SIZE]
    slots = torch.where(valid, pages * PAGE_SIZE + idx % PAGE_SIZE, -1)
    indices = torch.where(valid, idx, -1)
    if kk < k:
        pad = torch.full((rows, k - kk), -1, dtype=slots.dtype, device=slots.device)
        slots, indices = torch.cat([slots, pad], -1), torch.cat([indices, pad], -1)
    return slots.to(torch.int32), indices.to(torch.int32)


def sparse_mla(
    q: torch.Tensor,  # [T, H, 576]
    pool: torch.Tensor,  # [P, 64, 576]
    slots: torch.Tensor,  # [T, k] int32
    kv_scale: float,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, 512] in q's dtype, lse [T, H] fp32); all-invalid rows give 0 and -inf."""
    valid = slots >= 0  # [T, k]
    kv = dequant_mla(pool.view(-1, MLA_LATENT_DIM)[slots.clamp(min=0).long()], kv_scale)  # [T, k, 576]
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("thk,tkd->thd", probs, kv[..., :MLA_V_DIM])
    return out.to(q.dtype), lse
