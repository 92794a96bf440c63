// DSA-TRT kernels: fused top-k + page translation (docs/architecture.md §4, plugins/reference.py
// topk_translate).
//
// For each row r with L = lengths[r] candidates: the k largest of logits[r, 0:L) (any order),
// written as raw positions p (optional) and as slots page_table[req_idx[r], p / 64] * 64 + p % 64.
// Rows with L <= k take every position 0..L-1 in order and pad the tail j >= L with -1.
//
// Algorithm (topk_select.cuh): exact radix select on the order-preserving uint32 image of the
// fp32 scores by a thread-block cluster of C CTAs (C = 1..16) per row. CTA c owns the slice
// [c*chunk, (c+1)*chunk) of the row and reads it once from global memory, building the first
// digit's histogram; when the slice fits in shared memory beside the select's state without
// costing occupancy it is also kept there, otherwise the select's one further sweep re-reads it
// (from L2 mostly: the sweep runs backwards). The cluster select + emit of topk_select.cuh does
// the rest. Uncached slices of long rows first try the
// sampled select of topk_select.cuh: a sample of the row bounds the threshold, and one read of
// the slice collects the candidates (or marks a tied threshold value), with the full select as
// the fallback when the sample misjudges the row. Among keys equal to the k-th largest, the
// lowest positions win, and the output is in ascending position order, so it does not depend on
// the cluster shape chosen here. No global atomics and no workspace.
#include <stdlib.h>

#include "common.cuh"
#include "topk_select.cuh"

namespace {

using namespace dsa_topk;

constexpr int kThreads = 512;
constexpr int kMaxCluster = 16;            // 16 is non-portable (Hopper allows it; opted in at launch)
constexpr int kMaxCtasPerSm = 2;           // 512 threads x <= 64 registers
static_assert(kThreads >= kMinThreadsTimesCluster, "the reduce-scatter needs kThreads * C >= kBins / 4 for C >= 1");

struct SmemFixed {
  uint32_t hist[2][kBins];  // this CTA's histograms (others read them remotely)
  uint32_t slice[kBins];    // cluster-wide counts of this CTA's bin slice (the first kBins / C used)
  uint2 cand[kCandCap];     // the select's candidates
  SelectScratch<kThreads> x;
};
constexpr size_t kSmemFixedBytes = (sizeof(SmemFixed) + 15) / 16 * 16;
// Page ids of a slice of `chunk` positions, in bytes (a multiple of 16).
__host__ __device__ constexpr int slice_pages_bytes(int chunk) { return (chunk / DSA_PAGE_SIZE + 3) / 4 * 16; }
// Shared memory of a CTA: SmemFixed, the select's bitmaps, the slice's page ids, then (cached) the
// slice's keys.
size_t smem_bytes(int chunk, bool cached) {
  return kSmemFixedBytes + (size_t)select_bitmap_bytes(chunk) + (size_t)slice_pages_bytes(chunk) +
         (cached ? (size_t)chunk * 4 : 0);
}

enum Source { kCachedKeys, kAlignedRows, kUnalignedRows };

template <Source kSource>
__global__ void __launch_bounds__(kThreads, kMaxCtasPerSm) topk_translate_kernel(const DsaTopkTranslateParams p, const int chunk,
                                                                  const int max_len, const uint64_t l2_policy) {
  dsa_pdl_wait();
  cg::cluster_group cluster = cg::this_cluster();
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x / C;
  const int k = p.k;
  const int L = min(max(p.lengths[row], 0), max_len);
  const RowOutput out{p.slots + row * k, p.indices ? p.indices + row * k : nullptr,
                      p.page_table + (int64_t)p.req_idx[row] * p.max_pages};

  if (L <= k) {  // every candidate is selected (uniform over the cluster: no cluster barrier)
    out.all_positions(L, k, rank * kThreads + tid, C * kThreads);
    return;
  }

  extern __shared__ __align__(16) uint8_t smem_raw[];
  SmemFixed& s = *reinterpret_cast<SmemFixed*>(smem_raw);
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem_raw + kSmemFixedBytes);
  int32_t* pages = reinterpret_cast<int32_t*>(smem_raw + kSmemFixedBytes + select_bitmap_bytes(chunk));
  uint4* keys = reinterpret_cast<uint4*>(smem_raw + kSmemFixedBytes + select_bitmap_bytes(chunk) +
                                         slice_pages_bytes(chunk));  // cached slice

