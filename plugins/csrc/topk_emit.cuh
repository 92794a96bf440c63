// DSA-TRT kernels: the last steps of the cluster top-k (topk_select.cuh), shared by the full and
// the sampled select: the candidates' offsets over the cluster, the local select on all of the
// row's candidates with the marking of this CTA's positions, and the emit (counts, then the
// positions in order, translated to cache slots).
#pragma once

#include "topk_common.cuh"

namespace dsa_topk {

// After the cluster barrier that publishes every CTA's x.ncand: x.cand_start[r] = the candidates
// of the CTAs before r, and the row's total (returned). Block-wide.
template <int kThreads>
__device__ __forceinline__ uint32_t candidate_offsets(const int C, SelectScratch<kThreads>& x) {
  const int tid = threadIdx.x;
  if (tid < 32) {
    const uint32_t n = tid < C ? ld_cluster_u32(cluster_addr(&x.ncand, tid)) : 0u;
    const uint32_t incl = warp_inclusive_scan(n);
    if (tid <= C && tid <= kMaxClusterSlots) x.cand_start[tid] = incl - n;  // tid == C: the total
  }
  __syncthreads();
  return x.cand_start[C];
}

// Every CTA loads all `total` (<= kCandCap) candidates of the row from DSMEM into registers,
// finishes the radix select on them locally (keys matching `prefix` at `shift`, k_rem of them
// still to take; the same result in every CTA) and marks its own positions: above the threshold
// -> selected, equal -> tied. Returns the tied keys to take, lowest positions first.
// guess (shift 32 only; -1: none): a likely first digit (key >> 21) of the threshold, e.g. from a
// sample. Checked by one count: when fewer than k_rem candidates have a higher first digit and at
// least k_rem have this one or higher, it is the threshold's, and the first radix pass is skipped.
template <int kThreads>
__device__ __forceinline__ uint32_t candidate_select_mark(const SelectSmem<kThreads>& s, const int C, const int start,
                                                          const int n_local, const uint32_t total, uint32_t prefix,
                                                          int shift, uint32_t k_rem, uint32_t* sel_bits,
                                                          uint32_t* tie_bits, const int guess = -1) {
  SelectScratch<kThreads>& x = *s.x;
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kPer = kCandCap / kThreads;
  uint32_t ck[kPer];
  int cp[kPer];
  // Candidate g lives in CTA r, the last with cand_start[r] <= g: a branch-free binary search
  // per candidate, so the kPer searches overlap (the linear search it replaced was one dependent
  // shared load per CTA passed, per candidate in turn); only the remote load is predicated.
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const uint32_t g = (uint32_t)(tid + j * kThreads);
    int r = 0;
#pragma unroll
    for (int step = kMaxClusterSlots / 2; step > 0; step >>= 1)
      if (r + step < C && x.cand_start[r + step] <= g) r += step;
    ck[j] = 0;
    cp[j] = -1;
    if (g < total) {
      const uint2 c = ld_cluster_v2(cluster_addr(s.cand + (g - x.cand_start[r]), r));
      ck[j] = c.x;
      cp[j] = (int)c.y;
    }
  }
  if (shift == 32 && guess >= 0) {  // uniform
    uint32_t above = 0, at = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      above += (uint32_t)(cp[j] >= 0 && (int)(ck[j] >> 21) > guess);
      at += (uint32_t)(cp[j] >= 0 && (int)(ck[j] >> 21) == guess);
    }
    above = __reduce_add_sync(0xffffffffu, above);
    at = __reduce_add_sync(0xffffffffu, at);
    if (lane == 0) {
      x.scan[warp] = above;
      x.scan[kWarps + warp] = at;
    }
    __syncthreads();
    above = __reduce_add_sync(0xffffffffu, lane < kWarps ? x.scan[lane] : 0u);
    at = __reduce_add_sync(0xffffffffu, lane < kWarps ? x.scan[kWarps + lane] : 0u);
    if (above < k_rem && above + at >= k_rem) {  // uniform
      prefix = (uint32_t)guess;
      shift = 21;
      k_rem -= above;
    }
  }
  bool take_all = false;
  while (!take_all && shift > 0) {  // local radix passes of 11, 11, 10 bits (hist1 is local now)
    const int dshift = shift > 21 ? 21 : (shift > 10 ? 10 : 0);
    const int nb = 1 << (shift - dshift);
    for (int i = tid; i < nb; i += kThreads) s.hist1[i] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (cp[j] >= 0 && key_high(ck[j], shift) == prefix)
        red_add_shared(smem_addr(s.hist1 + ((ck[j] >> dshift) & (uint32_t)(nb - 1))), 1u);
    __syncthreads();
    local_threshold<kThreads>(s.hist1, nb, k_rem, x);
    prefix = (shift == 32 ? 0u : prefix << (shift - dshift)) | x.sel[0];
    k_rem = x.sel[1];
    take_all = x.sel[2] == k_rem;
    shift = dshift;
    __syncthreads();  // x.sel is rewritten by the next pass
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int lp = cp[j] - start;
    if (cp[j] >= 0 && lp >= 0 && lp < n_local) {
      const uint32_t hi = ck[j] >> shift;
      if (hi > prefix || (take_all && hi == prefix)) red_or_shared(smem_addr(sel_bits + lp / 32), 1u << (lp % 32));
      else if (hi == prefix) red_or_shared(smem_addr(tie_bits + lp / 32), 1u << (lp % 32));
    }
  }
  return take_all ? 0u : k_rem;
}

