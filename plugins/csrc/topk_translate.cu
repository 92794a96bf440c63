// DSA-TRT kernels: fused top-k + page translation (DESIGN.md §3, plugins/reference.py
// topk_translate).
//
// For each row r with L = lengths[r] candidates: the k largest of logits[r, 0:L) (any order),
// written as raw positions p (optional) and as slots page_table[req_idx[r], p / 64] * 64 + p % 64.
// Rows with L <= k take every position 0..L-1 in order and pad the tail j >= L with -1.
//
// Algorithm: exact radix select on the order-preserving uint32 image of the fp32 scores, digits
// of 11, 11 and 10 bits. A row is scored by a thread-block cluster of C CTAs (C = 1..8): CTA c
// owns the slice [c*chunk, (c+1)*chunk) of the row, copies it once into shared memory (when it
// fits; otherwise every pass re-reads global memory) and builds the first digit's histogram on
// the way. Each pass: local shared-memory histogram of the candidates (keys whose higher digits
// equal the prefix chosen so far) -> cluster barrier -> CTA r sums bin slice r of every CTA's
// histogram over DSMEM (16-byte remote loads; no remote atomics and no hot-spot CTA: a first
// version that reduced into rank 0 with remote atomics spent ~80 us in DSMEM traffic at 64
// rows) -> cluster barrier -> every CTA reads the C slice totals, then the one slice holding the
// threshold, and picks the same threshold bin. The select stops early when the threshold bin
// is taken whole. Output: keys above the threshold prefix, then the
// first k_eq keys equal to it, placed by block-wide and cluster-wide prefix sums in a fixed
// (CTA, thread, element) order, so the result is deterministic, with no global atomics and
// no workspace.
//
// Ties: a thread counts runs of equal digits and issues one shared atomic per run, so a row of
// 99% zeros costs about what a random row costs. -inf and NaN are ordinary keys.
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2048;               // 11-bit digits (the last pass uses 1024)
constexpr int kPasses = 3;
// Pass p looks at key bits [digit_shift(p), digit_shift(p) + digit_bits(p)).
__host__ __device__ constexpr int digit_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }
__host__ __device__ constexpr uint32_t digit_mask(int pass) { return pass == 2 ? 0x3FFu : 0x7FFu; }
constexpr int kCacheCapElems = 40 * 1024;  // slice elements kept in shared memory (160 KB)
constexpr int kMaxCluster = 8;             // portable cluster size
constexpr int kMaxCtasPerSm = 2;           // 512 threads x <= 64 registers

struct SmemFixed {
  uint32_t hist[2][kBins];  // this CTA's histogram; pass p fills hist[p & 1] (others read it remotely)
  uint32_t slice[kBins];    // cluster-wide counts of this CTA's bin slice (the first kBins / C used)
  uint32_t slice_total;     // sum of slice[]
  uint32_t sel_slice, sel_above;  // slice holding the threshold; count in the slices above it
  uint32_t sel[3];          // threshold search result: bin, k_rem, bin count
  uint32_t scan[2 * kWarps];
  uint32_t totals[2];       // this CTA's (> threshold, == threshold) counts
};
constexpr size_t kSmemFixedBytes = (sizeof(SmemFixed) + 15) / 16 * 16;

