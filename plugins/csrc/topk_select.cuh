// DSA-TRT kernels: exact cluster radix top-k selection + page translation of one row, for
// topk_translate.cu (keys from fp32 logits in memory).
//
// A row of L candidates is held by a thread-block cluster of C CTAs (C = 1..16): CTA `rank` owns
// the contiguous positions [rank * chunk, rank * chunk + n_local), as order-preserving uint32 keys
// (order_key). The selected set: every key above the k-th largest key, then among the keys equal
// to it the ones at the lowest positions. It does not depend on C or on the slicing, and it is
// emitted in ascending position order, so the output is deterministic whatever the cluster shape.
//
// 1. Threshold bin. Radix passes on digits of 11, 11 and 10 bits: local shared-memory histogram
//    of the keys matching the prefix chosen so far (the first one is built by the caller while it
//    produces the keys) -> cluster barrier -> CTA r sums bin slice r of every CTA's histogram over
//    DSMEM (16-byte remote loads; no remote atomics, no hot-spot CTA) -> cluster barrier -> every
//    CTA reads the C slice totals, then the one slice holding the threshold, and picks the same
//    bin. The passes stop as soon as the threshold bin is cheap to finish: taken whole, holding
//    at most kCandCap keys, or holding one key value only (min == max over the cluster, tested
//    during the later passes' sweep: a row of 99% exact zeros stops after two passes).
// 2. One sweep over the keys (reversed, so an uncached slice is re-read from L2 in the order that
//    hits most): keys above the bin set bits of a selection bitmap; keys in the bin set bits of a
//    tie bitmap, or are taken whole, or (at most kCandCap) become candidates (key, position).
//    Per key two compares; bitmap words take predicated shared reductions.
// 3. Candidates: after a cluster barrier every CTA loads all of the row's candidates (DSMEM) into
//    registers and finishes the radix select on them locally (the same result in every CTA), then
//    marks its own positions: above the threshold -> selected, equal -> tied.
// 4. Emit: per-thread bit counts, one block scan, one exchange of the CTA totals; the tied bits
//    are taken in position order until the k - (selected) ties are placed. Output j is the j-th
//    selected position of the row.
// Slices read from global memory may first try sampled_select_emit (topk_sampled.cuh): a sample
// bounds the threshold and one read of the slice replaces pass 0 and the sweep.
// NaN and -inf are ordinary keys (order_key orders every bit pattern).
//
// Files: topk_common.cuh (keys, DSMEM, reductions, scans, the select's state), topk_emit.cuh
// (candidates and the emit, steps 3-4), topk_cluster.cuh (the full select), topk_sampled.cuh
// (the sampled select).
#pragma once

#include "topk_cluster.cuh"
#include "topk_sampled.cuh"