  const int start = rank * chunk;  // chunk: a multiple of 64
  const int n_local = min(max(L - start, 0), chunk);
  // The slice's page ids -> shared memory, asynchronously (the emit translates from them).
  for (int i = tid; i < (n_local + DSA_PAGE_SIZE - 1) / DSA_PAGE_SIZE; i += kThreads)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(pages + i)),
                 "l"(out.table + start / DSA_PAGE_SIZE + i)
                 : "memory");
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  const int nvec = (n_local + 3) / 4;
  const float* src = p.logits + row * p.logits_stride + start;

  // Float bits of local positions [4v, 4v + 4); past n_local: anything (the select masks them).
  auto fetch_raw = [&](int v) -> uint4 {
    const int e0 = 4 * v;
    if constexpr (kSource != kUnalignedRows) {  // rows 16-byte aligned: the vector is inside the row
      const float4 f = ldg_f4_policy(reinterpret_cast<const float4*>(src) + v, l2_policy);
      return make_uint4(__float_as_uint(f.x), __float_as_uint(f.y), __float_as_uint(f.z), __float_as_uint(f.w));
    } else {
      uint4 r;
      r.x = e0 + 0 < n_local ? __float_as_uint(src[e0 + 0]) : 0u;
      r.y = e0 + 1 < n_local ? __float_as_uint(src[e0 + 1]) : 0u;
      r.z = e0 + 2 < n_local ? __float_as_uint(src[e0 + 2]) : 0u;
      r.w = e0 + 3 < n_local ? __float_as_uint(src[e0 + 3]) : 0u;
      return r;
    }
  };
  auto fetch_global = [&](int v) { return order_keys(fetch_raw(v)); };  // keys
  auto fetch = [&](int v) -> uint4 {
    if constexpr (kSource == kCachedKeys) return keys[v];
    else return fetch_global(v);
  };

  const SelectSmem<kThreads> sm{s.hist[0], s.hist[1], s.slice, bits, s.cand, pages, &s.x};
  // A slice read from global memory: a sampled threshold and one read (topk_select.cuh), unless
  // the sample does not settle the row.
  if constexpr (kSource != kCachedKeys)
    if (sampled_select_applies(L, k) &&
        sampled_select_emit<kThreads>(cluster, sm, n_local, start, chunk, k, fetch_raw, out))
      return;

  // Pass 0 histogram (digit key >> 21) while the slice is read once from global memory; every
  // thread runs the same trip count (hist_add4 is warp-collective).
  for (int i = tid; i < kBins; i += kThreads) s.hist[0][i] = 0;
  __syncthreads();
  if constexpr (kSource == kCachedKeys) {
    // cp.async straight into the cache, kAhead vectors in flight per thread while the histogram of
    // the oldest is built (converted to keys in place): faster than register loads in batches of 8.
    // (A per-thread ring of the same kind for the uncached slices was slower.)
    constexpr int kAhead = 8;
    const int n_it = (nvec + kThreads - 1) / kThreads;
    const float4* src4 = reinterpret_cast<const float4*>(src);
    auto issue = [&](int m) {  // thread's m-th vector, m * kThreads + tid
      const int v = m * kThreads + tid;
      if (m < n_it && v < nvec)
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_addr(keys + v)),
                     "l"(src4 + v), "l"(l2_policy) : "memory");
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
#pragma unroll
    for (int m = 0; m < kAhead - 1; ++m) issue(m);
    for (int m = 0; m < n_it; ++m) {
      issue(m + kAhead - 1);
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kAhead - 1) : "memory");  // vector m has landed
      const int v = m * kThreads + tid;
      uint4 kv = make_uint4(0u, 0u, 0u, 0u);
      if (v < nvec) {
        const float4 f = reinterpret_cast<const float4*>(keys)[v];
        kv = make_uint4(order_key(f.x), order_key(f.y), order_key(f.z), order_key(f.w));
        keys[v] = kv;
      }
      hist_add4(smem_addr(s.hist[0]), kv, min(max(n_local - 4 * v, 0), 4));
    }
  } else {
    constexpr int kUnroll = 8;  // 16-byte loads in flight per thread (64 KB per 512-thread CTA)
    for (int v0 = 0; v0 < nvec; v0 += kUnroll * kThreads) {
      uint4 kv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) kv[u] = fetch_global(min(v0 + u * kThreads + tid, nvec - 1));  // clamped: a valid load
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        hist_add4(smem_addr(s.hist[0]), kv[u], min(max(n_local - 4 * (v0 + u * kThreads + tid), 0), 4));
    }
  }

  asm volatile("cp.async.wait_all;\n" ::: "memory");  // the select's barriers publish the page ids
  cluster_select_emit<kThreads, kMaxCluster>(cluster, sm, n_local, start, chunk, k, fetch, out);
}

int num_sms() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

