// DSA-TRT kernels: exact cluster radix top-k selection + page translation of one row, shared by
// topk_translate.cu (keys from fp32 logits in memory) and indexer_topk.cu (keys scored in place).
//
// A row of L candidates is held by a thread-block cluster of C CTAs (C = 1..16): CTA `rank` owns
// the contiguous positions [start, start + n_local) (the CTAs' slices in rank order), as order-
// preserving uint32 keys (order_key). Radix select on digits of 11, 11 and 10 bits. Each pass:
// local shared-memory histogram of the candidates (keys whose higher digits equal the prefix
// chosen so far) -> cluster barrier -> CTA r sums bin slice r of every CTA's histogram over
// DSMEM (16-byte remote loads; no remote atomics and no hot-spot CTA: a first version that
// reduced into rank 0 with remote atomics spent ~80 us in DSMEM traffic at 64 rows) -> cluster
// barrier -> every CTA reads the C slice totals, then the one slice holding the threshold, and
// picks the same threshold bin. The select stops early when the threshold bin is taken whole.
// The first pass's histogram is built by the caller while it produces the keys.
//
// Output, deterministic and independent of C and of the slicing: every key above the k-th
// largest key, then among the keys equal to it the ones at the lowest positions (order by key
// descending, then position ascending; take the first k). Keys above the threshold are placed by
// block-wide and cluster-wide prefix sums in (CTA, thread, element) order; tied keys are taken
// whole per CTA, except in the one CTA where the k-th tie falls, which takes its first ones in
// position order (a block scan per tile of kThreads * 4 keys). So two kernels with bitwise-equal
// scores select the same set whatever their cluster shapes.
//
// Ties: a thread counts runs of equal digits and issues one shared atomic per run, so a row of
// 99% zeros costs about what a random row costs. -inf and NaN are ordinary keys.
#pragma once

#include <cooperative_groups.h>
#include <stdint.h>

#include "common.cuh"

namespace dsa_topk {

namespace cg = cooperative_groups;

constexpr int kBins = 2048;  // 11-bit digits (the last pass uses 1024)
constexpr int kPasses = 3;
// Pass p looks at key bits [digit_shift(p), digit_shift(p) + digit_bits(p)).
__host__ __device__ constexpr int digit_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }
__host__ __device__ constexpr uint32_t digit_mask(int pass) { return pass == 2 ? 0x3FFu : 0x7FFu; }
constexpr int kFirstShift = digit_shift(0);  // the caller's pass-0 histogram: hist[key >> 21]
// A CTA's reduce-scatter gives one 16-byte bin group per thread: kThreads * 4 * C >= kBins.
constexpr int kMinThreadsTimesCluster = kBins / 4;

__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Distributed shared memory with 32-bit shared::cluster addresses (mapa), cheaper in registers
// than the 64-bit generic pointers of cg::map_shared_rank. The loads clobber memory: they stay
// after the cluster barrier that makes the remote data visible.
__device__ __forceinline__ uint32_t cluster_addr(const void* local_smem, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(local_smem))), "r"(rank));
  return remote;
}
__device__ __forceinline__ uint32_t ld_cluster_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_cluster_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// One shared atomic per run of equal digits in a thread's sequence (massive ties -> few atomics).
struct RunHist {
  uint32_t* h;
  uint32_t digit = 0xFFFFFFFFu, count = 0;
  __device__ __forceinline__ void add(uint32_t d) {
    if (d == digit) {
      ++count;
    } else {
      if (count) atomicAdd(h + digit, count);
      digit = d;
      count = 1;
    }
  }
  __device__ __forceinline__ void flush() {
    if (count) atomicAdd(h + digit, count);
    count = 0;
  }
};

// Inclusive suffix sum over the block (thread t gets sum of s over threads >= t).
template <int kThreads>
__device__ __forceinline__ uint32_t block_suffix_sum(uint32_t s, uint32_t* buf) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = s;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t v = __shfl_down_sync(0xffffffffu, x, off);
    if (lane + off < 32) x += v;
  }
  if (lane == 0) buf[warp] = x;
  __syncthreads();
  for (int w = warp + 1; w < kWarps; ++w) x += buf[w];
  __syncthreads();
  return x;
}