__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
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
__device__ __forceinline__ uint32_t block_suffix_sum(uint32_t s, uint32_t* buf) {
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
__device__ __forceinline__ void block_excl_scan2(uint32_t a, uint32_t b, uint32_t& ea, uint32_t& eb,
                                                 uint32_t& ta, uint32_t& tb, uint32_t* buf) {
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

template <bool kCached>
__global__ void __launch_bounds__(kThreads, kMaxCtasPerSm) topk_translate_kernel(const DsaTopkTranslateParams p, const int chunk,
                                                                  const int max_len) {
  cg::cluster_group cluster = cg::this_cluster();
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x / C;
  const int k = p.k;
  const int L = min(max(p.lengths[row], 0), max_len);
  int32_t* slots_row = p.slots + row * k;
  int32_t* indices_row = p.indices ? p.indices + row * k : nullptr;
  const int32_t* table = p.page_table + (int64_t)p.req_idx[row] * p.max_pages;
  auto emit = [&](int j, int pos) {
    slots_row[j] = pos < 0 ? -1 : table[pos / DSA_PAGE_SIZE] * DSA_PAGE_SIZE + pos % DSA_PAGE_SIZE;
    if (indices_row) indices_row[j] = pos;
  };

  if (L <= k) {  // every candidate is selected (uniform over the cluster: no cluster barrier)
    for (int j = rank * kThreads + tid; j < k; j += C * kThreads) emit(j, j < L ? j : -1);
    return;
  }

  extern __shared__ __align__(16) uint8_t smem_raw[];
  SmemFixed& s = *reinterpret_cast<SmemFixed*>(smem_raw);
  uint4* keys = reinterpret_cast<uint4*>(smem_raw + kSmemFixedBytes);  // cached slice

  const int start = rank * chunk;
  const int n_local = min(max(L - start, 0), chunk);
  const int nvec = (n_local + 3) / 4;
  const float* src = p.logits + row * p.logits_stride + start;
  const bool vec_ok = (reinterpret_cast<uintptr_t>(src) & 15) == 0;

  auto fetch_global = [&](int v) -> uint4 {
    const int e0 = 4 * v;
    uint4 r;
    if (vec_ok && e0 + 3 < n_local) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(src + e0));
      r = make_uint4(order_key(f.x), order_key(f.y), order_key(f.z), order_key(f.w));
    } else {
      r.x = e0 + 0 < n_local ? order_key(src[e0 + 0]) : 0u;
      r.y = e0 + 1 < n_local ? order_key(src[e0 + 1]) : 0u;
      r.z = e0 + 2 < n_local ? order_key(src[e0 + 2]) : 0u;
      r.w = e0 + 3 < n_local ? order_key(src[e0 + 3]) : 0u;
    }
    return r;
  };
  auto fetch = [&](int v) -> uint4 {
    if constexpr (kCached) return keys[v];
    else return fetch_global(v);
  };

  uint32_t prefix = 0;      // digits chosen so far
  uint32_t k_rem = k;       // how many still to take among keys matching the prefix
  int shift = 32;           // keys match when (key >> shift) == prefix (shift 32: all keys)
  bool take_all = false;    // the last threshold bin was taken whole
  for (int pass = 0; pass < kPasses && !take_all; ++pass) {
    const int dshift = digit_shift(pass);
    const uint32_t dmask = digit_mask(pass);
    const int nbins = (int)dmask + 1;
    uint32_t* hist = s.hist[pass & 1];  // others last read it two passes ago, before two barriers
    for (int i = tid; i < nbins; i += kThreads) hist[i] = 0;
    __syncthreads();
    RunHist rh{hist};
    if (pass == 0) {
      // Straight-line 16-byte loads, all kUnroll issued before the first use (a version with a
      // scalar fallback inside the unrolled loop serialised them: ~0.8 us per element batch).
      constexpr int kUnroll = 4;  // loads in flight per thread (2 CTAs x 32 KB per SM)
      const int nvec_fast = vec_ok ? n_local / 4 : 0;  // full, aligned vectors
      const float4* src4 = reinterpret_cast<const float4*>(src);
      auto consume = [&](int v, uint4 kv) {
        if constexpr (kCached) keys[v] = kv;
        const uint32_t kk[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (4 * v + e < n_local) rh.add(kk[e] >> dshift);
      };
      for (int v0 = tid; v0 < nvec_fast; v0 += kUnroll * kThreads) {
        float4 buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = min(v0 + u * kThreads, nvec_fast - 1);  // clamped: always a valid load
          buf[u] = __ldg(src4 + v);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = v0 + u * kThreads;
          if (v < nvec_fast)
            consume(v, make_uint4(order_key(buf[u].x), order_key(buf[u].y), order_key(buf[u].z),
                                  order_key(buf[u].w)));
        }
      }
      for (int v = nvec_fast + tid; v < nvec; v += kThreads) consume(v, fetch_global(v));  // tail / unaligned
    } else {
      for (int v = tid; v < nvec; v += kThreads) {
        const uint4 q = fetch(v);
        const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (4 * v + e < n_local && (kk[e] >> shift) == prefix) rh.add((kk[e] >> dshift) & dmask);
      }
    }
    rh.flush();
    cluster.sync();  // (A) every CTA's histogram of this pass is complete

    // Reduce-scatter: this CTA sums bins [rank*S, rank*S + S) over the cluster (S/4 threads,
    // C remote 16-byte loads each).
    const int S = nbins / C;
    uint32_t part = 0;
    if (tid < S / 4) {
      uint4 v[kMaxCluster];
#pragma unroll
      for (int r = 0; r < kMaxCluster; ++r)  // all remote loads in flight before the sums
        if (r < C) v[r] = reinterpret_cast<const uint4*>(cluster.map_shared_rank(hist, r) + rank * S)[tid];
      uint4 acc = make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int r = 0; r < kMaxCluster; ++r) {
        if (r < C) {
          acc.x += v[r].x;
          acc.y += v[r].y;
          acc.z += v[r].z;
          acc.w += v[r].w;
        }
      }
      reinterpret_cast<uint4*>(s.slice)[tid] = acc;
      part = acc.x + acc.y + acc.z + acc.w;
    }
    const uint32_t slice_sum = block_suffix_sum(part, s.scan);  // thread 0: the slice total
    if (tid == 0) s.slice_total = slice_sum;
    cluster.sync();  // (B) every slice is reduced

    // Threshold bin: the highest b with count(bins >= b) >= k_rem. First the slice (warp 0 reads
    // the C totals), then the bin inside it.
    if (tid < 32) {
      const uint32_t tot = tid < C ? *cluster.map_shared_rank(&s.slice_total, tid) : 0u;
      uint32_t x = tot;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t v = __shfl_down_sync(0xffffffffu, x, off);
        if (tid + off < 32) x += v;
      }
      if (tid < C && x - tot < k_rem && k_rem <= x) {
        s.sel_slice = tid;
        s.sel_above = x - tot;
      }
    }
    __syncthreads();
    const int sl = (int)s.sel_slice;
    uint4 cnt = make_uint4(0, 0, 0, 0);
    if (tid < S / 4) cnt = reinterpret_cast<const uint4*>(cluster.map_shared_rank(s.slice, sl))[tid];
    const uint32_t mine = cnt.x + cnt.y + cnt.z + cnt.w;
    const uint32_t incl = block_suffix_sum(mine, s.scan) + s.sel_above;
    const uint32_t excl = incl - mine;
    if (tid < S / 4 && excl < k_rem && k_rem <= incl) {
      const uint32_t c4[4] = {cnt.x, cnt.y, cnt.z, cnt.w};
      uint32_t acc = excl;
#pragma unroll
      for (int j = 3; j >= 0; --j) {
        if (acc < k_rem && acc + c4[j] >= k_rem) {
          s.sel[0] = sl * S + 4 * tid + j;
          s.sel[1] = k_rem - acc;
          s.sel[2] = c4[j];
        }
        acc += c4[j];
      }
    }
    __syncthreads();
    const uint32_t bin = s.sel[0];
    k_rem = s.sel[1];
    prefix = (shift == 32 ? 0u : prefix << (shift - dshift)) | bin;
    shift = dshift;
    take_all = (s.sel[2] == k_rem);
    __syncthreads();  // s.sel / s.sel_* are rewritten by the next pass
  }

  // Output: keys with (key >> shift) > prefix go to [0, k - k_rem); the first k_rem keys equal
  // to it (in (rank, thread, element) order) go to [k - k_rem, k).
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
  block_excl_scan2(n_gt, n_eq, off_gt, off_eq, cta_gt, cta_eq, s.scan);
  if (tid == 0) {
    s.totals[0] = cta_gt;
    s.totals[1] = cta_eq;
  }
  cluster.sync();
  uint32_t base_gt = 0, base_eq = 0;
  for (int r = 0; r < rank; ++r) {
    const uint32_t* t = cluster.map_shared_rank(s.totals, r);
    base_gt += t[0];
    base_eq += t[1];
  }
  const uint32_t n_take_gt = (uint32_t)k - k_rem;
  uint32_t j_gt = base_gt + off_gt, j_eq = base_eq + off_eq;
  for (int v = tid; v < nvec; v += kThreads) {
    const uint4 q = fetch(v);
    const uint32_t kk[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (4 * v + e < n_local) {
        const uint32_t hi = kk[e] >> shift;
        if (hi > prefix) {
          emit((int)j_gt++, start + 4 * v + e);
        } else if (hi == prefix) {
          if (j_eq < k_rem) emit((int)(n_take_gt + j_eq), start + 4 * v + e);
          ++j_eq;
        }
      }
    }
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
}

