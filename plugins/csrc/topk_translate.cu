// DSA-TRT kernels: fused top-k + page translation (DESIGN.md §3, plugins/reference.py
// topk_translate).
//
// For each row r with L = lengths[r] candidates: the k largest of logits[r, 0:L) (any order),
// written as raw positions p (optional) and as slots page_table[req_idx[r], p / 64] * 64 + p % 64.
// Rows with L <= k take every position 0..L-1 in order and pad the tail j >= L with -1.
//
// Algorithm (topk_select.cuh): exact radix select on the order-preserving uint32 image of the
// fp32 scores, digits of 11, 11 and 10 bits, by a thread-block cluster of C CTAs (C = 1..16) per
// row. CTA c owns the slice [c*chunk, (c+1)*chunk) of the row, copies it once into shared memory
// (when it fits; otherwise every pass re-reads global memory) and builds the first digit's
// histogram on the way; the cluster select + emit of topk_select.cuh does the rest (shared with
// the fused indexer_topk.cu). Among keys equal to the k-th largest, the lowest positions win, so
// the selected set does not depend on the cluster shape chosen here. No global atomics and no
// workspace.
#include "common.cuh"
#include "topk_select.cuh"

namespace {

using namespace dsa_topk;

constexpr int kThreads = 512;
constexpr int kCacheCapElems = 40 * 1024;  // slice elements kept in shared memory (160 KB)
constexpr int kMaxCluster = 16;            // 16 is non-portable (Hopper allows it; opted in at launch)
constexpr int kMaxCtasPerSm = 2;           // 512 threads x <= 64 registers
static_assert(kThreads >= kMinThreadsTimesCluster, "the reduce-scatter needs kThreads * C >= kBins / 4 for C >= 1");

struct SmemFixed {
  uint32_t hist[2][kBins];  // this CTA's histograms (others read them remotely)
  uint32_t slice[kBins];    // cluster-wide counts of this CTA's bin slice (the first kBins / C used)
  SelectScratch<kThreads> x;
};
constexpr size_t kSmemFixedBytes = (sizeof(SmemFixed) + 15) / 16 * 16;

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
  const RowOutput out{p.slots + row * k, p.indices ? p.indices + row * k : nullptr,
                      p.page_table + (int64_t)p.req_idx[row] * p.max_pages};

  if (L <= k) {  // every candidate is selected (uniform over the cluster: no cluster barrier)
    out.all_positions(L, k, rank * kThreads + tid, C * kThreads);
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

  // Pass 0 histogram (digit key >> 21) while the slice is read once from global memory.
  for (int i = tid; i < kBins; i += kThreads) s.hist[0][i] = 0;
  __syncthreads();
  {
    RunHist rh{s.hist[0]};
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
        if (4 * v + e < n_local) rh.add(kk[e] >> kFirstShift);
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
    rh.flush();
  }

  const SelectSmem<kThreads> sm{s.hist[0], s.hist[1], s.slice, &s.x};
  cluster_select_emit<kThreads, kMaxCluster>(cluster, sm, n_local, start, k, fetch, out);
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
  static bool non_portable = false;
  if (plan.cluster > 8 && !non_portable) {
    DSA_CUDA_CHECK(cudaFuncSetAttribute(topk_translate_kernel<kCached>,
                                        cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    non_portable = true;
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