// Exclusive prefix sums of two counters over the block, plus the block totals.
template <int kThreads>
__device__ __forceinline__ void block_excl_scan2(uint32_t a, uint32_t b, uint32_t& ea, uint32_t& eb,
                                                 uint32_t& ta, uint32_t& tb, uint32_t* buf) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = a, y = b;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t vx = __shfl_up_sync(0xffffffffu, x, off);
    const uint32_t vy = __shfl_up_sync(0xffffffffu, y, off);
    if (lane >= off) {
      x += vx;
      y += vy;
    }
  }
  if (lane == 31) {
    buf[warp] = x;
    buf[kWarps + warp] = y;
  }
  __syncthreads();
  uint32_t px = 0, py = 0, sx = 0, sy = 0;
  for (int w = 0; w < kWarps; ++w) {
    const uint32_t bx = buf[w], by = buf[kWarps + w];
    if (w < warp) {
      px += bx;
      py += by;
    }
    sx += bx;
    sy += by;
  }
  ea = px + x - a;
  eb = py + y - b;
  ta = sx;
  tb = sy;
  __syncthreads();
}

// The select's small shared state. Every CTA of the cluster keeps it (and the arrays of
// SelectSmem) at the same shared-memory offset: remote CTAs are read at it (cluster_addr).
template <int kThreads>
struct SelectScratch {
  uint32_t slice_total;           // sum of this CTA's reduced bin slice
  uint32_t sel_slice, sel_above;  // slice holding the threshold; count in the slices above it
  uint32_t sel[3];                // threshold search result: bin, k_rem, bin count
  uint32_t totals[2];             // this CTA's (> threshold, == threshold) counts
  uint32_t scan[2 * (kThreads / 32)];
};

template <int kThreads>
struct SelectSmem {
  uint32_t* hist0;    // [kBins]: pass 0 (filled by the caller) and pass 2
  uint32_t* hist1;    // [kBins]: pass 1
  uint32_t* slice;    // [kBins / C]: cluster-wide counts of this CTA's bin slice
  SelectScratch<kThreads>* x;
};

// Where a row's selection goes: slots[j] = page_table[req, pos / 64] * 64 + pos % 64 (-1 for pos
// -1) and, when indices is not NULL, indices[j] = pos.
struct RowOutput {
  int32_t* slots;          // [k] of this row
  int32_t* indices;        // [k] of this row, or NULL
  const int32_t* table;    // [max_pages] page ids of the row's request
  __device__ __forceinline__ void put(int j, int pos) const {
    slots[j] = pos < 0 ? -1 : table[pos / DSA_PAGE_SIZE] * DSA_PAGE_SIZE + pos % DSA_PAGE_SIZE;
    if (indices) indices[j] = pos;
  }
  // A row with L <= k candidates takes every position 0..L-1 in order and pads with -1; the
  // caller's threads split j in [first, k) with the given stride.
  __device__ __forceinline__ void all_positions(int L, int k, int first, int stride) const {
    for (int j = first; j < k; j += stride) put(j, j < L ? j : -1);
  }
};