struct Plan {
  int cluster, chunk;
  Source source;
  size_t smem;
};

// Cluster size: one CTA per SM is fastest (the select is issue- and latency-bound, and two CTAs
// on an SM compete for its issue slots), so the widest C (a power of two
// up to 16) with rows * C <= SMs, at least 1. The slice is cached in shared memory when it fits,
// unless the sampled select is faster for the shape (below).
// DSA_TOPK_CLUSTER=C forces the cluster size (benchmarks, experiments).
Plan make_plan(int64_t rows, int max_len, int k, bool aligned) {
  constexpr size_t kSmemPerSm = 227 * 1024;
  static const int forced = [] {
    const char* e = getenv("DSA_TOPK_CLUSTER");
    const int c = e ? atoi(e) : 0;
    return (c == 1 || c == 2 || c == 4 || c == 8 || c == 16) ? c : 0;
  }();
  const int64_t sms = num_sms();
  auto chunk_of = [&](int c) { return (int)dsa_ceil_div(dsa_ceil_div(max_len, c), DSA_PAGE_SIZE) * DSA_PAGE_SIZE; };
  auto fits = [&](int c) { return aligned && smem_bytes(chunk_of(c), true) <= kSmemPerSm; };
  int c = 1;
  while (c < kMaxCluster && rows * (2 * c) <= sms) c *= 2;
  // A large batch whose rows do not fit in shared memory: two CTAs per SM hide the re-read better
  // (128 x 128K is faster at C = 2 than at C = 1; a cached 128 x 32K is not).
  if (c == 1 && !fits(1) && rows <= 2 * sms) c = 2;
  if (forced) c = forced;
  const int chunk = chunk_of(c);
  // Slices of >= 16K keys over clusters of 4 or 8 CTAs: the sampled select reading the slice
  // once from global memory beats caching it; elsewhere (clusters of 1, 2 or 16, slices of 8K)
  // caching wins (measured both ways: benchmarks/RESULTS.md, "Top-k plan"). DSA_TOPK_CACHE=0 / 1
  // forces it either way (experiments).
  static const int cache_mode = [] {
    const char* e = getenv("DSA_TOPK_CACHE");
    return e && (e[0] == '0' || e[0] == '1') ? e[0] - '0' : -1;
  }();
  const bool prefer_sampled = (c == 4 || c == 8) && chunk >= 16384 && sampled_path_possible(k) &&
                              (int64_t)max_len >= 16 * (int64_t)k;
  const bool cached = fits(c) && (cache_mode == -1 ? !prefer_sampled : cache_mode == 1);  // the cached kernel reads rows as vectors
  return Plan{c, chunk, cached ? kCachedKeys : (aligned ? kAlignedRows : kUnalignedRows), smem_bytes(chunk, cached)};
}

template <Source kSource>
int launch(const DsaTopkTranslateParams& p, const Plan& plan, int max_len, cudaStream_t stream) {
  const int rc = dsa_kernel_attributes("topk_translate", (const void*)topk_translate_kernel<kSource>, plan.smem,
                                      plan.cluster > 8);
  if (rc != DSA_OK) return rc;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(p.rows * plan.cluster));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = plan.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = plan.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1] = dsa_pdl_attr();
  cfg.attrs = attr;
  cfg.numAttrs = 2;
  DSA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, topk_translate_kernel<kSource>, p, plan.chunk, max_len,
                                    kL2EvictFirst));  // the scores are read once (twice or more by the full select)
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
  DSA_CHECK_ARG(p->k <= dsa_topk::kMaxTopk, "topk_translate: k=%d > %d (the select stages a row's selection in shared memory)",
                p->k, dsa_topk::kMaxTopk);
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
  // 16-byte aligned rows: every vector of a row lies inside it (the stride is a multiple of 4).
  const bool aligned = (reinterpret_cast<uintptr_t>(p->logits) & 15) == 0 && p->logits_stride % 4 == 0;
  const Plan plan = make_plan(p->rows, max_len > 0 ? max_len : 1, p->k, aligned);
  DSA_CHECK_SUPPORTED(plan.smem <= 227 * 1024,
                      "topk_translate: rows of %d positions need %zu B of shared memory per CTA at cluster size %d "
                      "(the select's bitmaps grow with the slice; max 232448)",
                      max_len, plan.smem, plan.cluster);
  switch (plan.source) {
    case kCachedKeys: return launch<kCachedKeys>(*p, plan, max_len, stream);
    case kAlignedRows: return launch<kAlignedRows>(*p, plan, max_len, stream);
    default: return launch<kUnalignedRows>(*p, plan, max_len, stream);
  }
}
