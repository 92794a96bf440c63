// DSA-TRT kernels: exact cluster radix top-k selection + page translation of one row, shared by
// topk_translate.cu (keys from fp32 logits in memory) and indexer_topk.cu (keys scored in place).
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
// Slices read from global memory may first try sampled_select_emit (end of this file): a sample
// bounds the threshold and one read of the slice replaces pass 0 and the sweep.
// NaN and -inf are ordinary keys (order_key orders every bit pattern).
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
// Threshold bins of at most this many keys are finished from candidates (random fp32 logits of a
// 128K row put ~2.2K keys in the pass-0 bin of the k = 2048th).
constexpr int kCandCap = 4096;
constexpr int kMaxClusterSlots = 16;

// Bytes of the select's bitmaps for a slice of `chunk` positions (selection + tie bitmaps), a
// multiple of 16 (what follows them may be read as 16-byte vectors).
__host__ __device__ constexpr int select_bitmap_bytes(int chunk) { return ((chunk + 127) / 128) * 32; }
constexpr int kCandBytes = kCandCap * 8;
// The emit stages a CTA's selected positions in the candidate buffer: k is at most this.
constexpr int kMaxTopk = kCandBytes / 4;

__device__ __forceinline__ uint32_t order_key_bits(uint32_t b) {
  return b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) | 0x80000000u);  // negative: ~b; else b | sign
}
__device__ __forceinline__ uint32_t order_key(float x) { return order_key_bits(__float_as_uint(x)); }
__device__ __forceinline__ uint4 order_keys(const uint4 b) {
  return make_uint4(order_key_bits(b.x), order_key_bits(b.y), order_key_bits(b.z), order_key_bits(b.w));
}
template <bool B>
struct BoolConst {
  static constexpr bool value = B;
};

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
__device__ __forceinline__ uint2 ld_cluster_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared::cluster.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
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

// Split cluster barrier: arrive once this CTA's remote reads are done, wait before leaving.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
// Without release: for reads whose values have been used already (nothing left to order).
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }

// Shared-memory reductions by 32-bit shared-window address: a generic pointer costs a window
// conversion (CTA id, LEA) per atomic in a cluster kernel.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void red_add_shared(uint32_t addr, uint32_t v) {
  asm volatile("red.shared.add.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// Predicated (no branch around it): adds when `on` is true.
__device__ __forceinline__ void red_add_shared_if(bool on, uint32_t addr, uint32_t v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p red.shared.add.u32 [%0], %1;\n}\n" ::"r"(addr),
               "r"(v), "r"((uint32_t)on)
               : "memory");
}
__device__ __forceinline__ void red_or_shared_if(bool on, uint32_t addr, uint32_t v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p red.shared.or.b32 [%0], %1;\n}\n" ::"r"(addr),
               "r"(v), "r"((uint32_t)on)
               : "memory");
}
__device__ __forceinline__ void red_or_shared(uint32_t addr, uint32_t v) { red_or_shared_if(true, addr, v); }

// Pass-0 histogram (shared address hist) of 4 keys of a thread, nvalid of them real. Called by
// whole warps: the lanes whose 4 keys all have lane 0's first digit add once for the warp (a
// warp of exact zeros: one atomic for 128 keys), the others add per key.
__device__ __forceinline__ void hist_add4(const uint32_t hist, const uint4 kv, const int nvalid) {
  const uint32_t d0 = kv.x >> kFirstShift, d1 = kv.y >> kFirstShift, d2 = kv.z >> kFirstShift,
                 d3 = kv.w >> kFirstShift;
  const uint32_t lead = __shfl_sync(0xffffffffu, d0, 0);
  const bool agg = nvalid == 4 && d0 == lead && d1 == lead && d2 == lead && d3 == lead;
  const uint32_t lanes = __ballot_sync(0xffffffffu, agg);
  red_add_shared_if((threadIdx.x & 31) == 0 && lanes, hist + 4 * lead, 4 * __popc(lanes));
  red_add_shared_if(!agg && nvalid > 0, hist + 4 * d0, 1u);
  red_add_shared_if(!agg && nvalid > 1, hist + 4 * d1, 1u);
  red_add_shared_if(!agg && nvalid > 2, hist + 4 * d2, 1u);
  red_add_shared_if(!agg && nvalid > 3, hist + 4 * d3, 1u);
}