// The k (< L, the row's candidate count) largest keys of the row -> out. Called by every thread
// of every CTA of the cluster. On entry s.hist0 holds this CTA's histogram of key >> 21 over its
// n_local keys, complete (the first cluster barrier below also orders the caller's writes of the
// keys and of hist0). fetch(v) returns the keys of local positions [4v, 4v + 4) (elements at or
// past n_local are ignored). kMaxCluster bounds C (the remote loads in flight per thread).
template <int kThreads, int kMaxCluster, class Fetch>
__device__ __forceinline__ void cluster_select_emit(cg::cluster_group& cluster, const SelectSmem<kThreads> s,
                                                    const int n_local, const int start, const int k,
                                                    Fetch fetch, const RowOutput& out) {
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x;
  const int nvec = (n_local + 3) / 4;
  SelectScratch<kThreads>& x = *s.x;

  uint32_t prefix = 0;      // digits chosen so far
  uint32_t k_rem = k;       // how many still to take among keys matching the prefix
  int shift = 32;           // keys match when (key >> shift) == prefix (shift 32: all keys)
  bool take_all = false;    // the last threshold bin was taken whole
  for (int pass = 0; pass < kPasses && !take_all; ++pass) {
    const int dshift = digit_shift(pass);
    const uint32_t dmask = digit_mask(pass);
    const int nbins = (int)dmask + 1;
    uint32_t* hist = (pass & 1) ? s.hist1 : s.hist0;  // others last read it two passes ago, before two barriers
    if (pass > 0) {
      for (int i = tid; i < nbins; i += kThreads) hist[i] = 0;
      __syncthreads();
      RunHist rh{hist};
      for (int v = tid; v < nvec; v += kThreads) {
        const uint4 q = fetch(v);
        const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (4 * v + e < n_local && (kk[e] >> shift) == prefix) rh.add((kk[e] >> dshift) & dmask);
      }
      rh.flush();
    }
    cluster.sync();  // (A) every CTA's histogram of this pass is complete

    // Reduce-scatter: this CTA sums bins [rank*S, rank*S + S) over the cluster (S/4 threads,
    // C remote 16-byte loads each, up to 8 in flight).
    const int S = nbins / C;
    uint32_t part = 0;
    if (tid < S / 4) {
      const uint4* mine = reinterpret_cast<const uint4*>(hist + rank * S) + tid;
      uint4 acc = make_uint4(0, 0, 0, 0);
      constexpr int kBatch = kMaxCluster < 8 ? kMaxCluster : 8;
#pragma unroll
      for (int r0 = 0; r0 < kMaxCluster; r0 += kBatch) {
        uint4 v[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j)  // all remote loads of the batch in flight before the sums
          if (r0 + j < C) v[j] = ld_cluster_v4(cluster_addr(mine, r0 + j));
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (r0 + j < C) {
            acc.x += v[j].x;
            acc.y += v[j].y;
            acc.z += v[j].z;
            acc.w += v[j].w;
          }
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
      uint32_t sx = tot;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t v = __shfl_down_sync(0xffffffffu, sx, off);
        if (tid + off < 32) sx += v;
      }
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
    prefix = (shift == 32 ? 0u : prefix << (shift - dshift)) | bin;
    shift = dshift;
    take_all = (x.sel[2] == k_rem);
    __syncthreads();  // x.sel / x.sel_* are rewritten by the next pass
  }

  // Output: the k - k_rem keys with (key >> shift) > prefix go to [0, k - k_rem) in (rank,
  // thread, element) order; the first k_rem keys equal to it in position order go to
  // [k - k_rem, k).
  uint32_t n_gt = 0, n_eq = 0;
  for (int v = tid; v < nvec; v += kThreads) {
    const uint4 q = fetch(v);
    const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (4 * v + e < n_local) {
        const uint32_t hi = kk[e] >> shift;
        n_gt += hi > prefix;
        n_eq += hi == prefix;
      }
    }
  }
  uint32_t off_gt, off_eq, cta_gt, cta_eq;
  block_excl_scan2<kThreads>(n_gt, n_eq, off_gt, off_eq, cta_gt, cta_eq, x.scan);
  if (tid == 0) {
    x.totals[0] = cta_gt;
    x.totals[1] = cta_eq;
  }
  cluster.sync();
  uint32_t base_gt = 0, base_eq = 0;
  for (int r = 0; r < rank; ++r) {
    base_gt += ld_cluster_u32(cluster_addr(&x.totals[0], r));
    base_eq += ld_cluster_u32(cluster_addr(&x.totals[1], r));
  }
  const uint32_t n_take_gt = (uint32_t)k - k_rem;
  // This CTA's tied keys are ranks [base_eq, base_eq + cta_eq) of the row's ties (positions
  // ascending across CTAs); the row takes ranks [0, k_rem).
  const uint32_t need_eq = base_eq >= k_rem ? 0u : min(k_rem - base_eq, cta_eq);
  const bool eq_all = need_eq == cta_eq;  // none or all of them: any order inside the CTA
  uint32_t j_gt = base_gt + off_gt, j_eq = n_take_gt + base_eq + off_eq;
  for (int v = tid; v < nvec; v += kThreads) {
    const uint4 q = fetch(v);
    const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (4 * v + e < n_local) {
        const uint32_t hi = kk[e] >> shift;
        if (hi > prefix) {
          out.put((int)j_gt++, start + 4 * v + e);
        } else if (eq_all && hi == prefix) {
          out.put((int)j_eq++, start + 4 * v + e);
        }
      }
    }
  }
  if (!eq_all) {  // block-uniform: the k-th tie is in this CTA; take its first need_eq ties by position
    uint32_t taken = 0;  // ties in the tiles before this one (block-uniform)
    for (int v0 = 0; v0 < nvec && taken < need_eq; v0 += kThreads) {
      const int v = v0 + tid;  // tile order (v0, tid, e) is position order
      uint32_t eq_mask = 0, n_tile = 0;
      if (v < nvec) {
        const uint4 q = fetch(v);
        const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (4 * v + e < n_local && (kk[e] >> shift) == prefix) {
            eq_mask |= 1u << e;
            ++n_tile;
          }
        }
      }
      uint32_t off, unused_off, tile_total, unused_total;
      block_excl_scan2<kThreads>(n_tile, 0u, off, unused_off, tile_total, unused_total, x.scan);
      uint32_t j = taken + off;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (eq_mask & (1u << e)) {
          if (j < need_eq) out.put((int)(n_take_gt + base_eq + j), start + 4 * v + e);
          ++j;
        }
      }
      taken += tile_total;
    }
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
}

}  // namespace dsa_topk
