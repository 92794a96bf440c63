"""The two numerics tiers of the routed-MoE kernel tests (tests/test_kernels_moe_cuda.py), shared with
the CPU test that calibrates them on the kernel emulation (tests/test_moe_kernel_emulation.py).

Why not a per-element bound against a float64 emulation: Hopper's e4m3 wgmma keeps ~13 bits of
its running sum (products aligned to the largest exponent, the rest truncated; the official recipe
promotes to fp32 every 128 K, as the kernel does), so gate/up differ from a float64 sum by ~2^-13
relative, which moves the bf16 rounding of gate/up, then the e4m3 rounding of h (an e4m3 step is
2^-4..2^-3 of a value; with fp32 scales a moved amax re-quantises the whole 128-group). Each such
step moves y by w2[:, i] * step over all D outputs, so outputs that happen to cancel to near zero
miss any bound relative to their own size. The float64 emulation's differences are therefore
statistical; the exact check is against the kernel itself on re-routed input:

1. pairwise oracle (exact): every local (token, slot) pair becomes a token of its own with top_k = 1,
   weight 1 and its expert id (padded with skipped ids to the same pair count, so the token-tile
   width BN is the same); that call's output row is the pair's bf16 y exactly (fp32(1 * y)), and
   recombining those rows in the kernel's order (ascending local expert, then pair order; fp32
   product, then fp32 add) must give the T x top_k call's output bit for bit. Each output element
   of the GEMMs depends only on its own row and weights, not on which rows share its tile, so this
   holds under any accumulator precision; it checks the routing prep (counts, scan, sorted list,
   positions, tile table), the row gather, the swiglu rows and the combine (slot weights, order,
   skipped pairs) exactly.
2. statistical (vs the float64 emulation): relative L2 over the output and per token. What the
   pairwise oracle shares with the checked call (the GEMM's expert, scale and K-block indexing,
   the quantisers) is checked here: a wrong expert, scale block, K block or gate/up half costs
   O(1) of a token (0.26-0.76 over the output, 0.5-10 on the worst token in the mutations of
   tests/test_moe_kernel_emulation.py); the hardware's accumulation costs <= 1.5% over the output
   and <= 5% on the worst token in the kernel emulation with a 13-bit accumulator (truncating
   toward zero or toward -inf), on the shapes of the H200 failure list.
"""

from __future__ import annotations

import torch

MOE_REL_L2 = 3e-2          # over the whole output
MOE_TOKEN_REL_L2 = 1e-1    # the worst token with a local pair


def expand_pairs(x: torch.Tensor, ids: torch.Tensor, num_local: int, offset: int):
    """-> (x1 [P, D], ids1 [P, 1], weights1 [P, 1], tok [n], slot [n]): the n local pairs as tokens
    (rows n.. skipped with id -1), P = T * top_k as in the original call."""
    t, k = ids.shape
    local = (ids >= offset) & (ids < offset + num_local)
    tok, slot = local.nonzero(as_tuple=True)  # pair order: token, then slot
    n = tok.numel()
    x1 = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    x1[:n] = x[tok]
    ids1 = torch.full((t * k, 1), -1, dtype=ids.dtype, device=ids.device)
    ids1[:n, 0] = ids[tok, slot]
    weights1 = torch.ones(t * k, 1, dtype=torch.float32, device=x.device)
    return x1, ids1.contiguous(), weights1, tok, slot


def recombine(y_pairs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tok: torch.Tensor,
              slot: torch.Tensor, offset: int) -> torch.Tensor:
    """out[t] = sum over t's local pairs by ascending (local expert, slot) of fp32(w * y), added in
    fp32 in that order (the kernel's combine) -> fp32 [T, D]."""
    t, k = ids.shape
    out = torch.zeros(t, y_pairs.shape[1], dtype=torch.float32, device=y_pairs.device)
    if tok.numel() == 0:
        return out
    expert = ids[tok, slot].long() - offset
    order = torch.argsort((expert * t + tok) * k + slot)  # (expert, token, slot): positions of the sorted list
    tok_o, slot_o, y_o = tok[order], slot[order], y_pairs[order]
    # rank of each pair among its token's pairs in that order: round r adds every token's r-th pair
    by_token = torch.argsort(tok_o, stable=True)
    first = torch.searchsorted(tok_o[by_token], tok_o[by_token], right=False)
    rank = torch.empty_like(tok_o)
    rank[by_token] = torch.arange(tok_o.numel(), device=tok_o.device) - first
    w = weights[tok_o, slot_o].float()
    for r in range(int(rank.max()) + 1):
        sel = rank == r
        rows = tok_o[sel]  # distinct tokens
        out[rows] = out[rows] + w[sel, None] * y_o[sel]
    return out


def describe_pairwise(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = got != want
    bad_tokens = diff.any(dim=1)
    if not bad_tokens.any():
        return "bit-exact"
    t = int(bad_tokens.nonzero()[0])
    c = int(diff[t].nonzero()[0])
    rel = ((got[t] - want[t]).norm() / want[t].norm().clamp_min(1e-30)).item()
    return (f"{int(bad_tokens.sum())} of {got.shape[0]} tokens differ ({int(diff.sum())} outputs); first "
            f"[{t}, {c}]: got {got[t, c].item():.7g} want {want[t, c].item():.7g}; token {t} rel L2 {rel:.3g}")


def statistical(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, int]:
    """-> (relative L2 over the output, worst per-token relative L2, that token) against fp64 `want`;
    tokens whose `want` is 0 are left out of the per-token figure (they must be exactly 0)."""
    err = got.double() - want
    total = (err.norm() / want.norm().clamp_min(1e-30)).item()
    norms = want.norm(dim=1)
    live = norms > 0
    if not live.any():
        return total, 0.0, -1
    per = torch.where(live, err.norm(dim=1) / norms.clamp_min(1e-30), torch.zeros_like(norms))
    worst = int(per.argmax())
    return total, per[worst].item(), worst