// Histogram (shared address hist) of the 11-bit digits (key >> dshift) & 0x7FF of those of 4 keys
// that match `prefix` at `shift`, aggregated as hist_add4. Warp-collective.
__device__ __forceinline__ void hist_add4_matching(const uint32_t hist, const uint4 kv, const uint32_t prefix,
                                                   const int shift, const int dshift) {
  const uint32_t kk[4] = {kv.x, kv.y, kv.z, kv.w};
  bool on[4];
  uint32_t d[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    on[e] = (uint32_t)((uint64_t)kk[e] >> shift) == prefix;
    d[e] = (kk[e] >> dshift) & 0x7FFu;
  }
  const uint32_t lead = __shfl_sync(0xffffffffu, d[0], 0);
  const bool agg = on[0] && on[1] && on[2] && on[3] && d[0] == lead && d[1] == lead && d[2] == lead && d[3] == lead;
  const uint32_t lanes = __ballot_sync(0xffffffffu, agg);
  red_add_shared_if((threadIdx.x & 31) == 0 && lanes, hist + 4 * lead, 4 * __popc(lanes));
#pragma unroll
  for (int e = 0; e < 4; ++e) red_add_shared_if(!agg && on[e], hist + 4 * d[e], 1u);
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

// The inclusive sum of `value` over lanes <= this one (kSuffix: lanes >= this one). E.g. lane r < C
// holding CTA r's value (0 past C). Warp-collective.
template <bool kSuffix = false>
__device__ __forceinline__ uint32_t warp_inclusive_scan(const uint32_t value) {
  const int lane = threadIdx.x & 31;
  uint32_t incl = value;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t v = kSuffix ? __shfl_down_sync(0xffffffffu, incl, off) : __shfl_up_sync(0xffffffffu, incl, off);
    if (kSuffix ? lane + off < 32 : lane >= off) incl += v;
  }
  return incl;
}

// Inclusive suffix sum over the block (thread t gets sum of s over threads >= t).
template <int kThreads>
__device__ __forceinline__ uint32_t block_suffix_sum(uint32_t s, uint32_t* buf) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kWarps <= 32, "one warp total per lane");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = warp_inclusive_scan<true>(s);
  if (lane == 0) buf[warp] = x;
  __syncthreads();
  // the warps above this one: lane w holds warp w's total, one warp reduction (not a loop of
  // dependent shared loads, up to kWarps - 1 of them in warp 0)
  x += __reduce_add_sync(0xffffffffu, lane < kWarps && lane > warp ? buf[lane] : 0u);
  __syncthreads();
  return x;
}

// Exclusive prefix sums of two counters over the block, plus the block totals.
template <int kThreads>
__device__ __forceinline__ void block_excl_scan2(uint32_t a, uint32_t b, uint32_t& ea, uint32_t& eb,
                                                 uint32_t& ta, uint32_t& tb, uint32_t* buf) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kWarps <= 32, "one warp total per lane");
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
  const uint32_t bx = lane < kWarps ? buf[lane] : 0u, by = lane < kWarps ? buf[kWarps + lane] : 0u;  // lane w: warp w
  ea = __reduce_add_sync(0xffffffffu, lane < warp ? bx : 0u) + x - a;
  eb = __reduce_add_sync(0xffffffffu, lane < warp ? by : 0u) + y - b;
  ta = __reduce_add_sync(0xffffffffu, bx);
  tb = __reduce_add_sync(0xffffffffu, by);
  __syncthreads();
}

// The select's small shared state. Every CTA of the cluster keeps it (and the arrays of
// SelectSmem) at the same shared-memory offset: remote CTAs are read at it (cluster_addr).
template <int kThreads>
struct SelectScratch {
  uint32_t slice_total;           // sum of this CTA's reduced bin slice
  uint32_t sel_slice, sel_above;  // slice holding the threshold; count in the slices above it
  uint32_t sel[3];                // threshold search result: bin, k_rem, bin count
  uint32_t sel2;                  // the bin of a second rank (local_threshold's k2)
  uint32_t kmin, kmax;            // passes >= 1: min / max of this CTA's keys in the previous bin
  uint32_t ident[2];              // cluster-wide: (min == max, min)
  uint32_t ncand;                 // this CTA's candidates
  uint32_t cand_start[kMaxClusterSlots + 1];  // candidates of the CTAs before rank r (exclusive scan)
  uint32_t totals[2];             // this CTA's (selected, tied) bit counts
  uint32_t scan[2 * (kThreads / 32)];
};

