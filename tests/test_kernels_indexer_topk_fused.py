"""Fused indexer logits + top-k + page translation (plugins/csrc/indexer_topk.cu, cuda_ops.indexer_topk).

Tiers, per case:
  * exact: the same set per row (indices and slots) as the two-kernel composition
    topk_translate(indexer_logits(...)), forced fused and auto; the fused scores are bitwise the
    logits kernel's, and both select ties at the k-th score by lowest position.
  * spec, exact: ref_dsa_ops.check_topk on the logits kernel's scores (k distinct in-range positions,
    every selected score >= the k-th, every larger score selected, translation exact) and the tie rule.
  * reference: the independent float64 logits (ref_dsa_ops) and the plain-torch composition
    (plugins/reference.py) agree with the selection up to the kernel's fp32 rounding: a selected
    and an unselected position can only be swapped when their float64 scores are within the
    accumulation-error bound of each other.
Runs on the H200; skips without CUDA or without the kernel library.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ref_dsa_ops as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)"),
]

DEV = "cuda"
K_DEFAULT = 2048


@pytest.fixture(scope="module")
def K():
    from dsa_trt.plugins import cuda_ops

    lib = cuda_ops.library()
    if lib is None:
        pytest.skip(cuda_ops.library_error())
    assert "indexer_topk" in lib.launchers, f"{lib.path} lacks dsa_launch_indexer_topk: stale build, `make kernels`"
    return cuda_ops


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


# ---------------------------------------------------------------- inputs
def random_e4m3(shape, g, sign=None) -> torch.Tensor:
    """Random e4m3 bytes without NaN codes; sign None = random, +1 / -1 = all positive / negative."""
    mag = torch.randint(1, 0x7F, shape, generator=g, device=DEV, dtype=torch.uint8)  # 0x7F is NaN
    if sign is None:
        s = torch.randint(0, 2, shape, generator=g, device=DEV, dtype=torch.uint8) << 7
    else:
        s = torch.full(shape, 0x80 if sign < 0 else 0, device=DEV, dtype=torch.uint8)
    return mag | s


def make_case(heads, seq_lens, max_pages, *, seed, kind="randn", per_req=1, spare_pages=37, zero_from=40000):
    """q fp8 [T, H, 128], weights [T, H], fp8 pool with pages scattered at random, page table, req_idx,
    seq_lens. `per_req` consecutive tokens share a request. kind:
      randn      random keys and q, weights of both signs (no ties in practice)
      relu_zeros q > 0, w > 0; 1% of pages hold positive keys (scores > 0), the rest negative keys
                 (score exactly 0): the k-th score is 0, tied ~100K times
      neg_then_zero  w < 0, q > 0; positions < zero_from on positive-key pages (distinct negative
                 scores), the rest negative keys (score 0): the k-th tie falls in the middle of the row
      constant   every key and q identical, w > 0: every score equal
    """
    g = gen(seed)
    T = len(seq_lens)
    batch = (T + per_req - 1) // per_req
    num_pages = batch * max_pages + spare_pages
    page_table = torch.randperm(num_pages, generator=g, device=DEV)[: batch * max_pages]
    page_table = page_table.view(batch, max_pages).to(torch.int32).contiguous()
    req_idx = (torch.arange(T, device=DEV) // per_req).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scales = torch.exp2(torch.randint(-10, -4, (num_pages, R.PAGE), generator=g, device=DEV).float())
    if kind == "randn":
        keys = random_e4m3((num_pages, R.INDEX_KEYS_BYTES), g)
        q = random_e4m3((T, heads, R.INDEX_DIM), g)
        w = torch.randn(T, heads, generator=g, device=DEV) * heads**-0.5
    elif kind in ("relu_zeros", "neg_then_zero"):
        keys = random_e4m3((num_pages, R.INDEX_KEYS_BYTES), g, sign=-1)
        positive = torch.zeros(num_pages, dtype=torch.bool, device=DEV)
        if kind == "relu_zeros":
            positive[page_table.flatten().long()] = torch.rand(batch * max_pages, generator=g, device=DEV) < 0.01
        else:
            positive[page_table[:, : zero_from // R.PAGE].flatten().long()] = True
        keys[positive] &= 0x7F
        q = random_e4m3((T, heads, R.INDEX_DIM), g, sign=+1)
        w = torch.rand(T, heads, generator=g, device=DEV) + 0.1
        if kind == "neg_then_zero":
            w = -w
    elif kind == "constant":
        keys = torch.full((num_pages, R.INDEX_KEYS_BYTES), 0x38, device=DEV, dtype=torch.uint8)  # 1.0
        scales.fill_(2.0**-6)
        q = torch.full((T, heads, R.INDEX_DIM), 0x30, device=DEV, dtype=torch.uint8)  # 0.5
        w = torch.full((T, heads), 0.25, device=DEV)
    else:
        raise ValueError(kind)
    pool = torch.cat([keys, scales.contiguous().view(torch.uint8)], dim=1).contiguous()
    q = q.view(torch.float8_e4m3fn).contiguous()
    return q, w.contiguous(), pool, page_table, req_idx, seq


def two_kernels(K, q, w, pool, pt, ri, seq, k):
    logits = K.indexer_logits(q, w, pool, pt, ri, seq)
    slots, idx = K.topk_translate(logits, seq, pt, ri, k, return_indices=True)
    return logits, slots, idx


# ---------------------------------------------------------------- checks
def assert_same_sets(name, got_slots, got_idx, want_slots, want_idx, logits, seq):
    """Row-wise equality as sorted sets; a failure names the row and what the differing positions
    score (tied with the k-th score -> tie-break; otherwise the scores or the select differ)."""
    gi, wi = got_idx.sort(dim=1).values, want_idx.sort(dim=1).values
    bad_rows = (gi != wi).any(dim=1).nonzero().flatten().tolist()
    if bad_rows:
        r = bad_rows[0]
        g_set, w_set = set(got_idx[r].tolist()), set(want_idx[r].tolist())
        extra, missing = sorted(g_set - w_set)[:5], sorted(w_set - g_set)[:5]
        n = int(seq[r])
        kth = torch.topk(logits[r, :n], min(got_idx.shape[1], n)).values[-1].item() if n > 0 else None
        raise AssertionError(
            f"{name}: {len(bad_rows)} rows differ, first row {r} (seq_len {n}): fused-only positions {extra} "
            f"(scores {[logits[r, p].item() for p in extra if 0 <= p < n]}), two-kernel-only {missing} "
            f"(scores {[logits[r, p].item() for p in missing if 0 <= p < n]}), k-th score {kth}")
    gs, ws = got_slots.sort(dim=1).values, want_slots.sort(dim=1).values
    bad = (gs != ws).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"{name}: same indices but different slots in rows {bad[:5]} (translation)"


def assert_matches_reference(name, ref_scores, ref_mag, seq, k, idx, rows):
    """A fused selection is right up to fp32 rounding when every selected position's float64 score
    plus its error bound reaches every unselected one's score minus its bound. Bound as the logits
    test: 2e-3 * sum_h |w| sum_d |q k| + 1e-6 * the row's largest such magnitude."""
    for r in rows:
        n = int(seq[r])
        if n <= k:
            continue
        s, m = ref_scores[r, :n], ref_mag[r, :n]
        tol = 2e-3 * m + 1e-6 * m.max()
        sel = torch.zeros(n, dtype=torch.bool, device=s.device)
        sel[idx[r].long()] = True
        low = (s[sel] + tol[sel]).min()
        high = (s[~sel] - tol[~sel]).max()
        assert low >= high, (
            f"{name}: row {r}: a selected position scores {float(low):.6g} (float64 + bound) below an "
            f"unselected one's {float(high):.6g} (float64 - bound)")