int num_sms() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

struct Plan {
  int cluster, chunk;
  bool cached;
  size_t smem;
};

// Cluster size by a small cost model: waves of clusters x per-CTA work (elements, with a fixed
// overhead for the barriers and scans; an uncached slice is re-read from global memory).
Plan make_plan(int64_t rows, int max_len) {
  constexpr int64_t kOverheadElems = 6000;
  constexpr int64_t kSmemPerSm = 228 * 1024, kSmemReservedPerCta = 1024;
  const int64_t sms = num_sms();
  Plan best{1, 0, false, 0};
  int64_t best_cost = INT64_MAX;
  for (int c = 1; c <= kMaxCluster; c *= 2) {  // C divides the bin counts
    const int chunk = (int)dsa_ceil_div(dsa_ceil_div(max_len, c), 4) * 4;
    const bool cached = chunk <= kCacheCapElems;
    const size_t smem = kSmemFixedBytes + (cached ? (size_t)chunk * 4 : 0);
    int64_t per_sm = kSmemPerSm / (int64_t)(smem + kSmemReservedPerCta);
    per_sm = per_sm < 1 ? 1 : (per_sm > kMaxCtasPerSm ? kMaxCtasPerSm : per_sm);
    const int64_t clusters_per_wave = (sms * per_sm / c) > 0 ? sms * per_sm / c : 1;
    const int64_t waves = dsa_ceil_div(rows, clusters_per_wave);
    const int64_t cost = waves * ((int64_t)chunk * (cached ? 1 : 3) + kOverheadElems);
    if (cost < best_cost) {
      best_cost = cost;
      best = Plan{c, chunk, cached, smem};
    }
  }
  return best;
}

