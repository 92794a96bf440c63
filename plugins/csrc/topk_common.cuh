// DSA-TRT kernels: the building blocks of the cluster top-k (topk_select.cuh): the radix digits
// and capacities, the order-preserving keys, distributed-shared-memory loads and cluster
// barriers, shared-memory reductions by 32-bit address, warp-aggregated histograms, block scans,
// the select's shared state (SelectScratch / SelectSmem), the row's output (RowOutput) and the
// local threshold search.
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

}  // namespace dsa_topk