def float64_reference(q, w, pool, pt, ri, seq, rows):
    """float64 scores and magnitudes of the given rows; only their requests' pages are dequantised."""
    sub = torch.tensor(rows, device=DEV)
    pages = pt[ri[sub].long()].flatten().long().unique()
    remap = torch.zeros(pool.shape[0], dtype=torch.int64, device=DEV)
    remap[pages] = torch.arange(pages.numel(), device=DEV)
    kd = R.dequant_index_pool(pool[pages])
    pt_local = remap[pt.long()].to(torch.int32)  # rows of other requests map to page 0: never read
    ref = R.indexer_logits(q.float()[sub], w[sub], kd, pt_local, ri[sub], seq[sub])
    mag = R.indexer_logits(q.float()[sub], w[sub], kd, pt_local, ri[sub], seq[sub], absolute=True)
    return ref, mag


# ---------------------------------------------------------------- cases
CASES = [
    # name, heads, seq_lens, max_pages, kind, k, per_req
    ("short_rows_pad", 64, [0, 1, 100, 2047, 2048], 40, "randn", 2048, 1),
    ("just_above_k", 64, [2049, 2050, 2111, 4096 + 17], 80, "randn", 2048, 1),
    ("mixed_lengths", 64, [0, 1, 2048, 2049, 70001, 131072, 64 * 33 + 17, 100000], 2048, "randn", 2048, 1),
    ("ragged_h32", 32, [5000, 3000, 64 * 33 + 17, 2049, 0, 6400], 100, "randn", 2048, 1),
    ("shared_requests_causal", 64, [9000 + i for i in range(6)], 150, "randn", 2048, 3),
    ("real_128k_b8", 64, [131072] * 7 + [131072 - 77], 2048, "randn", 2048, 1),
    ("relu_zeros_ties", 64, [131072, 65536, 20000], 2048, "relu_zeros", 2048, 1),
    ("tie_in_mid_row", 64, [131072, 100000], 2048, "neg_then_zero", 2048, 1),
    ("constant_scores", 64, [131072, 9000, 4097], 2048, "constant", 2048, 1),
    ("k1", 64, [3000, 1, 0, 2], 47, "randn", 1, 1),
    ("k7_ties_h32", 32, [3000, 3000, 7], 47, "relu_zeros", 7, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_equals_two_kernels(K, case):
    name, heads, seq_lens, max_pages, kind, k, per_req = case
    q, w, pool, pt, ri, seq = make_case(heads, seq_lens, max_pages, seed=11, kind=kind, per_req=per_req)
    logits, want_slots, want_idx = two_kernels(K, q, w, pool, pt, ri, seq, k)
    for path in ("fused", "auto"):
        slots, idx = K.indexer_topk(q, w, pool, pt, ri, seq, k, indices=True, path=path)
        plan = K.indexer_topk_plan(q, w, pool, pt, ri, seq, k, path=path)
        assert_same_sets(f"{name} [{path}: {plan}]", slots, idx, want_slots, want_idx, logits, seq)
    # spec, on the logits kernel's scores (bitwise the fused ones)
    R.check_topk(logits, seq, pt, ri, k, slots, idx)
    R.check_tie_rule(name, logits, seq, k, idx)
    # determinism: a rerun gives the same arrays, not only the same sets
    slots2, idx2 = K.indexer_topk(q, w, pool, pt, ri, seq, k, indices=True, path="fused")
    slots3, idx3 = K.indexer_topk(q, w, pool, pt, ri, seq, k, indices=True, path="fused")
    assert torch.equal(slots2, slots3) and torch.equal(idx2, idx3), f"{name}: fused rerun differs"
    # the no-indices call gives the same slots
    assert torch.equal(K.indexer_topk(q, w, pool, pt, ri, seq, k, path="fused"), slots2), f"{name}: slots-only differs"


REFERENCE_CASES = [c for c in CASES if c[0] in ("just_above_k", "mixed_lengths", "ragged_h32", "relu_zeros_ties",
                                                  "shared_requests_causal")]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=[c[0] for c in REFERENCE_CASES])
def test_fused_against_references(K, case):
    """The independent float64 reference and the plain-torch composition (plugins/reference.py)."""
    from dsa_trt.plugins import reference as plain

    name, heads, seq_lens, max_pages, kind, k, per_req = case
    q, w, pool, pt, ri, seq = make_case(heads, seq_lens, max_pages, seed=12, kind=kind, per_req=per_req)
    slots, idx = K.indexer_topk(q, w, pool, pt, ri, seq, k, indices=True, path="fused")
    rows = list(range(len(seq_lens)))
    ref, mag = float64_reference(q, w, pool, pt, ri, seq, rows)
    assert_matches_reference(f"{name} vs float64", ref, mag, seq, k, idx, rows)

    plain_logits = plain.indexer_logits(q, w, pool, pt, ri, seq)
    p_slots, p_idx = plain.topk_translate(plain_logits, seq, pt, ri, k)
    for r in rows:
        n = int(seq[r])
        got, want = set(idx[r].tolist()), set(p_idx[r].tolist())
        if n <= k:
            assert got == want, f"{name}: row {r} (seq_len {n} <= k): {sorted(got ^ want)[:5]} differ from reference"
            continue
        # A position only one of them selects scores (float64) within tol[p] + max tol of the k-th:
        # each selection's k-th fp32 score is within max tol of the float64 k-th, and p is on
        # opposite sides of the two (the plain fp32 einsum errs far less than the tensor core).
        kth = torch.topk(ref[r, :n], k).values[-1]
        tol = 2e-3 * mag[r, :n] + 1e-6 * mag[r, :n].max()
        for p in got ^ want:
            assert abs(float(ref[r, p] - kth)) <= float(tol[p] + tol.max()), (
                f"{name}: row {r}: position {p} selected by only one of fused / plugins.reference, float64 score "
                f"{float(ref[r, p]):.6g} is not within the bound of the k-th {float(kth):.6g}")
        common = torch.isin(p_idx[r], idx[r])  # the same positions translate to the same slots
        ours = dict(zip(idx[r].tolist(), slots[r].tolist()))
        theirs = [(int(i), int(s)) for i, s in zip(p_idx[r][common].tolist(), p_slots[r][common].tolist())]
        wrong = [(i, s, ours[i]) for i, s in theirs if ours[i] != s]
        assert not wrong, f"{name}: row {r}: (position, reference slot, fused slot) differ: {wrong[:5]}"


# every fused shape the kernel has (those that fit this problem), against the two kernels
SHAPES = [(1, 4), (2, 4), (4, 4), (8, 4), (16, 4), (2, 2), (4, 2), (8, 2), (16, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"c{c}w{w}" for c, w in SHAPES])
def test_fused_shapes(K, shape):
    cluster, wgs = shape
    max_pages = 200  # 12800 positions: small enough for one CTA (cluster 1) to hold a token's keys
    seq_lens = [12800, 2049, 12345, 0, 12799, 4096, 64 * 77 + 5]
    q, w, pool, pt, ri, seq = make_case(64, seq_lens, max_pages, seed=13, kind="randn")
    logits, want_slots, want_idx = two_kernels(K, q, w, pool, pt, ri, seq, K_DEFAULT)
    plan = K.indexer_topk_plan(q, w, pool, pt, ri, seq, K_DEFAULT, path="fused", cluster_size=cluster, warpgroups=wgs)
    assert plan.startswith("fused") and f"cluster={cluster} warpgroups={wgs}" in plan, plan
    slots, idx = K.indexer_topk(q, w, pool, pt, ri, seq, K_DEFAULT, indices=True, path="fused", cluster_size=cluster,
                                warpgroups=wgs)
    assert_same_sets(f"cluster={cluster} warpgroups={wgs}", slots, idx, want_slots, want_idx, logits, seq)
    # ties with this shape: the k-th tie falls inside some CTA's slice (which one depends on the cluster)
    for kind, seed in (("relu_zeros", 14), ("neg_then_zero", 15)):
        q, w, pool, pt, ri, seq = make_case(64, [12800, 9000], max_pages, seed=seed, kind=kind, zero_from=5056)
        logits, want_slots, want_idx = two_kernels(K, q, w, pool, pt, ri, seq, K_DEFAULT)
        slots, idx = K.indexer_topk(q, w, pool, pt, ri, seq, K_DEFAULT, indices=True, path="fused",
                                    cluster_size=cluster, warpgroups=wgs)
        label = f"{kind} cluster={cluster} warpgroups={wgs}"
        assert_same_sets(label, slots, idx, want_slots, want_idx, logits, seq)
        R.check_tie_rule(label, logits, seq, K_DEFAULT, idx)


def test_h200_target_shape(K):
    """B = 32 query tokens at 128K, H = 64, k = 2048 (the benchmark's target case): every path agrees."""
    q, w, pool, pt, ri, seq = make_case(64, [131072] * 32, 2048, seed=15, kind="randn")
    logits, want_slots, want_idx = two_kernels(K, q, w, pool, pt, ri, seq, K_DEFAULT)
    for path in ("auto", "fused", "unfused"):
        slots, idx = K.indexer_topk(q, w, pool, pt, ri, seq, K_DEFAULT, indices=True, path=path)
        plan = K.indexer_topk_plan(q, w, pool, pt, ri, seq, K_DEFAULT, path=path)
        assert_same_sets(f"B=32 128K [{path}: {plan}]", slots, idx, want_slots, want_idx, logits, seq)
    R.check_topk(logits[:4], seq[:4], pt, ri[:4], K_DEFAULT, slots[:4], idx[:4])
    ref, mag = float64_reference(q, w, pool, pt, ri, seq, [0, 31])
    assert_matches_reference("B=32 128K vs float64", ref, mag, seq[[0, 31]], K_DEFAULT, idx[[0, 31]], [0, 1])


def test_bf16_pool_takes_the_two_kernels(K):
    g = gen(16)
    T, heads, max_pages = 3, 64, 60
    num_pages = T * max_pages + 3
    keys = torch.randn(num_pages, 64, 128, generator=g, device=DEV).to(torch.bfloat16)
    q = torch.randn(T, heads, 128, generator=g, device=DEV).to(torch.bfloat16)
    w = torch.randn(T, heads, generator=g, device=DEV)
    pt = torch.randperm(num_pages, generator=g, device=DEV)[: T * max_pages].view(T, max_pages).to(torch.int32)
    ri = torch.arange(T, device=DEV, dtype=torch.int32)
    seq = torch.tensor([3000, 2048, 3840], device=DEV, dtype=torch.int32)
    logits, want_slots, want_idx = two_kernels(K, q, w, keys, pt, ri, seq, K_DEFAULT)
    slots, idx = K.indexer_topk(q, w, keys, pt, ri, seq, K_DEFAULT, indices=True)
    assert "unfused" in K.indexer_topk_plan(q, w, keys, pt, ri, seq, K_DEFAULT)
    assert_same_sets("bf16 pool", slots, idx, want_slots, want_idx, logits, seq)
    with pytest.raises(RuntimeError, match="fused path needs the fp8 indexer pool"):
        K.indexer_topk(q, w, keys, pt, ri, seq, K_DEFAULT, path="fused")


def test_errors_name_the_bad_value(K):
    q, w, pool, pt, ri, seq = make_case(64, [5000, 3000], 100, seed=17)
    with pytest.raises(NotImplementedError, match="num_heads=48"):  # the launcher's DSA_ERR_UNSUPPORTED
        K.indexer_topk(q[:, :48].contiguous(), w[:, :48].contiguous(), pool, pt, ri, seq, K_DEFAULT)
    with pytest.raises(ValueError, match="path='fast'"):
        K.indexer_topk(q, w, pool, pt, ri, seq, K_DEFAULT, path="fast")
    with pytest.raises(ValueError, match="seq_lens dtype torch.int64"):
        K.indexer_topk(q, w, pool, pt, ri, seq.long(), K_DEFAULT)
    q_strided = torch.zeros(*q.shape[:2], 2 * R.INDEX_DIM, dtype=q.dtype, device=DEV)[..., : R.INDEX_DIM]
    with pytest.raises(ValueError, match="q must be contiguous"):
        K.indexer_topk(q_strided, w, pool, pt, ri, seq, K_DEFAULT)
    with pytest.raises(RuntimeError, match="cluster_size=3"):
        K.indexer_topk(q, w, pool, pt, ri, seq, K_DEFAULT, cluster_size=3)
    # a 128K token's keys (512 KB) do not fit one CTA: the forced shape is refused with the reason
    q, w, pool, pt, ri, seq = make_case(64, [131072], 2048, seed=18)
    with pytest.raises(RuntimeError, match="shared memory"):
        K.indexer_topk(q, w, pool, pt, ri, seq, K_DEFAULT, path="fused", cluster_size=1)


def test_workspace_sizes(K):
    lib = K.library()
    logits_bytes = 32 * 2048 * 64 * 4
    assert lib.indexer_topk_workspace_size(32, 64, 2048, 2048, K.CACHE_FP8, 1) == 0  # fused: none
    assert lib.indexer_topk_workspace_size(32, 64, 2048, 2048, K.CACHE_FP8, 2) >= logits_bytes  # unfused: the logits
    assert lib.indexer_topk_workspace_size(32, 64, 2048, 2048, K.CACHE_BF16, 0) >= logits_bytes  # bf16: always unfused
    auto = lib.indexer_topk_workspace_size(32, 64, 2048, 2048, K.CACHE_FP8, 0)
    assert auto == 0 or auto >= 2048 * 64 * 4, auto  # some token count's logits, or none


# ---------------------------------------------------------------- topk_translate: the tie rule it now shares
def test_topk_translate_ties_independent_of_batch(K):
    """The k-th tie goes to the lowest positions whatever cluster shape the batch size picks, so a row's
    selection does not depend on the other rows (it did before the shared select: (CTA, thread) order)."""
    g = gen(19)
    width, k = 131072, 2048
    row = (torch.randint(0, 5, (width,), generator=g, device=DEV).float() * 0.5 - 1.0)  # 5 levels: massive ties
    pt = torch.randperm(128 * width // 64, generator=g, device=DEV).view(128, -1).to(torch.int32)
    results = []
    for rows in (1, 8, 128):
        logits = row.expand(rows, width).contiguous()
        lengths = torch.full((rows,), width, dtype=torch.int32, device=DEV)
        ri = torch.zeros(rows, dtype=torch.int32, device=DEV)
        slots, idx = K.topk_translate(logits, lengths, pt, ri, k, return_indices=True)
        R.check_tie_rule(f"topk_translate rows={rows}", logits, lengths, k, idx)
        results.append(idx[0].sort().values)
    assert all(torch.equal(results[0], r) for r in results[1:]), "topk_translate selection depends on the batch size"
