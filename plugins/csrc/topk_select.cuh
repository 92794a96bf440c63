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
  uint32_t first[2];              // after pass 0: this CTA's (above, in) the threshold bin counts
  uint32_t compact[2];            // after pass 0: keys above the bin in lower ranks; 1 if all fit
  uint32_t scan[2 * (kThreads / 32)];
};

template <int kThreads>
struct SelectSmem {
  uint32_t* hist0;    // [kBins]: pass 0 (filled by the caller) and pass 2
  uint32_t* hist1;    // [kBins]: pass 1
  uint32_t* slice;    // [kBins / C]: cluster-wide counts of this CTA's bin slice
  SelectScratch<kThreads>* x;
  // Optional candidate buffer (local to the CTA, 16-byte aligned, cand_cap a multiple of 4): the
  // keys of the pass-0 threshold bin and their row positions. NULL / 0: every pass sweeps the slice.
  uint32_t* cand_key = nullptr;
  int32_t* cand_pos = nullptr;
  int cand_cap = 0;
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

// Radix-select state, the same in every thread of the cluster: keys match when
// (key >> shift) == prefix (shift 32: all keys); k_rem of them are still to take.
struct SelectState {
  uint32_t prefix = 0;
  uint32_t k_rem;
  int shift = 32;
  bool take_all = false;  // the last threshold bin was taken whole
};

// This CTA's histogram of digit `pass` over the keys of [0, n) matching the state's prefix.
template <int kThreads, class Fetch>
__device__ __forceinline__ void histogram_pass(uint32_t* hist, int pass, const SelectState& st, int n, Fetch fetch) {
  const int dshift = digit_shift(pass);
  const uint32_t dmask = digit_mask(pass);
  for (int i = threadIdx.x; i <= (int)dmask; i += kThreads) hist[i] = 0;
  __syncthreads();
  RunHist rh{hist};
  for (int v = threadIdx.x; v < (n + 3) / 4; v += kThreads) {
    const uint4 q = fetch(v);
    const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (4 * v + e < n && (kk[e] >> st.shift) == st.prefix) rh.add((kk[e] >> dshift) & dmask);
  }
  rh.flush();
}

// Given every CTA's complete histogram `hist` of digit `pass`: the cluster-wide threshold bin,
// folded into the state. Starts and ends with a cluster barrier's worth of ordering.
template <int kThreads, int kMaxCluster>
__device__ __forceinline__ void threshold_pass(cg::cluster_group& cluster, const SelectSmem<kThreads>& s,
                                               const uint32_t* hist, int pass, SelectState& st) {
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x;
  const int dshift = digit_shift(pass);
  const int nbins = (int)digit_mask(pass) + 1;
  SelectScratch<kThreads>& x = *s.x;
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
    if (tid < C && sx - tot < st.k_rem && st.k_rem <= sx) {
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
  if (tid < S / 4 && excl < st.k_rem && st.k_rem <= incl) {
    const uint32_t c4[4] = {cnt.x, cnt.y, cnt.z, cnt.w};
    uint32_t acc = excl;
#pragma unroll
    for (int j = 3; j >= 0; --j) {
      if (acc < st.k_rem && acc + c4[j] >= st.k_rem) {
        x.sel[0] = sl * S + 4 * tid + j;
        x.sel[1] = st.k_rem - acc;
        x.sel[2] = c4[j];
      }
      acc += c4[j];
    }
  }
  __syncthreads();
  const uint32_t bin = x.sel[0];
  st.k_rem = x.sel[1];
  st.prefix = (st.shift == 32 ? 0u : st.prefix << (st.shift - dshift)) | bin;
  st.shift = dshift;
  st.take_all = (x.sel[2] == st.k_rem);
  __syncthreads();  // x.sel / x.sel_* are rewritten by the next pass
}

// Output of the keys of [0, n) (this CTA's part of the row's key set K, positions pos(i) ascending
// in i, CTAs in rank order) once the select has finished: the n_want - k_rem keys of K with
// (key >> shift) > prefix go to out[j0, j0 + n_want - k_rem) in (rank, thread, element) order;
// the first k_rem keys equal to it, in position order, go to [j0 + n_want - k_rem, j0 + n_want).
template <int kThreads, class Fetch, class Pos>
__device__ __forceinline__ void emit_selected(cg::cluster_group& cluster, const SelectSmem<kThreads>& s, int n,
                                              Fetch fetch, Pos pos, const SelectState& st, uint32_t j0,
                                              uint32_t n_want, const RowOutput& out) {
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x;
  const int nvec = (n + 3) / 4;
  SelectScratch<kThreads>& x = *s.x;
  uint32_t n_gt = 0, n_eq = 0;
  for (int v = tid; v < nvec; v += kThreads) {
    const uint4 q = fetch(v);
    const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (4 * v + e < n) {
        const uint32_t hi = kk[e] >> st.shift;
        n_gt += hi > st.prefix;
        n_eq += hi == st.prefix;
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
  const uint32_t k_rem = st.k_rem;
  const uint32_t n_take_gt = j0 + n_want - k_rem;  // where the ties start
  // This CTA's tied keys are ranks [base_eq, base_eq + cta_eq) of the row's ties (positions
  // ascending across CTAs); the row takes ranks [0, k_rem).
  const uint32_t need_eq = base_eq >= k_rem ? 0u : min(k_rem - base_eq, cta_eq);
  const bool eq_all = need_eq == cta_eq;  // none or all of them: any order inside the CTA
  uint32_t j_gt = j0 + base_gt + off_gt, j_eq = n_take_gt + base_eq + off_eq;
  for (int v = tid; v < nvec; v += kThreads) {
    const uint4 q = fetch(v);
    const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (4 * v + e < n) {
        const uint32_t hi = kk[e] >> st.shift;
        if (hi > st.prefix) {
          out.put((int)j_gt++, pos(4 * v + e));
        } else if (eq_all && hi == st.prefix) {
          out.put((int)j_eq++, pos(4 * v + e));
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
          if (4 * v + e < n && (kk[e] >> st.shift) == st.prefix) {
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
          if (j < need_eq) out.put((int)(n_take_gt + base_eq + j), pos(4 * v + e));
          ++j;
        }
      }
      taken += tile_total;
    }
  }
}

// After pass 0 (state: prefix = the threshold bin b, not taken whole): when every CTA's keys in
// bin b fit its candidate buffer, one sweep of the slice writes the keys above b straight to the
// output (out[0, k - k_rem), in (rank, position) order; raw positions first, translated after the
// sweep) and copies the keys in b, in position order, into the buffer. Returns false (and does nothing) when some CTA's do not fit: the caller
// then sweeps the whole slice in every pass. Cluster-uniform.
template <int kThreads, class Fetch>
__device__ __forceinline__ bool compact_first_bin(cg::cluster_group& cluster, const SelectSmem<kThreads>& s,
                                                  int n_local, int start, Fetch fetch, const SelectState& st,
                                                  const RowOutput& out, int& n_cand) {
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x;
  SelectScratch<kThreads>& x = *s.x;
  const uint32_t bin = st.prefix;
  uint32_t above = 0;
  for (int i = tid; i < kBins; i += kThreads)
    if (i > (int)bin) above += s.hist0[i];  // this CTA's own pass-0 histogram (never overwritten yet)
  above = block_suffix_sum<kThreads>(above, x.scan);
  if (tid == 0) {
    x.first[0] = above;
    x.first[1] = s.hist0[bin];
  }
  cluster.sync();
  if (tid < 32) {
    uint32_t a = 0, fits = 1;
    if (tid < C) {
      a = ld_cluster_u32(cluster_addr(&x.first[0], tid));
      fits = ld_cluster_u32(cluster_addr(&x.first[1], tid)) <= (uint32_t)s.cand_cap;
    }
    const uint32_t below = tid < rank ? a : 0u;
    uint32_t sum = below;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const bool all_fit = __all_sync(0xffffffffu, fits != 0);
    if (tid == 0) {
      x.compact[0] = sum;
      x.compact[1] = all_fit;
    }
  }
  __syncthreads();
  if (!x.compact[1]) return false;
  const int nvec = (n_local + 3) / 4;
  uint32_t run_gt = x.compact[0], run_eq = 0;  // block-uniform
  for (int v0 = 0; v0 < nvec; v0 += kThreads) {  // tiles in position order
    const int v = v0 + tid;
    uint32_t gt_mask = 0, eq_mask = 0, n_gt = 0, n_eq = 0;
    uint4 q = make_uint4(0, 0, 0, 0);
    if (v < nvec) {
      q = fetch(v);
      const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (4 * v + e < n_local) {
          const uint32_t d = kk[e] >> kFirstShift;
          if (d > bin) {
            gt_mask |= 1u << e;
            ++n_gt;
          } else if (d == bin) {
            eq_mask |= 1u << e;
            ++n_eq;
          }
        }
      }
    }
    uint32_t off_gt, off_eq, tile_gt, tile_eq;
    block_excl_scan2<kThreads>(n_gt, n_eq, off_gt, off_eq, tile_gt, tile_eq, x.scan);
    if (gt_mask | eq_mask) {
      const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
      uint32_t jg = run_gt + off_gt, je = run_eq + off_eq;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int p = start + 4 * v + e;
        if (gt_mask & (1u << e)) out.slots[jg++] = p;  // the raw position; translated below
        if (eq_mask & (1u << e)) {
          s.cand_key[je] = kk[e];
          s.cand_pos[je] = p;
          ++je;
        }
      }
    }
    run_gt += tile_gt;
    run_eq += tile_eq;
  }
  n_cand = (int)run_eq;
  __syncthreads();  // the buffer is complete, and this CTA's raw positions in out.slots are visible
  // Translation apart from the sweep: no table load (and its latency) inside the barrier-bound tiles.
  for (uint32_t j = x.compact[0] + tid; j < run_gt; j += kThreads) out.put((int)j, out.slots[j]);
  return true;
}

// The k (< L, the row's candidate count) largest keys of the row -> out. Called by every thread
// of every CTA of the cluster. On entry s.hist0 holds this CTA's histogram of key >> 21 over its
// n_local keys, complete (the first cluster barrier below also orders the caller's writes of the
// keys and of hist0). fetch(v) returns the keys of local positions [4v, 4v + 4) (elements at or
// past n_local are ignored). kMaxCluster bounds C (the remote loads in flight per thread).
// With a candidate buffer (SelectSmem::cand_*), passes 1-2 and the output of the threshold bin
// run on the buffer alone whenever it holds every CTA's part of that bin (compact_first_bin).
template <int kThreads, int kMaxCluster, class Fetch>
__device__ __forceinline__ void cluster_select_emit(cg::cluster_group& cluster, const SelectSmem<kThreads> s,
                                                    const int n_local, const int start, const int k,
                                                    Fetch fetch, const RowOutput& out) {
  SelectState st;
  st.k_rem = (uint32_t)k;
  threshold_pass<kThreads, kMaxCluster>(cluster, s, s.hist0, 0, st);
  int n_cand = 0;
  if (!st.take_all && s.cand_cap > 0 && compact_first_bin<kThreads>(cluster, s, n_local, start, fetch, st, out, n_cand)) {
    const uint32_t k_first = (uint32_t)k - st.k_rem, n_want = st.k_rem;  // keys above the bin are out
    const uint4* cand4 = reinterpret_cast<const uint4*>(s.cand_key);
    auto fetch_cand = [&](int v) { return cand4[v]; };
    for (int pass = 1; pass < kPasses && !st.take_all; ++pass) {
      uint32_t* hist = (pass & 1) ? s.hist1 : s.hist0;  // others last read it before two barriers
      histogram_pass<kThreads>(hist, pass, st, n_cand, fetch_cand);
      threshold_pass<kThreads, kMaxCluster>(cluster, s, hist, pass, st);
    }
    emit_selected<kThreads>(cluster, s, n_cand, fetch_cand, [&](int i) { return (int)s.cand_pos[i]; }, st, k_first,
                            n_want, out);
  } else {
    for (int pass = 1; pass < kPasses && !st.take_all; ++pass) {
      uint32_t* hist = (pass & 1) ? s.hist1 : s.hist0;  // others last read it two passes ago, before two barriers
      histogram_pass<kThreads>(hist, pass, st, n_local, fetch);
      threshold_pass<kThreads, kMaxCluster>(cluster, s, hist, pass, st);
    }
    emit_selected<kThreads>(cluster, s, n_local, fetch, [&](int i) { return start + i; }, st, 0u, (uint32_t)k, out);
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
}

}  // namespace dsa_topk
