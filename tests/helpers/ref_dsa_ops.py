"""Independent float references for the kernel tests of the cache writes, indexer logits and top-k.

Written from the operator contracts (docs/architecture.md §4-5) alone; it never imports dsa_trt
(STYLE: the test reference never imports production code). Layouts: page of 64 tokens; MLA pool
[P, 64, 576] (uint8 e4m3 or bf16); indexer pool fp8 [P, 64*132] uint8 = the page's 64x128 e4m3 keys, then its 64 fp32 scales; bf16 indexer
pool [P, 64, 128].
"""

from __future__ import annotations

import torch

PAGE = 64
MLA_DIM, MLA_V_DIM = 576, 512
INDEX_DIM = 128
INDEX_KEYS_BYTES = PAGE * INDEX_DIM  # 8192
INDEX_PAGE_BYTES = PAGE * (INDEX_DIM + 4)  # 8448
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def to_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 bytes, saturating (RNE, as the hardware cvt with satfinite)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_to_float(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).float()


# ---------------------------------------------------------------- cache writes (computed on the CPU, fp32)
def mla_cache_write(kv_latent, k_pe, slot_mapping, pool, kv_scale: float) -> torch.Tensor:
    """Returns the pool after the write (a CPU copy); IEEE fp32 division then e4m3 RNE."""
    out = pool.detach().cpu().clone()
    flat = out.view(-1, MLA_DIM)
    rows = torch.cat([kv_latent.detach().cpu().float(), k_pe.detach().cpu().float()], dim=-1)
    slots = slot_mapping.cpu()
    for t in range(rows.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        if out.dtype == torch.uint8:
            flat[s] = to_e4m3_bytes(rows[t] / torch.tensor(kv_scale, dtype=torch.float32))
        else:
            flat[s] = rows[t].to(out.dtype)
    return out


def index_scale(k_row: torch.Tensor) -> float:
    """2^ceil(log2(max(amax, 1e-4) / 448)) in float64 (the boundary is never within fp32 rounding)."""
    amax = max(float(k_row.float().abs().max()), AMAX_FLOOR)
    return float(torch.exp2(torch.ceil(torch.log2(torch.tensor(amax / E4M3_MAX, dtype=torch.float64)))))


def indexer_k_cache_write(index_k, slot_mapping, pool) -> torch.Tensor:
    out = pool.detach().cpu().clone()
    k = index_k.detach().cpu()
    slots = slot_mapping.cpu()
    for t in range(k.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        page, off = divmod(s, PAGE)
        if out.dtype == torch.uint8:
            scale = index_scale(k[t])
            out[page, off * INDEX_DIM:(off + 1) * INDEX_DIM] = to_e4m3_bytes(k[t].float() / scale)
            out[page, INDEX_KEYS_BYTES + 4 * off:INDEX_KEYS_BYTES + 4 * off + 4] = (
                torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
            )
        else:
            out[page, off] = k[t].to(out.dtype)
    return out


# ---------------------------------------------------------------- indexer logits (float64)
def dequant_index_pool(pool: torch.Tensor) -> torch.Tensor:
    """[P, 64, 128] float64 keys with the per-token scale folded in."""
    if pool.dtype == torch.uint8:
        num_pages = pool.shape[0]
        keys = e4m3_to_float(pool[:, :INDEX_KEYS_BYTES].contiguous()).view(num_pages, PAGE, INDEX_DIM)
        scales = pool[:, INDEX_KEYS_BYTES:].contiguous().view(torch.float32).view(num_pages, PAGE)
        return keys.double() * scales.double().unsqueeze(-1)
    return pool.double()


def indexer_logits(q, weights, keys_pages, page_table, req_idx, seq_lens, absolute: bool = False) -> torch.Tensor:
    """logits [T, max_pages*64] float64: sum_h w relu(q.k), -inf at s >= seq_len.

    q: [T, H, 128] (any float, upcast), keys_pages: [P, 64, 128] float64 (dequantised pool, or
    unquantised keys laid out the same way). absolute=True returns sum_h |w| sum_d |q_d k_d| instead
    (the magnitude that bounds accumulation error).
    """
    num_tokens = q.shape[0]
    max_pages = page_table.shape[1]
    out = torch.full((num_tokens, max_pages * PAGE), float("-inf"), dtype=torch.float64, device=q.device)
    q64 = q.double()
    w64 = weights.double()
    for t in range(num_tokens):
        n = int(seq_lens[t])
        if n <= 0:
            continue
        pages = page_table[int(req_idx[t]), : (n + PAGE - 1) // PAGE].long()
        k = keys_pages[pages].reshape(-1, INDEX_DIM)[:n]  # [n, 128]
        if absolute:
            out[t, :n] = w64[t].abs() @ (q64[t].abs() @ k.abs().T)
        else:
            out[t, :n] = w64[t] @ torch.relu(q64[t] @ k.T)
    return out


# ---------------------------------------------------------------- top-k + translation checks
def check_topk(logits, lengths, page_table, req_idx, k: int, slots, indices) -> None:
    """Asserts the spec of fused top-k + translation; raises AssertionError naming row and reason.

    Set semantics: for rows with L > k, k distinct positions in [0, L), every selected value >= the
    k-th largest, and every value strictly above it selected. Rows with L <= k: positions 0..L-1 in
    some order, then -1. slots: exactly page_table[req, p // 64] * 64 + p % 64 of the indices.
    """
    rows = logits.shape[0]
    lengths = lengths.long().cpu()
    idx_all = indices.long()
    for r in range(rows):
        n = int(lengths[r])
        idx = idx_all[r]
        if n <= k:
            got = idx[:n].sort().values
            assert torch.equal(got.cpu(), torch.arange(n)), f"row {r} (L={n} <= k={k}): positions are not 0..L-1"
            assert bool((idx[n:] == -1).all()), f"row {r}: tail after L={n} is not all -1"
        else:
            assert bool((idx >= 0).all() and (idx < n).all()), f"row {r}: index outside [0, {n})"
            assert idx.unique().numel() == k, f"row {r}: duplicate indices ({idx.unique().numel()} distinct of {k})"
            vals = logits[r, :n]
            kth = torch.topk(vals, k).values[-1]
            sel = vals[idx]
            assert bool((sel >= kth).all()), (
                f"row {r}: a selected value {float(sel.min())} < k-th largest {float(kth)}"
            )
            above = int((vals > kth).sum())
            assert int((sel > kth).sum()) == above, f"row {r}: {above} values above the k-th, only "\
                f"{int((sel > kth).sum())} selected"
    # translation, exactly
    pt = page_table.long()
    req = req_idx.long()[:, None].expand_as(idx_all)
    safe = idx_all.clamp(min=0)
    want = torch.where(idx_all >= 0, pt[req, safe // PAGE] * PAGE + safe % PAGE, -1)
    bad = (want != slots.long()).nonzero()
    assert bad.numel() == 0, f"slot translation wrong at (row, j) = {bad[:5].tolist()}"


def check_tie_rule(name, logits, lengths, k: int, idx) -> None:
    """Our kernels' tie rule: among positions scoring exactly the k-th score, the selected ones are
    the lowest positions."""
    for r in range(logits.shape[0]):
        n = int(lengths[r])
        if n <= k:
            continue
        vals = logits[r, :n]
        kth = torch.topk(vals, k).values[-1]
        tied = (vals == kth).nonzero().flatten()
        n_above = int((vals > kth).sum())
        want = tied[: k - n_above]
        sel = idx[r].long()
        got = sel[vals[sel] == kth].sort().values
        assert torch.equal(got, want), (
            f"{name}: row {r}: {tied.numel()} positions tie at the k-th score {float(kth)}; selected "
            f"{got[:5].tolist()}..., expected the lowest {want[:5].tolist()}...")


def build_index_pool(keys: torch.Tensor) -> torch.Tensor:
    """Vectorised fp8 indexer pool [P, 8448] uint8 from keys [P, 64, 128] (same math as the write)."""
    num_pages = keys.shape[0]
    k = keys.float().reshape(-1, INDEX_DIM)
    amax = k.abs().amax(dim=-1).double().clamp(min=AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))).float()
    q = to_e4m3_bytes(k / scale[:, None]).view(num_pages, INDEX_KEYS_BYTES)
    return torch.cat([q, scale.view(num_pages, PAGE).contiguous().view(torch.uint8)], dim=1).contiguous()
