// DSA-TRT kernels: the full cluster radix select of one row (topk_select.cuh, steps 1-4):
// cluster_select_emit.
#pragma once

#include "topk_emit.cuh"

namespace dsa_topk {

// The k (< L, the row's candidate count) largest keys of the row -> out, in ascending position
// order. Called by every thread of every CTA of the cluster. On entry s.hist0 holds this CTA's
// histogram of key >> 21 over its n_local keys, complete (the first cluster barrier below also
// orders the caller's writes of the keys and of hist0); s.bits, s.cand and s.x are this
// function's. fetch(v) returns the keys of local positions [4v, 4v + 4) for v < ceil(n_local / 4)
// (elements at or past n_local are ignored); start = rank * chunk is the slice's first position
// (chunk a multiple of 64); s.pages must be complete before the function's last barrier.
// kMaxCluster bounds C (the remote loads in flight per thread).
template <int kThreads, int kMaxCluster, class Fetch>
__device__ __forceinline__ void cluster_select_emit(cg::cluster_group& cluster, const SelectSmem<kThreads> s,
                                                    const int n_local, const int start, const int chunk,
                                                    const int k, Fetch fetch, const RowOutput& out) {
  static_assert(kMaxCluster <= kMaxClusterSlots, "cand_start holds kMaxClusterSlots CTAs");
  static_assert(kCandCap % kThreads == 0 && kBins % kThreads == 0, "per-thread candidate / bin counts");
  constexpr int kWarps = kThreads / 32;
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nvec = (n_local + 3) / 4;
  const int nwords = (n_local + 31) / 32;
  uint32_t* sel_bits = s.bits;
  uint32_t* tie_bits = s.bits + select_bitmap_bytes(chunk) / 8;
  SelectScratch<kThreads>& x = *s.x;
  for (int i = tid; i < nwords; i += kThreads) {
    sel_bits[i] = 0;
    tie_bits[i] = 0;
  }
  if (tid == 0) x.ncand = 0;

  // ---- 1. threshold bin
  uint32_t prefix = 0;      // digits chosen so far
  uint32_t k_rem = k;       // how many still to take among keys matching the prefix
  uint32_t count = 0;       // cluster-wide keys matching the prefix
  int shift = 32;           // keys match when (key >> shift) == prefix (shift 32: all keys)
  bool take_all = false;    // the threshold bin is taken whole
  for (int pass = 0; pass < kPasses; ++pass) {
    const int dshift = digit_shift(pass);
    const uint32_t dmask = digit_mask(pass);
    const int nbins = (int)dmask + 1;
    uint32_t* hist = (pass & 1) ? s.hist1 : s.hist0;  // others last read it two passes ago, before two barriers
    if (pass > 0) {
      for (int i = tid; i < nbins; i += kThreads) hist[i] = 0;
      if (tid == 0) {
        x.kmin = 0xFFFFFFFFu;
        x.kmax = 0u;
      }
      __syncthreads();
      RunHist rh{hist};
      uint32_t kmin = 0xFFFFFFFFu, kmax = 0u;
      // kLoads vectors in flight per thread: one at a time, this pass over an uncached slice is a
      // chain of dependent loads (slow on indexer-score rows whose first-digit bin holds more than
      // kCandCap keys); 4 spill at topk_translate's 64 registers.
      constexpr int kLoads = 2;
      for (int v0 = tid; v0 < nvec; v0 += kLoads * kThreads) {
        uint4 q[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) q[u] = fetch(min(v0 + u * kThreads, nvec - 1));  // clamped: a valid load
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int v = v0 + u * kThreads;
          const uint32_t kk[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (v < nvec && 4 * v + e < n_local && (kk[e] >> shift) == prefix) {
              rh.add((kk[e] >> dshift) & dmask);
              kmin = min(kmin, kk[e]);
              kmax = max(kmax, kk[e]);
            }
          }
        }
      }
      rh.flush();
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        kmin = min(kmin, __shfl_xor_sync(0xffffffffu, kmin, off));
        kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, off));
      }
      if (lane == 0) {
        atomicMin(&x.kmin, kmin);
        atomicMax(&x.kmax, kmax);
      }
    }
    cluster.sync();  // (A) every CTA's histogram (and min / max) of this pass is complete

    if (pass > 0) {  // one key value in the previous bin: its ties are taken by position
      if (tid < 32) {
        uint32_t mn = 0xFFFFFFFFu, mx = 0u;
        if (tid < C) {
          mn = ld_cluster_u32(cluster_addr(&x.kmin, tid));
          mx = ld_cluster_u32(cluster_addr(&x.kmax, tid));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, off));
          mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        }
        if (tid == 0) {
          x.ident[0] = mn == mx;
          x.ident[1] = mn;
        }
      }
      __syncthreads();
      if (x.ident[0]) {  // cluster-uniform
        prefix = x.ident[1];
        shift = 0;
        break;
      }
    }

    // Reduce-scatter: this CTA sums bins [rank*S, rank*S + S) over the cluster (S/4 threads,
    // C remote 16-byte loads each, up to 8 in flight). The loads are not predicated (a rank past
    // C - 1 reloads rank C - 1, not added): with `if (r0 + j < C)` around them ptxas issued them
    // four at a time, each four a DSMEM round trip.
    const int S = nbins / C;
    uint32_t part = 0;
    if (tid < S / 4) {
      const uint4* mine = reinterpret_cast<const uint4*>(hist + rank * S) + tid;
      uint4 acc = make_uint4(0, 0, 0, 0);
      constexpr int kBatch = kMaxCluster < 8 ? kMaxCluster : 8;
#pragma unroll
      for (int r0 = 0; r0 < kMaxCluster; r0 += kBatch) {
        if (r0 >= C) break;  // uniform
        uint4 v[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j)  // all remote loads of the batch in flight before the sums
          v[j] = ld_cluster_v4(cluster_addr(mine, min(r0 + j, C - 1)));
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const uint32_t on = r0 + j < C ? 0xFFFFFFFFu : 0u;
          acc.x += v[j].x & on;
          acc.y += v[j].y & on;
          acc.z += v[j].z & on;
          acc.w += v[j].w & on;
        }
      }
      reinterpret_cast<uint4*>(s.slice)[tid] = acc;
      part = acc.x + acc.y + acc.z + acc.w;
    }
    const uint32_t slice_sum = block_suffix_sum<kThreads>(part, x.scan);  // thread 0: the slice total
    if (tid == 0) x.slice_total = slice_sum;
    cluster.sync();  // (B) every slice is reduced

    // Threshold bin: the highest b with count(bins >= b) >= k_rem. First the slice (warp 0 reads
    // the C totals), then the bin inside it.
    if (tid < 32) {
      const uint32_t tot = tid < C ? ld_cluster_u32(cluster_addr(&x.slice_total, tid)) : 0u;
      const uint32_t sx = warp_inclusive_scan<true>(tot);
      if (tid < C && sx - tot < k_rem && k_rem <= sx) {
        x.sel_slice = tid;
        x.sel_above = sx - tot;
      }
    }
    __syncthreads();
    const int sl = (int)x.sel_slice;
    uint4 cnt = make_uint4(0, 0, 0, 0);
    if (tid < S / 4) cnt = ld_cluster_v4(cluster_addr(reinterpret_cast<const uint4*>(s.slice) + tid, sl));
    const uint32_t mine = cnt.x + cnt.y + cnt.z + cnt.w;
    const uint32_t incl = block_suffix_sum<kThreads>(mine, x.scan) + x.sel_above;
    const uint32_t excl = incl - mine;
    if (tid < S / 4 && excl < k_rem && k_rem <= incl) {
      const uint32_t c4[4] = {cnt.x, cnt.y, cnt.z, cnt.w};
      uint32_t acc = excl;
#pragma unroll
      for (int j = 3; j >= 0; --j) {
        if (acc < k_rem && acc + c4[j] >= k_rem) {
          x.sel[0] = sl * S + 4 * tid + j;
          x.sel[1] = k_rem - acc;
          x.sel[2] = c4[j];
        }
        acc += c4[j];
      }
    }
    __syncthreads();
    const uint32_t bin = x.sel[0];
    k_rem = x.sel[1];
    count = x.sel[2];
    prefix = (shift == 32 ? 0u : prefix << (shift - dshift)) | bin;
    shift = dshift;
    take_all = count == k_rem;
    __syncthreads();  // x.sel / x.sel_* are rewritten by the next pass
    if (take_all || count <= (uint32_t)kCandCap || shift == 0) break;
  }

  // ---- 2. one sweep: above the bin -> selected; in the bin -> taken whole, tied, or a candidate
  enum Mode { kTakeAll, kTies, kCand };
  const Mode mode = take_all ? kTakeAll : (shift == 0 ? kTies : kCand);
  const uint32_t lo = prefix << shift;                // shift <= 21 here
  const uint32_t top = lo | ((1u << shift) - 1u);     // keys in [lo, top] are in the bin
  {
    const uint32_t sel_s = smem_addr(sel_bits), tie_s = smem_addr(tie_bits);
    constexpr int kBatch = 4;  // tiles of 32 vectors in flight per warp
    const int ntiles = (nvec + 31) / 32;
    for (int t0 = ntiles - 1 - warp; t0 >= 0; t0 -= kBatch * kWarps) {  // warp-uniform
      uint4 q[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)  // clamped to a real vector (masked below): straight-line loads
        q[b] = fetch(min(max((t0 - b * kWarps) * 32 + lane, 0), nvec - 1));
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int v = (t0 - b * kWarps) * 32 + lane;
        const int nvalid = t0 - b * kWarps >= 0 ? min(max(n_local - 4 * v, 0), 4) : 0;
        const uint32_t valid = (1u << nvalid) - 1u;
        const uint32_t kk[4] = {q[b].x, q[b].y, q[b].z, q[b].w};
        uint32_t gm = 0, em = 0;  // keys above the bin / in it
#pragma unroll
        for (int e = 0; e < 4; ++e) gm |= (uint32_t)(kk[e] > top) << e;
        // gm is packed before the >= compares are issued: with both in one loop, ptxas -O3 (CUDA
        // 13.0) packed three >= predicates into gm after an unrelated edit of this function (a key
        // in the bin then counted as above it; docs/kernels.md, "Compiler constraints").
        asm volatile("" : "+r"(gm));
#pragma unroll
        for (int e = 0; e < 4; ++e) em |= (uint32_t)(kk[e] >= lo) << e;
        gm &= valid;
        em &= valid & ~gm;
        if (mode == kTakeAll) {
          gm |= em;
          em = 0;
        }
        // Vector v holds bits [4 (v % 8), 4 (v % 8) + 4) of word v / 8.
        red_or_shared_if(gm != 0, sel_s + 4 * (v >> 3), gm << (4 * (v & 7)));
        if (mode == kTies) {
          red_or_shared_if(em != 0, tie_s + 4 * (v >> 3), em << (4 * (v & 7)));
        } else if (em) {  // candidates: one shared atomic per thread
          uint32_t slot = atomicAdd(&x.ncand, (uint32_t)__popc(em));
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (em & (1u << e)) s.cand[slot++] = make_uint2(kk[e], (uint32_t)(start + 4 * v + e));
        }
      }
    }
  }

  // ---- 3. candidates: every CTA finishes the select on all of them, marks its own positions
  uint32_t k_ties = take_all ? 0u : k_rem;  // tied keys to take, lowest positions first
  if (mode == kCand) {
    cluster.sync();  // (C) every CTA's candidates are written
    const uint32_t total = candidate_offsets<kThreads>(C, x);  // == count <= kCandCap
    k_ties = candidate_select_mark<kThreads>(s, C, start, n_local, total, prefix, shift, k_rem, sel_bits, tie_bits);
  }
  __syncthreads();  // the bitmaps are complete
  emit_selected<kThreads>(cluster, s, n_local, start, chunk, k_ties, out);
}

}  // namespace dsa_topk