template <bool kCached>
int launch(const DsaTopkTranslateParams& p, const Plan& plan, int max_len, cudaStream_t stream) {
  static size_t configured_smem = 0;  // raise the opt-in limit once (not a stream operation)
  if (plan.smem > configured_smem) {
    DSA_CUDA_CHECK(cudaFuncSetAttribute(topk_translate_kernel<kCached>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan.smem));
    configured_smem = plan.smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(p.rows * plan.cluster));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = plan.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = plan.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DSA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, topk_translate_kernel<kCached>, p, plan.chunk, max_len));
  return DSA_OK;
}

}  // namespace

extern "C" size_t dsa_topk_translate_workspace_size(int64_t rows, int64_t max_len, int k) {
  (void)rows;
  (void)max_len;
  (void)k;
  return 0;
}

extern "C" int dsa_launch_topk_translate(const DsaTopkTranslateParams* p, cudaStream_t stream) {
  DSA_CHECK_ARG(p != nullptr, "topk_translate: params is NULL");
  DSA_CHECK_ARG(p->rows >= 0, "topk_translate: rows=%lld < 0", (long long)p->rows);
  DSA_CHECK_ARG(p->k >= 1, "topk_translate: k=%d < 1", p->k);
  if (p->rows == 0) return DSA_OK;
  DSA_CHECK_ARG(p->rows * kMaxCluster <= INT32_MAX, "topk_translate: rows=%lld too many", (long long)p->rows);
  DSA_CHECK_ARG(p->logits && p->lengths && p->page_table && p->req_idx && p->slots,
                "topk_translate: NULL pointer (logits=%p lengths=%p page_table=%p req_idx=%p slots=%p)",
                (const void*)p->logits, (const void*)p->lengths, (const void*)p->page_table,
                (const void*)p->req_idx, (const void*)p->slots);
  DSA_CHECK_ARG(p->max_pages >= 0 && p->logits_stride >= 0, "topk_translate: max_pages=%d logits_stride=%lld",
                p->max_pages, (long long)p->logits_stride);
  const int64_t width = p->logits_stride < (int64_t)p->max_pages * DSA_PAGE_SIZE
                            ? p->logits_stride
                            : (int64_t)p->max_pages * DSA_PAGE_SIZE;
  DSA_CHECK_ARG(width <= INT32_MAX, "topk_translate: row width %lld exceeds int32", (long long)width);
  const int max_len = (int)width;
  const Plan plan = make_plan(p->rows, max_len > 0 ? max_len : 1);
  return plan.cached ? launch<true>(*p, plan, max_len, stream) : launch<false>(*p, plan, max_len, stream);
}