template <int kThreads>
struct SelectSmem {
  uint32_t* hist0;     // [kBins]: pass 0 (filled by the caller) and pass 2
  uint32_t* hist1;     // [kBins]: pass 1 and the candidates' passes
  uint32_t* slice;     // [kBins / C]: cluster-wide counts of this CTA's bin slice
  uint32_t* bits;      // [select_bitmap_bytes(chunk) / 4]: selection bitmap, then tie bitmap
  uint2* cand;         // [kCandCap] (key, row position); read by the other CTAs
  const int32_t* pages;  // [ceil(chunk / 64)] page ids of the slice's positions (start is a multiple of 64)
  SelectScratch<kThreads>* x;
};

// Where a row's selection goes: slots[j] = page_table[req, pos / 64] * 64 + pos % 64 (-1 for pos
// -1) and, when indices is not NULL, indices[j] = pos.
struct RowOutput {
  int32_t* slots;          // [k] of this row
  int32_t* indices;        // [k] of this row, or NULL
  const int32_t* table;    // [max_pages] page ids of the row's request (global memory)
  __device__ __forceinline__ void put(int j, int pos, int page) const {
    slots[j] = pos < 0 ? -1 : page * DSA_PAGE_SIZE + pos % DSA_PAGE_SIZE;
    if (indices) indices[j] = pos;
  }
  // A row with L <= k candidates takes every position 0..L-1 in order and pads with -1; the
  // caller's threads split j in [first, k) with the given stride.
  __device__ __forceinline__ void all_positions(int L, int k, int first, int stride) const {
    for (int j = first; j < k; j += stride) put(j, j < L ? j : -1, j < L ? table[j / DSA_PAGE_SIZE] : 0);
  }
};

// Threshold search over a histogram held by this CTA: the highest bin b of [0, nb) with
// count(bins >= b) >= k_rem -> x.sel = (b, k_rem - count(bins > b), count(b)). Block-wide.
// k2 > 0: also x.sel2 = the highest bin with count(bins >= b) >= k2 (0 if the histogram holds fewer).
template <int kThreads>
__device__ __forceinline__ void local_threshold(const uint32_t* hist, const int nb, const uint32_t k_rem,
                                                SelectScratch<kThreads>& x, const uint32_t k2 = 0) {
  constexpr int kMaxPerThread = kBins / kThreads;
  const int per = nb / kThreads;  // nb in {1024, 2048}, kThreads in {256, 512}
  const int b0 = threadIdx.x * per;
  uint32_t c[kMaxPerThread];
  uint32_t mine = 0;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    c[j] = j < per ? hist[b0 + j] : 0u;
    mine += c[j];
  }
  const uint32_t incl = block_suffix_sum<kThreads>(mine, x.scan);
  const uint32_t excl = incl - mine;
  if (threadIdx.x == 0 && k2 > incl) x.sel2 = 0;  // (thread 0's incl: the histogram's total)
  if (k2 > 0 && excl < k2 && k2 <= incl) {
    uint32_t acc = excl;
#pragma unroll
    for (int j = kMaxPerThread - 1; j >= 0; --j) {
      if (j < per && acc < k2 && acc + c[j] >= k2) x.sel2 = b0 + j;
      acc += c[j];
    }
  }
  if (excl < k_rem && k_rem <= incl) {
    uint32_t acc = excl;
#pragma unroll
    for (int j = kMaxPerThread - 1; j >= 0; --j) {
      if (j < per && acc < k_rem && acc + c[j] >= k_rem) {
        x.sel[0] = b0 + j;
        x.sel[1] = k_rem - acc;
        x.sel[2] = c[j];
      }
      acc += c[j];
    }
  }
  __syncthreads();
}