// The emit's counts: this thread's bitmap words [w0, w1), its offsets in the CTA, the CTA's totals,
// the totals of the CTAs before this one and (kRowTotals) of the whole row (selected, tied). Ends with cluster
// barrier (E), after which this CTA reads the other CTAs' totals (no arrive is pending after it).
struct EmitCounts {
  int w0, w1;
  uint32_t off_sel, off_tie, cta_sel, cta_tie, base_sel, base_tie, row_sel, row_tie;
};
template <int kThreads, bool kRowTotals>
__device__ __forceinline__ EmitCounts emit_counts(cg::cluster_group& cluster, const SelectSmem<kThreads>& s,
                                                  const int n_local, const int chunk) {
  SelectScratch<kThreads>& x = *s.x;
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, lane = tid & 31;
  const int nwords = (n_local + 31) / 32;
  const uint32_t* sel_bits = s.bits;
  const uint32_t* tie_bits = s.bits + select_bitmap_bytes(chunk) / 8;
  EmitCounts c;
  // thread t owns words [t * wpt, (t + 1) * wpt)
  const int wpt = (nwords + kThreads - 1) / kThreads;
  c.w0 = min(tid * wpt, nwords);
  c.w1 = min(c.w0 + wpt, nwords);
  uint32_t n_sel = 0, n_tie = 0;
  for (int w = c.w0; w < c.w1; ++w) {
    n_sel += __popc(sel_bits[w]);
    n_tie += __popc(tie_bits[w]);
  }
  block_excl_scan2<kThreads>(n_sel, n_tie, c.off_sel, c.off_tie, c.cta_sel, c.cta_tie, x.scan);
  if (tid == 0) {
    x.totals[0] = c.cta_sel;
    x.totals[1] = c.cta_tie;
  }
  cluster.sync();  // (E) every CTA's totals are published
  uint32_t ts = 0, tt = 0;  // lane r: CTA r's totals (every warp reads them), of the CTAs before this one
  if (lane < (kRowTotals ? C : rank)) {
    ts = ld_cluster_u32(cluster_addr(&x.totals[0], lane));
    tt = ld_cluster_u32(cluster_addr(&x.totals[1], lane));
  }
  if constexpr (kRowTotals) {
    c.row_sel = __reduce_add_sync(0xffffffffu, ts);
    c.row_tie = __reduce_add_sync(0xffffffffu, tt);
    ts = lane < rank ? ts : 0u;
    tt = lane < rank ? tt : 0u;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    ts += __shfl_xor_sync(0xffffffffu, ts, off);
    tt += __shfl_xor_sync(0xffffffffu, tt, off);
  }
  c.base_sel = ts;
  c.base_tie = tt;
  return c;
}

// Emit in position order: every selected bit, then the first k_ties tied bits of the row (over
// the cluster, by position), from the counts of emit_counts. Every CTA's candidates have been
// read by the other CTAs before (E).
template <int kThreads>
__device__ __forceinline__ void emit_write(const SelectSmem<kThreads>& s, const int start, const int chunk,
                                           const uint32_t k_ties, const EmitCounts& c, const RowOutput& out) {
  const int tid = threadIdx.x;
  const uint32_t* sel_bits = s.bits;
  const uint32_t* tie_bits = s.bits + select_bitmap_bytes(chunk) / 8;
  const int w0 = c.w0, w1 = c.w1;
  const uint32_t off_sel = c.off_sel, off_tie = c.off_tie, cta_sel = c.cta_sel, cta_tie = c.cta_tie;
  const uint32_t base_sel = c.base_sel, base_tie = c.base_tie;
  cluster_arrive_relaxed();  // this CTA's remote reads are done (their values summed above)
  // Positions in order into the candidate buffer (every CTA's candidates were read before (E)),
  // then translated by all threads at once (each translation is a dependent global load).
  int32_t* staged = reinterpret_cast<int32_t*>(s.cand);  // [kMaxTopk]
  const uint32_t first = base_sel + min(base_tie, k_ties);  // this CTA's first output index
  const uint32_t n_out = cta_sel + min(base_tie + cta_tie, k_ties) - min(base_tie, k_ties);
  uint32_t tie_rank = base_tie + off_tie;
  int j = (int)(base_sel + off_sel + min(tie_rank, k_ties) - first);
  for (int w = w0; w < w1; ++w) {
    uint32_t m = sel_bits[w], t = tie_bits[w];
    if (t && tie_rank < k_ties) {
      const uint32_t n = __popc(t), need = k_ties - tie_rank;
      if (n <= need) {
        m |= t;
        tie_rank += n;
      } else {
        for (uint32_t i = 0; i < need; ++i) {
          m |= t & (0u - t);  // lowest remaining tied bit
          t &= t - 1;
        }
        tie_rank = k_ties;
      }
    }
    while (m) {
      staged[j++] = start + w * 32 + (__ffs(m) - 1);
      m &= m - 1;
    }
  }
  __syncthreads();
  for (uint32_t i = tid; i < n_out; i += kThreads)
    out.put((int)(first + i), staged[i], s.pages[(staged[i] - start) / DSA_PAGE_SIZE]);
  cluster_wait();  // no CTA leaves while another may still read its shared memory
}

// The bitmaps are complete (after a block barrier): count, then write the row's output.
template <int kThreads>
__device__ __forceinline__ void emit_selected(cg::cluster_group& cluster, const SelectSmem<kThreads>& s,
                                              const int n_local, const int start, const int chunk,
                                              const uint32_t k_ties, const RowOutput& out) {
  emit_write<kThreads>(s, start, chunk, k_ties, emit_counts<kThreads, false>(cluster, s, n_local, chunk), out);
}

}  // namespace dsa_topk