// Keys match a prefix when key >> shift == prefix; shift 32: every key matches.
__device__ __forceinline__ uint32_t key_high(uint32_t key, int shift) {
  return (uint32_t)((uint64_t)key >> shift);
}

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
      // kLoads vectors in flight per thread (one at a time, this pass over an uncached 64K slice
      // was a chain of dependent loads: ~20 us on the rows of indexer scores whose first-digit
      // bin holds more than kCandCap keys; 4 spill at topk_translate's 64 registers).
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
        // 13.0) was seen to pack three >= predicates into gm after an unrelated edit of this
        // function (a key in the bin then counted as above it; the top-k tests caught it).
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

// ---- Sampled threshold: one full read for slices that are not cached in shared memory.
//
// The select above reads such a slice twice (the caller's pass 0, one shared atomic per key, and
// the sweep) and crowded rows a third time. Here a sample of the row decides the threshold
// region, and one read of the slice does the rest:
// 1. Every CTA stages runs of 8 vectors (128-byte lines), one per 8 * stride vectors of its slice,
//    in its bitmap area (the sample fits: stride >= 16); after a cluster barrier every CTA loads
//    the whole cluster's sample (<= kThreads * kSamplePer keys) into registers and finds its m-th
//    largest key to 22 bits, m = 1.5 k / stride (two local radix passes): T_low, the same in
//    every CTA. The first pass also finds the first digit of the sample's (k / stride)-th
//    largest key, a guess at the threshold's.
// 2. One sweep: keys >= T_low become candidates (key, position); no histogram. When the row's
//    candidates number at least k (then every key of the top k is one) and at most kCandCap, the
//    candidate step of the select finishes exactly as above, its first radix pass replaced by a
//    count when the guessed first digit is right.
// The sample is 8 keys per thread of the gather (1/32 of a 128K row over 2 or 4 CTAs; m = 96 for
// k = 2048: the candidates' count varies by ~10%, 3072 expected between k and the cap). Against
// 16 keys (1/16), H200, profiler spans: 64 / 128 x 128K 27.2 / 38.4 -> 26.0 / 36.9 us, 32 x 128K
// 24.3 -> 22.8; with the guess as well 25.3 / 35.8 and 21.8, the B=32 x 128K decode chain
// 1.172-1.177 -> 1.145-1.151 of logits-only (docs/2026-11-30-topk-one-sweep.md).
// 3. A sample whose 22-bit bin at T_low holds more keys than the cap allows, all of one value t
//    (massive ties, e.g. ReLU scores of exact zeros): the sweep marks keys > t as selected and
//    keys == t as tied, and the row is done if count(> t) < k <= count(>= t).
// Otherwise (a sample that misjudged the row) the function returns false and the caller runs the
// full select: exact either way.
constexpr int kSampleStride = 16;                 // slice vectors per sampled vector, at least
constexpr int kSampleRun = 8;                     // consecutive vectors of a sampled run
constexpr int kSamplePer = 8;                     // sampled keys per thread of the gather, at most
constexpr int kSampleEstCap = kCandCap * 7 / 8;   // candidates the sample may predict, at most

// Whether a row of L keys (cluster-uniform) may take the sampled path: k large enough for a
// stable sample quantile, 1.5 k candidates within the cap, and a row much longer than k.
__host__ __device__ constexpr bool sampled_path_possible(const int k) { return k >= 512 && 3 * k / 2 <= kSampleEstCap; }
__device__ __forceinline__ bool sampled_select_applies(const int L, const int k) {
  return sampled_path_possible(k) && L >= 16 * k;
}

// The k (< L) largest keys of the row -> out, as cluster_select_emit, or false (cluster-uniform,
// nothing written, every CTA past a cluster barrier) when the sample does not settle the row.
// s.hist0 is not used; fetch_raw(v) returns the float bits of local positions [4v, 4v + 4) (as
// fetch of cluster_select_emit, before order_key). Any cp.async of the calling thread (the slice's
// page ids) completes inside.
template <int kThreads, class FetchRaw>
__device__ __forceinline__ bool sampled_select_emit(cg::cluster_group& cluster, const SelectSmem<kThreads> s,
                                                    const int n_local, const int start, const int chunk,
                                                    const int k, FetchRaw fetch_raw, const RowOutput& out) {
  constexpr int kSampleVecs = kThreads * kSamplePer / 4;  // cluster-wide sampled vectors, at most
  constexpr int kVecsPer = kSamplePer / 4;
  const int C = (int)cluster.num_blocks();
  const int tid = threadIdx.x, lane = tid & 31;
  SelectScratch<kThreads>& x = *s.x;
  const int nvec = (n_local + 3) / 4;
  const int nvec_chunk = chunk / 4;
  const int runs_max = kSampleVecs / C / kSampleRun;
  const int stride = max(kSampleStride, (nvec_chunk + kSampleRun * runs_max - 1) / (kSampleRun * runs_max));
  const int ns = (nvec_chunk + kSampleRun * stride - 1) / (kSampleRun * stride) * kSampleRun;  // per CTA: C * ns <= kSampleVecs
  if (ns * 16 > select_bitmap_bytes(chunk)) return false;  // (uniform) the sample is staged in the bitmaps
  const uint32_t m = (uint32_t)((3 * k + 2 * stride - 1) / (2 * stride));
  uint4* samp = reinterpret_cast<uint4*>(s.bits);
  if (tid == 0) {
    x.ncand = 0;
    x.kmin = 0xFFFFFFFFu;
    x.kmax = 0u;
  }
  auto sample_vec = [&](int i) { return i / kSampleRun * (kSampleRun * stride) + i % kSampleRun; };
  auto fetch = [&](int v) { return order_keys(fetch_raw(v)); };

  // ---- 1. sample (positions past n_local as key 0, the smallest), all loads in flight at once
  if (nvec > 0) {
    uint4 q[kVecsPer];
#pragma unroll
    for (int j = 0; j < kVecsPer; ++j) q[j] = fetch(min(sample_vec(tid + j * kThreads), nvec - 1));
#pragma unroll
    for (int j = 0; j < kVecsPer; ++j) {
      const int i = tid + j * kThreads, v = sample_vec(i), e0 = 4 * v;
      if (i < ns) {
        const bool in = v < nvec;
        samp[i] = make_uint4(in && e0 < n_local ? q[j].x : 0u, in && e0 + 1 < n_local ? q[j].y : 0u,
                             in && e0 + 2 < n_local ? q[j].z : 0u, in && e0 + 3 < n_local ? q[j].w : 0u);
      }
    }
  } else {
    for (int i = tid; i < ns; i += kThreads) samp[i] = make_uint4(0u, 0u, 0u, 0u);
  }
  cluster.sync();  // (S) every CTA's sample is staged
  uint4 sk[kVecsPer];
#pragma unroll
  for (int j = 0; j < kVecsPer; ++j) {  // unpredicated remote loads (a clamped address), masked after
    const int g = tid + j * kThreads, r = g / ns;
    const uint4 q = ld_cluster_v4(cluster_addr(samp + (r < C ? g - r * ns : 0), min(r, C - 1)));
    sk[j] = r < C ? q : make_uint4(0u, 0u, 0u, 0u);
  }
  cluster_arrive();  // this CTA's remote reads of the samples are done (waited for before they are overwritten)
  // The sample's m-th largest key to 22 bits: two local passes of 11 bits (warp-aggregated: a
  // sample of massive ties would otherwise serialise on one bin).
  uint32_t prefix = 0, k_rem = m, count = 0;
  int shift = 32;
  int guess = -1;  // the first digit of the sample's (k / stride)-th largest key: the row's threshold's, likely
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    const int dshift = pass == 0 ? 21 : 10;
    for (int i = tid; i < kBins; i += kThreads) s.hist1[i] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kVecsPer; ++j) hist_add4_matching(smem_addr(s.hist1), sk[j], prefix, shift, dshift);
    __syncthreads();
    local_threshold<kThreads>(s.hist1, kBins, k_rem, x, pass == 0 ? (uint32_t)max(k / stride, 1) : 0u);
    if (pass == 0) guess = (int)x.sel2;
    prefix = (shift == 32 ? 0u : prefix << (shift - dshift)) | x.sel[0];
    k_rem = x.sel[1];
    count = x.sel[2];
    shift = dshift;
    __syncthreads();  // x.sel is rewritten by the next pass
  }
  const uint32_t t_low = prefix << shift;
  // Sampled keys >= t_low, scaled: the candidates to expect. Past the cap: one tied value, or the
  // full select (before the slice is read).
  const bool ties = (uint64_t)(m - k_rem + count) * (uint64_t)stride > (uint64_t)kSampleEstCap;
  uint32_t t_key = 0;
  if (ties) {  // cluster-uniform (every CTA holds the same sample)
    uint32_t mn = 0xFFFFFFFFu, mx = 0u;
#pragma unroll
    for (int j = 0; j < kVecsPer; ++j) {
      const uint32_t kk[4] = {sk[j].x, sk[j].y, sk[j].z, sk[j].w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if ((kk[e] >> shift) == prefix) {
          mn = min(mn, kk[e]);
          mx = max(mx, kk[e]);
        }
    }
    mn = __reduce_min_sync(0xffffffffu, mn);
    mx = __reduce_max_sync(0xffffffffu, mx);
    if (lane == 0) {
      atomicMin(&x.kmin, mn);
      atomicMax(&x.kmax, mx);
    }
    __syncthreads();
    t_key = x.kmin;
    if (t_key != x.kmax) {
      cluster_wait();  // every CTA's sample reads are done (the select rewrites the bitmaps)
      return false;
    }
  }

  // ---- 2. one sweep: visit(keys of vector v, v) for every vector of the slice, kUnroll loads in
  // flight per thread (clamped to a real vector; visit ignores v >= nvec). Copying the slice's
  // head to shared memory meanwhile (cp.async) was slower either way it was tried: issued with the
  // sample, it queued the other CTAs' samples behind it in DRAM (64 x 128K 29.0 -> 33.0 us);
  // issued after (S), 29.1 -> 29.9. A ring of bulk copies (TMA) of the whole slice did no better
  // (docs/2026-11-30-topk-one-sweep.md, ninth session). L2 prefetches of its first 64 / 128 KB
  // (per thread or bulk, after (S) or with the sample) did not help 64 x 128K either: issuing
  // them stalls the warps about as long as the sweep then saves (twelfth session).
  // visit(q, v0) gets a batch: q[u] holds the float bits of vector v0 + u * kThreads + tid.
  constexpr int kUnroll = 8;
  auto sweep = [&](auto&& visit) {
    for (int v0 = 0; v0 < nvec; v0 += kUnroll * kThreads) {
      uint4 q[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) q[u] = fetch_raw(min(v0 + u * kThreads + tid, nvec - 1));
      visit(q, v0);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // the caller's page ids
  };
  const int nwords = (n_local + 31) / 32;
  uint32_t* sel_bits = s.bits;
  uint32_t* tie_bits = s.bits + select_bitmap_bytes(chunk) / 8;
  auto zero_bitmaps = [&] {
    for (int i = tid; i < nwords; i += kThreads) {
      sel_bits[i] = 0;
      tie_bits[i] = 0;
    }
  };

  if (ties) {
    // ---- 3. keys > t_key selected, == t_key tied (vector v holds bits [4 (v % 8), + 4) of word v / 8)
    cluster_wait();  // the other CTAs have read this CTA's sample
    zero_bitmaps();
    __syncthreads();
    const uint32_t sel_s = smem_addr(sel_bits), tie_s = smem_addr(tie_bits);
    sweep([&](const uint4 (&q)[kUnroll], const int v0) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * kThreads + tid;
        const uint32_t valid = (1u << min(max(n_local - 4 * v, 0), 4)) - 1u;
        const uint4 key = order_keys(q[u]);
        const uint32_t kk[4] = {key.x, key.y, key.z, key.w};
        uint32_t gm = 0, em = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) gm |= (uint32_t)(kk[e] > t_key) << e;
        asm volatile("" : "+r"(gm));  // packed before the == compares (see the sweep of cluster_select_emit)
#pragma unroll
        for (int e = 0; e < 4; ++e) em |= (uint32_t)(kk[e] == t_key) << e;
        gm &= valid;
        em &= valid;
        red_or_shared_if(gm != 0, sel_s + 4 * (v >> 3), gm << (4 * (v & 7)));
        red_or_shared_if(em != 0, tie_s + 4 * (v >> 3), em << (4 * (v & 7)));
      }
    });
    __syncthreads();  // the bitmaps are complete
    const EmitCounts c = emit_counts<kThreads, true>(cluster, s, n_local, chunk);
    if (!(c.row_sel < (uint32_t)k && (uint64_t)c.row_sel + c.row_tie >= (uint64_t)k))
      return false;  // (uniform) the full select rewrites x.totals only after barriers every CTA passes
    emit_write<kThreads>(s, start, chunk, (uint32_t)k - c.row_sel, c, out);
    return true;
  }

  // ---- 2. keys >= t_low -> candidates (past the cap only counted), a batch at a time: per key
  // one compare of its float bits b, key(b) >= t_low <=> sortable(b) >= thr (signed), sortable(b)
  // = b with the magnitude bits flipped when negative, and for t_low >= key(+0.0) (thr >= 0)
  // simply b >= thr. Then one shared atomic per warp and batch (lane 31 adds the warp's total, a
  // scan gives each lane its slots). The sweep was bound by these visits, not by its loads; from
  // an atomic per thread and vector on the one counter and keys converted on load, H200: 64 / 128
  // x 128K 28.8 / 41.5 -> 27.3 / 38.1-38.6 us, 32 x 128K (clusters of 4) 25.9 -> 24.4
  // (docs/2026-11-30-topk-one-sweep.md, ninth session). Since then the visits are no longer what
  // bounds it: marking candidates in a bitmap instead (~230 instead of ~640 instructions per thread
  // and batch, the keys read again after the sweep) took 64 x 128K from 25.3 to 28.2 us (twelfth
  // session).
  const int32_t thr = (int32_t)(t_low ^ 0x80000000u);
  auto collect = [&](auto nonneg, const uint4 (&q)[kUnroll], const int v0) {
    const bool whole = v0 + kUnroll * kThreads <= n_local / 4;  // CTA-uniform: no vector to mask
    uint32_t ems = 0;  // bit 4u + e: key e of vector u is a candidate
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t kk[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
      uint32_t em = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t b = (int32_t)kk[e];
        const int32_t sortable = decltype(nonneg)::value ? b : (b ^ ((b >> 31) & 0x7FFFFFFF));
        em |= (uint32_t)(sortable >= thr) << e;
      }
      if (!whole) em &= (1u << min(max(n_local - 4 * (v0 + u * kThreads + tid), 0), 4)) - 1u;
      ems |= em << (4 * u);
    }
    const uint32_t n = (uint32_t)__popc(ems);
    const uint32_t incl = warp_inclusive_scan(n);
    const uint32_t total = __shfl_sync(0xffffffffu, incl, 31);
    if (total == 0) return;  // warp-uniform
    uint32_t base = 0;
    if (lane == 31) base = atomicAdd(&x.ncand, total);
    uint32_t slot = __shfl_sync(0xffffffffu, base, 31) + incl - n;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t kk[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
      const uint32_t pos = (uint32_t)(start + 4 * (v0 + u * kThreads + tid));
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (ems & (1u << (4 * u + e))) {
          if (slot < (uint32_t)kCandCap) s.cand[slot] = make_uint2(order_key_bits(kk[e]), pos + e);
          ++slot;
        }
    }
  };
  if (thr >= 0)
    sweep([&](const uint4 (&q)[kUnroll], const int v0) { collect(BoolConst<true>{}, q, v0); });
  else
    sweep([&](const uint4 (&q)[kUnroll], const int v0) { collect(BoolConst<false>{}, q, v0); });
  cluster_wait();  // (pairs the arrive after the sample reads)
  cluster.sync();  // (C) every CTA's candidates are written
  const uint32_t total = candidate_offsets<kThreads>(C, x);
  if (total < (uint32_t)k || total > (uint32_t)kCandCap) {  // cluster-uniform
    cluster.sync();  // the other CTAs have read this CTA's candidate count
    return false;
  }
  zero_bitmaps();
  __syncthreads();
  const uint32_t k_ties =
      candidate_select_mark<kThreads>(s, C, start, n_local, total, 0u, 32, (uint32_t)k, sel_bits, tie_bits, guess);
  __syncthreads();  // the bitmaps are complete
  emit_selected<kThreads>(cluster, s, n_local, start, chunk, k_ties, out);
  return true;
}

}  // namespace dsa_topk
