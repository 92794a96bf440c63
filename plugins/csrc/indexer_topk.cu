// DSA-TRT kernels: decode indexer logits fused with top-k + page translation (docs/architecture.md §4;
// dsa_kernels.h DsaIndexerTopk). Returns what topk_translate(indexer_logits(...)) returns, without
// the [T, S] fp32 logits in memory.
//
// Fused path (fp8 pool). One thread-block cluster of C CTAs per query token; CTA `rank` owns the
// token's pages [rank * ppc, (rank + 1) * ppc) (ppc = ceil(max_pages / C)), i.e. a contiguous
// slice of positions, and W warpgroups (W = 2 or 4) score its pages with the page scoring of
// indexer_tile.cuh, the code indexer_logits.cu runs (same cp.async page ring, same QGMMA and head
// reduction), so the fp32 scores are bitwise the same. Warpgroup w takes pages w, w + W, ... with
// kStages - 1 = 3 pages in flight. Each score becomes its order-preserving uint32 key in shared
// memory (the role of topk_translate's `keys` cache) and is counted in the first radix histogram
// at once (one shared atomic per key). Then the cluster select + emit of topk_select.cuh (shared
// with topk_translate.cu) runs on the shared-memory keys. Its tie rule (keys equal to the k-th
// largest: lowest positions first) makes the selected set independent of C and of the slicing,
// so it equals the two-kernel result whatever cluster shapes the two paths use.
//
// Why this shape: the pass over the pool is memory bound (17 MB per token at 128K), and the
// select needs every key of the token at once (512 KB at 128K), so a token's keys are spread over
// the shared memory of its cluster, and what shared memory is left holds the page rings: bytes
// in flight per SM = W * 3 pages * 8.4 KB per resident CTA (Little's law wants ~50 KB per SM:
// ~1.5 us x 4.3 TB/s / 132 SMs). Pages go through shared memory rather than straight into
// registers because the QGMMA A operand interleaves rows r0 / r0 + 8: ptxas then shuffles each
// loaded 16-byte vector into the operand registers right after the load, which waits for it (the
// prefetch is lost; seen in the SASS of a register-prefetch version). At 128K a token needs ~4
// SMs of shared memory (e.g. C = 4 x 217 KB with W = 2: 128 KB keys + 70 KB rings), so a wave holds
// ~32 tokens: cudaOccupancyMaxActiveClusters decides (GPCs whose SM count is not a multiple of
// 4 lose the rest).
//
// Dispatch (AUTO: make_plan / choose below). A small cost model over the fused shapes (C in 1..16,
// W in 2, 4; those whose shared memory fits, with the active clusters the occupancy API reports)
// and the two-kernel path:
//   fused wave of r tokens  = r * row_bytes / min(kHbmBytesPerUs, r * C * W * kWgBytesPerUs)
//                             + kFusedWaveUs + keys per thread * kSelectUsPerKeyPerThread
//   fused                   = full waves + the remaining tokens as one more wave, which may use
//                             another shape (a second launch: e.g. 30 tokens at C=4 + 2 at C=16)
//   unfused                 = kLogitsFixedUs + T * row_bytes / kHbmBytesPerUs
//                             + kTopkFixedUs + T * max_len * 4 / kTopkBytesPerUs
// and the cheaper runs. A few tokens get wide clusters (C = 16, W = 4: 64 warpgroups stream one
// token, about what indexer_logits reaches at B = 1), a batch gets the narrowest shape that holds
// its keys (at 128K: C = 4, W = 2, ~32 tokens per wave). The constants are fitted to the H200's
// measured fused and two-kernel times (benchmarks/RESULTS.md, "Fused logits + top-k"). The select
// of a wave runs after the memory-bound scoring of the whole wave (one CTA per SM, and every CTA
// of a wave reaches its select at the same time), so AUTO picks the two kernels at 128K. With
// workspace == NULL, AUTO is fused whenever a fused shape fits. Calibrate the
// constants with benchmarks/bench_indexer_topk.py, which times both paths.
#include <math.h>
#include <stdio.h>

#include <mutex>
#include <string>
#include <vector>

#include "common.cuh"
#include "indexer_tile.cuh"
#include "topk_select.cuh"

namespace {

using namespace dsa_indexer;
using namespace dsa_topk;

constexpr int kMaxCluster = 16;  // non-portable: cudaFuncAttributeNonPortableClusterSizeAllowed
constexpr int kRegion0Bytes = 8192;  // q tile (<= 64 heads x 128 B) while streaming, hist1 after
static_assert(kRegion0Bytes >= 64 * DSA_INDEX_DIM && kRegion0Bytes >= kBins * 4, "region 0 holds q and hist1");

// Shared memory of one CTA (the same offsets in every CTA: the select reads remote CTAs at them).
//   [0, 1024)                 alignment slack (the q tile needs 1024-byte alignment)
//   region 0 (8 KB)           q tile [H, 128] swizzled while streaming; hist1 [2048] afterwards
//   rings [W][kStages] Stage  the warpgroups' page rings (8.5 KB per stage) while streaming; the
//                             select's candidates and bitmaps afterwards (the region is the larger)
//   keys [ppc * 64] uint32    order keys of the slice's positions
//   hist0 [2048] uint32       pass-0 histogram, built while streaming
//   slice [2048 / C] uint32
//   pages [ppc] int32         page ids of the slice (rounded up to 16 bytes)
//   SelectScratch
template <int W>
struct FusedLayout {
  static constexpr int kThreads = kWgThreads * W;
  int rings, bits, keys, hist0, slice, pages, scratch, total;  // byte offsets from the aligned base; total with slack
  __host__ __device__ FusedLayout(int cluster, int ppc) {
    rings = kRegion0Bytes;  // the candidates sit at the start of the ring region, the bitmaps after them
    bits = rings + kCandBytes;
    const int ring_bytes = W * kStages * (int)sizeof(Stage);
    const int select_bytes = kCandBytes + select_bitmap_bytes(ppc * DSA_PAGE_SIZE);
    keys = rings + (ring_bytes > select_bytes ? ring_bytes : select_bytes);
    hist0 = keys + ppc * DSA_PAGE_SIZE * 4;
    slice = hist0 + kBins * 4;
    pages = slice + kBins / cluster * 4;
    scratch = pages + (ppc * 4 + 15) / 16 * 16;
    total = 1024 + scratch + (int)((sizeof(SelectScratch<kThreads>) + 15) / 16 * 16);
  }
};

template <int H, int W>
__global__ void __launch_bounds__(kWgThreads * W, 4 / W)
    indexer_topk_fused_kernel(const DsaIndexerTopkParams p, const int64_t token0, const int ppc, const uint64_t l2_policy) {
  dsa_pdl_wait();
  constexpr int kThreads = kWgThreads * W;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x;
  const int64_t t = token0 + blockIdx.x / C;
  const int k = p.k;
  const int L = min(max(p.seq_lens[t], 0), p.max_pages * DSA_PAGE_SIZE);
  const int32_t* table = p.page_table + (int64_t)p.req_idx[t] * p.max_pages;
  const RowOutput out{p.slots + t * k, p.indices ? p.indices + t * k : nullptr, table};
  if (L <= k) {  // every candidate is selected (uniform over the cluster: no cluster barrier)
    out.all_positions(L, k, rank * kThreads + tid, C * kThreads);
    return;
  }

  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = align_smem_1024(smem_raw);
  const FusedLayout<W> lay(C, ppc);
  uint8_t* sq = base;
  uint32_t* keys = reinterpret_cast<uint32_t*>(base + lay.keys);
  uint32_t* hist0 = reinterpret_cast<uint32_t*>(base + lay.hist0);
  int32_t* s_pages = reinterpret_cast<int32_t*>(base + lay.pages);

  const int page0 = rank * ppc;
  const int start = page0 * DSA_PAGE_SIZE;
  const int n_local = min(max(L - start, 0), ppc * DSA_PAGE_SIZE);
  const int n_pages = (n_local + DSA_PAGE_SIZE - 1) / DSA_PAGE_SIZE;
  const int wg = tid / kWgThreads, wtid = tid % kWgThreads;
  Stage* ring = reinterpret_cast<Stage*>(base + lay.rings) + wg * kStages;

  for (int i = tid; i < n_pages; i += kThreads) s_pages[i] = table[page0 + i];
  for (int i = tid; i < kBins; i += kThreads) hist0[i] = 0;
  __syncthreads();

  // Warpgroup wg scores pages wg, wg + W, ... of the slice: its li-th page is wg + li * W.
  const PageRing pr = make_page_ring(ring, p.pool, wtid, l2_policy);
  const int n_mine = n_pages > wg ? (n_pages - wg + W - 1) / W : 0;
  auto issue = [&](int li) {  // page li -> stage li % kStages (always commits a group)
    if (li < n_mine) ring_issue<true>(pr, li % kStages, s_pages[wg + li * W]);
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // q[t] -> shared (overlaps the first pages), head weights -> registers.
  if (n_pages > 0) stage_q<H, kThreads>(sq, static_cast<const uint8_t*>(p.q) + t * H * DSA_INDEX_DIM, tid);
  float wr[H / 8][2];
  load_head_weights<H>(wr, p.weights + t * H, wtid);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t desc = make_desc_sw128(sq);

  const int row_in_page = score_row(wtid);
  const bool stores = stores_score(wtid);
  float d[H / 2];
  for (int li = 0; li < n_mine; ++li) {  // warpgroup-uniform trip count
    cp_async_wait<kStages - 2>();         // this thread's copies of page li have landed
    const PageFrag f = ring_read(pr, li % kStages);
    issue(li + kStages - 1);              // into the stage read (and consumed) in iteration li - 1
    const float score = score_page<H>(d, f, desc, wr, wtid);
    if (stores) {
      const int col = (wg + li * W) * DSA_PAGE_SIZE + row_in_page;  // local position
      const uint32_t key = order_key(score);
      keys[col] = key;
      if (col < n_local) atomicAdd(hist0 + (key >> kFirstShift), 1u);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup is done with its ring: the select's bitmaps and candidates reuse it
  // The select's first cluster barrier orders the keys and hist0 before any read; hist1 reuses the
  // q tile only after it (every wgmma of this CTA has completed by then).

  const SelectSmem<kThreads> sm{hist0,
                                reinterpret_cast<uint32_t*>(base),
                                reinterpret_cast<uint32_t*>(base + lay.slice),
                                reinterpret_cast<uint32_t*>(base + lay.bits),
                                reinterpret_cast<uint2*>(base + lay.rings),
                                s_pages,
                                reinterpret_cast<SelectScratch<kThreads>*>(base + lay.scratch)};
  const uint4* keys4 = reinterpret_cast<const uint4*>(keys);
  cluster_select_emit<kThreads, kMaxCluster>(cluster, sm, n_local, start, ppc * DSA_PAGE_SIZE, k,
                                             [&](int v) { return keys4[v]; }, out);
}

// ---------------------------------------------------------------- host: shapes, plan, launch
// Cost model constants (see the header comment), in bytes per microsecond and microseconds.
constexpr double kHbmBytesPerUs = 3.6e6;          // the logits kernel's rate at B >= 32
constexpr double kWgBytesPerUs = 17e3;            // one fused warpgroup's streaming rate
constexpr double kFusedWaveUs = 28.0;             // select + emit of a wave of clusters, launch
constexpr double kSelectUsPerKeyPerThread = 0.094; // the select's sweeps, per key of a thread's slice
constexpr double kLogitsFixedUs = 10.0;           // logits kernel: fixed part
constexpr double kTopkFixedUs = 15.0;             // top-k kernel: fixed part
constexpr double kTopkBytesPerUs = 1.7e6;         // top-k kernel: rows x width x 4 B at ~1.7 TB/s (64 / 128 x 128K)

constexpr int kClusterSizes[] = {1, 2, 4, 8, 16};
constexpr int kWarpgroupChoices[] = {4, 2};

struct Shape {
  int H = 0, cluster = 0, warpgroups = 0, ppc = 0;
  size_t smem = 0;
  int active = 0;  // cudaOccupancyMaxActiveClusters
};

struct Launch {
  int64_t token0 = 0, tokens = 0;
  Shape shape;
};

struct Plan {
  bool fused = false;
  std::vector<Launch> launches;  // fused: one or two launches covering [0, T)
  double fused_us = INFINITY, unfused_us = INFINITY;
  std::string why;  // when no fused shape fits
};

template <int H, int W>
void* fused_kernel_ptr() {
  return reinterpret_cast<void*>(indexer_topk_fused_kernel<H, W>);
}
void* fused_kernel(int H, int W) {
  if (H == 64) return W == 4 ? fused_kernel_ptr<64, 4>() : fused_kernel_ptr<64, 2>();
  return W == 4 ? fused_kernel_ptr<32, 4>() : fused_kernel_ptr<32, 2>();
}

size_t fused_smem_bytes(int W, int cluster, int ppc) {
  return (size_t)(W == 4 ? FusedLayout<4>(cluster, ppc).total : FusedLayout<2>(cluster, ppc).total);
}

struct DeviceInfo {
  int device = -1, sms = 0, smem_optin = 0;
};

// Host-side caches of the process, guarded by g_mutex: device attributes and the fused shapes per
// (device, heads, max_pages, forced cluster / warpgroups).
std::mutex g_mutex;

int device_info(DeviceInfo* info) {
  int dev = 0;
  DSA_CUDA_CHECK(cudaGetDevice(&dev));
  static std::vector<DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const DeviceInfo& d : cache)
    if (d.device == dev) {
      *info = d;
      return DSA_OK;
    }
  DeviceInfo d;
  d.device = dev;
  DSA_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
  DSA_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cache.push_back(d);
  *info = d;
  return DSA_OK;
}

// s->active = the clusters of shape *s that can be resident at once (0: it cannot run). Sets the
// kernel's attributes (the largest dynamic shared memory, non-portable cluster sizes) through
// dsa_kernel_attributes, once per device. g_mutex held.
int query_active_clusters(const DeviceInfo& dev, Shape* s) {
  void* fn = fused_kernel(s->H, s->warpgroups);
  const int rc = dsa_kernel_attributes("indexer_topk", fn, (size_t)dev.smem_optin, true);
  if (rc != DSA_OK) return rc;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)s->cluster);
  cfg.blockDim = dim3((unsigned)(kWgThreads * s->warpgroups));
  cfg.dynamicSmemBytes = s->smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)s->cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DSA_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&s->active, fn, &cfg));
  return DSA_OK;
}

struct ShapeSet {
  int device = -1, H = 0, max_pages = 0, force_cluster = 0, force_wg = 0;
  std::vector<Shape> shapes;  // those that fit and can be resident
  std::string why;            // why shapes were left out ("; "-separated)
};

// The fused shapes for this device and problem (forced cluster / warpgroups restrict the list).
int fused_shapes(const DeviceInfo& dev, int H, int max_pages, int force_cluster, int force_wg, ShapeSet* out) {
  static std::vector<ShapeSet> cache;
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const ShapeSet& c : cache)
    if (c.device == dev.device && c.H == H && c.max_pages == max_pages && c.force_cluster == force_cluster &&
        c.force_wg == force_wg) {
      *out = c;
      return DSA_OK;
    }
  ShapeSet set;
  set.device = dev.device;
  set.H = H;
  set.max_pages = max_pages;
  set.force_cluster = force_cluster;
  set.force_wg = force_wg;
  auto skip = [&](int C, int W, const std::string& reason) {
    set.why += (set.why.empty() ? "" : "; ") + std::string("cluster ") + std::to_string(C) + " x " + std::to_string(W) +
               " warpgroups " + reason;
  };
  for (int W : kWarpgroupChoices) {
    if (force_wg && W != force_wg) continue;
    for (int C : kClusterSizes) {
      if (force_cluster && C != force_cluster) continue;
      if (C * kWgThreads * W < kMinThreadsTimesCluster) {
        skip(C, W, "has fewer than the " + std::to_string(kMinThreadsTimesCluster) + " threads the select needs");
        continue;
      }
      Shape s;
      s.H = H;
      s.cluster = C;
      s.warpgroups = W;
      s.ppc = (int)dsa_ceil_div(max_pages > 0 ? max_pages : 1, C);
      s.smem = fused_smem_bytes(W, C, s.ppc);
      if (s.smem > (size_t)dev.smem_optin) {
        skip(C, W, "needs " + std::to_string(s.smem) + " B of shared memory per CTA for " + std::to_string(max_pages) +
                       " pages (max " + std::to_string(dev.smem_optin) + ")");
        continue;
      }
      const int rc = query_active_clusters(dev, &s);
      if (rc != DSA_OK) return rc;
      if (s.active < 1) {
        skip(C, W, "cannot be resident");
        continue;
      }
      set.shapes.push_back(s);
    }
  }
  if (cache.size() >= 256) cache.clear();  // bounded: distinct max_pages values of a process
  cache.push_back(set);
  *out = set;
  return DSA_OK;
}

double row_bytes(int max_pages) { return (double)max_pages * DSA_INDEX_PAGE_BYTES; }

double wave_us(int64_t tokens, const Shape& s, int max_pages) {
  const double rate = fmin(kHbmBytesPerUs, (double)tokens * s.cluster * s.warpgroups * kWgBytesPerUs);
  const double keys_per_thread = (double)s.ppc * DSA_PAGE_SIZE / (kWgThreads * s.warpgroups);
  return (double)tokens * row_bytes(max_pages) / rate + kFusedWaveUs + keys_per_thread * kSelectUsPerKeyPerThread;
}

double fused_us(int64_t tokens, const Shape& s, int max_pages) {
  const int64_t full = tokens / s.active, rem = tokens % s.active;
  return (double)full * wave_us(s.active, s, max_pages) + (rem ? wave_us(rem, s, max_pages) : 0.0);
}

double unfused_us(int64_t tokens, int max_pages) {
  return kLogitsFixedUs + (double)tokens * row_bytes(max_pages) / kHbmBytesPerUs + kTopkFixedUs +
         (double)tokens * max_pages * DSA_PAGE_SIZE * 4.0 / kTopkBytesPerUs;
}

// The plan for `tokens` tokens over the given fused shapes (pure arithmetic).
void choose(const ShapeSet& set, const DsaIndexerTopkParams& p, int64_t tokens, bool has_workspace, Plan* plan) {
  *plan = Plan{};
  plan->why = set.why;
  for (const Shape& x : set.shapes) {
    const double one = fused_us(tokens, x, p.max_pages);
    if (one < plan->fused_us) {
      plan->fused_us = one;
      plan->launches = {Launch{0, tokens, x}};
    }
    const int64_t full = tokens / x.active, rem = tokens % x.active;
    if (full == 0 || rem == 0) continue;
    for (const Shape& y : set.shapes) {  // the remaining tokens as a second launch of another shape
      if (y.active < rem || (y.cluster == x.cluster && y.warpgroups == x.warpgroups)) continue;
      const double two = (double)full * wave_us(x.active, x, p.max_pages) + wave_us(rem, y, p.max_pages);
      if (two < plan->fused_us) {
        plan->fused_us = two;
        plan->launches = {Launch{0, full * x.active, x}, Launch{full * x.active, rem, y}};
      }
    }
  }
  if (p.path != DSA_INDEXER_TOPK_FUSED) plan->unfused_us = unfused_us(tokens, p.max_pages);
  const bool can_fuse = !plan->launches.empty();
  switch (p.path) {
    case DSA_INDEXER_TOPK_FUSED: plan->fused = can_fuse; break;
    case DSA_INDEXER_TOPK_UNFUSED: plan->fused = false; break;
    default: plan->fused = can_fuse && (!has_workspace || plan->fused_us <= plan->unfused_us); break;
  }
}

// The fused shapes of p (empty for the bf16 pool or path UNFUSED). DSA_ERR_CUDA on CUDA errors.
int shapes_for(const DsaIndexerTopkParams& p, ShapeSet* set) {
  *set = ShapeSet{};
  if (p.format != DSA_CACHE_FP8 || p.path == DSA_INDEXER_TOPK_UNFUSED) return DSA_OK;
  DeviceInfo dev;
  const int rc = device_info(&dev);
  if (rc != DSA_OK) return rc;
  return fused_shapes(dev, p.num_heads, p.max_pages, p.cluster_size, p.warpgroups, set);
}

int make_plan(const DsaIndexerTopkParams& p, bool has_workspace, Plan* plan) {
  ShapeSet set;
  const int rc = shapes_for(p, &set);
  if (rc != DSA_OK) return rc;
  choose(set, p, p.num_tokens, has_workspace, plan);
  return DSA_OK;
}

size_t logits_bytes(int64_t tokens, int max_pages) {
  return (size_t)tokens * max_pages * DSA_PAGE_SIZE * sizeof(float);
}
constexpr size_t kWorkspaceAlign = 256;
size_t align_up(size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }
size_t unfused_workspace_bytes(int64_t tokens, int max_pages, int k) {
  return align_up(logits_bytes(tokens, max_pages)) +
         dsa_topk_translate_workspace_size(tokens, (int64_t)max_pages * DSA_PAGE_SIZE, k);
}

template <int H, int W>
int launch_fused_shape(const DsaIndexerTopkParams& p, const Launch& l, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(l.tokens * l.shape.cluster));
  cfg.blockDim = dim3(kWgThreads * W);
  cfg.dynamicSmemBytes = l.shape.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)l.shape.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1] = dsa_pdl_attr();
  cfg.attrs = attr;
  cfg.numAttrs = 2;
  DSA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, indexer_topk_fused_kernel<H, W>, p, l.token0, l.shape.ppc,
                                    kL2EvictFirst));  // each page is read once
  return DSA_OK;
}

int launch_fused(const DsaIndexerTopkParams& p, const Plan& plan, cudaStream_t stream) {
  for (const Launch& l : plan.launches) {
    if (l.tokens == 0) continue;
    const bool w4 = l.shape.warpgroups == 4;
    int rc;
    if (l.shape.H == 64) rc = w4 ? launch_fused_shape<64, 4>(p, l, stream) : launch_fused_shape<64, 2>(p, l, stream);
    else rc = w4 ? launch_fused_shape<32, 4>(p, l, stream) : launch_fused_shape<32, 2>(p, l, stream);
    if (rc != DSA_OK) return rc;
  }
  return DSA_OK;
}

int launch_unfused(const DsaIndexerTopkParams& p, cudaStream_t stream) {
  float* logits = static_cast<float*>(p.workspace);
  const int64_t width = (int64_t)p.max_pages * DSA_PAGE_SIZE;
  DsaIndexerLogitsParams lp = {};
  lp.q = p.q;
  lp.weights = p.weights;
  lp.pool = p.pool;
  lp.page_table = p.page_table;
  lp.req_idx = p.req_idx;
  lp.seq_lens = p.seq_lens;
  lp.logits = logits;
  lp.num_tokens = p.num_tokens;
  lp.num_heads = p.num_heads;
  lp.max_pages = p.max_pages;
  lp.logits_stride = width;
  lp.format = p.format;
  int rc = dsa_launch_indexer_logits(&lp, stream);
  if (rc != DSA_OK) return rc;
  DsaTopkTranslateParams tp = {};
  tp.logits = logits;
  tp.lengths = p.seq_lens;
  tp.page_table = p.page_table;
  tp.req_idx = p.req_idx;
  tp.slots = p.slots;
  tp.indices = p.indices;
  tp.rows = p.num_tokens;
  tp.logits_stride = width;
  tp.k = p.k;
  tp.max_pages = p.max_pages;
  tp.workspace = static_cast<uint8_t*>(p.workspace) + align_up(logits_bytes(p.num_tokens, p.max_pages));
  return dsa_launch_topk_translate(&tp, stream);
}

int validate(const DsaIndexerTopkParams* p) {
  DSA_CHECK_ARG(p != nullptr, "indexer_topk: params is NULL");
  DSA_CHECK_ARG(p->num_tokens >= 0 && p->num_tokens <= INT32_MAX, "indexer_topk: num_tokens=%lld out of range",
                (long long)p->num_tokens);
  DSA_CHECK_ARG(p->max_pages >= 0 && (int64_t)p->max_pages * DSA_PAGE_SIZE <= INT32_MAX,
                "indexer_topk: max_pages=%d out of range", p->max_pages);
  DSA_CHECK_ARG(p->k >= 1, "indexer_topk: k=%d < 1", p->k);
  DSA_CHECK_ARG(p->k <= dsa_topk::kMaxTopk, "indexer_topk: k=%d > %d (the select stages a row's selection in shared memory)",
                p->k, dsa_topk::kMaxTopk);
  DSA_CHECK_ARG(p->path >= DSA_INDEXER_TOPK_AUTO && p->path <= DSA_INDEXER_TOPK_UNFUSED,
                "indexer_topk: path=%d unsupported (0 = auto, 1 = fused, 2 = unfused)", p->path);
  DSA_CHECK_SUPPORTED(p->num_heads == 64 || p->num_heads == 32, "indexer_topk: num_heads=%d unsupported (64, 32)",
                      p->num_heads);
  DSA_CHECK_SUPPORTED(p->format == DSA_CACHE_FP8 || p->format == DSA_CACHE_BF16,
                      "indexer_topk: format=%d unsupported (0 = DSA_CACHE_FP8, 1 = DSA_CACHE_BF16)", p->format);
  DSA_CHECK_SUPPORTED(p->format == DSA_CACHE_FP8 || p->path != DSA_INDEXER_TOPK_FUSED,
                      "indexer_topk: the fused path needs the fp8 indexer pool (format=%d)", p->format);
  DSA_CHECK_SUPPORTED(p->cluster_size == 0 || p->cluster_size == 1 || p->cluster_size == 2 || p->cluster_size == 4 ||
                          p->cluster_size == 8 || p->cluster_size == 16,
                      "indexer_topk: cluster_size=%d unsupported (0 = auto, 1, 2, 4, 8, 16)", p->cluster_size);
  DSA_CHECK_SUPPORTED(p->warpgroups == 0 || p->warpgroups == 2 || p->warpgroups == 4,
                      "indexer_topk: warpgroups=%d unsupported (0 = auto, 2, 4)", p->warpgroups);
  if (p->num_tokens == 0) return DSA_OK;
  DSA_CHECK_ARG(p->q && p->weights && p->pool && p->page_table && p->req_idx && p->seq_lens && p->slots,
                "indexer_topk: NULL pointer (q=%p weights=%p pool=%p page_table=%p req_idx=%p seq_lens=%p "
                "slots=%p)",
                p->q, (const void*)p->weights, p->pool, (const void*)p->page_table, (const void*)p->req_idx,
                (const void*)p->seq_lens, (const void*)p->slots);
  DSA_CHECK_ARG(reinterpret_cast<uintptr_t>(p->pool) % 16 == 0 && reinterpret_cast<uintptr_t>(p->q) % 16 == 0,
                "indexer_topk: pool=%p and q=%p must be 16-byte aligned", p->pool, p->q);
  DSA_CHECK_ARG(reinterpret_cast<uintptr_t>(p->workspace) % 16 == 0,
                "indexer_topk: workspace=%p must be 16-byte aligned", p->workspace);
  DSA_CHECK_ARG(p->num_tokens * kMaxCluster <= INT32_MAX, "indexer_topk: num_tokens=%lld too many",
                (long long)p->num_tokens);
  return DSA_OK;
}

std::string describe(const DsaIndexerTopkParams& p, const Plan& plan) {
  char line[256];
  std::string s;
  if (plan.fused) {
    s = "fused";
    for (const Launch& l : plan.launches) {
      snprintf(line, sizeof(line), " [tokens %lld+%lld: cluster=%d warpgroups=%d pages/cta=%d smem=%zu active=%d]",
               (long long)l.token0, (long long)l.tokens, l.shape.cluster, l.shape.warpgroups, l.shape.ppc,
               l.shape.smem, l.shape.active);
      s += line;
    }
  } else {
    s = p.format == DSA_CACHE_FP8 ? "unfused" : "unfused (bf16 pool)";
  }
  snprintf(line, sizeof(line), "; estimate fused %.1f us, unfused %.1f us", plan.fused_us, plan.unfused_us);
  s += line;
  if (!plan.fused && p.format == DSA_CACHE_FP8 && plan.launches.empty() && !plan.why.empty())
    s += "; no fused shape: " + plan.why;
  return s;
}

}  // namespace

extern "C" size_t dsa_indexer_topk_workspace_size(int64_t num_tokens, int num_heads, int max_pages, int k, int format,
                                                  int path) {
  if (num_tokens <= 0 || max_pages <= 0) return 0;
  if (path == DSA_INDEXER_TOPK_FUSED) return 0;
  if (path == DSA_INDEXER_TOPK_UNFUSED || format != DSA_CACHE_FP8)
    return unfused_workspace_bytes(num_tokens, max_pages, k);
  // AUTO: the largest token count <= num_tokens that the plan runs unfused (given a workspace).
  DsaIndexerTopkParams p = {};
  p.num_heads = num_heads;
  p.max_pages = max_pages;
  p.k = k;
  p.format = format;
  p.path = DSA_INDEXER_TOPK_AUTO;
  ShapeSet set;
  if (shapes_for(p, &set) != DSA_OK) return unfused_workspace_bytes(num_tokens, max_pages, k);
  for (int64_t t = num_tokens; t >= 1; --t) {
    Plan plan;
    choose(set, p, t, true, &plan);
    if (!plan.fused) return unfused_workspace_bytes(t, max_pages, k);
  }
  return 0;
}

extern "C" int dsa_indexer_topk_describe(const DsaIndexerTopkParams* p, char* buf, size_t len) {
  int rc = validate(p);
  if (rc != DSA_OK) return rc;
  Plan plan;
  rc = make_plan(*p, p->workspace != nullptr, &plan);
  if (rc != DSA_OK) return rc;
  if (buf && len) snprintf(buf, len, "%s", describe(*p, plan).c_str());
  return DSA_OK;
}

extern "C" int dsa_launch_indexer_topk(const DsaIndexerTopkParams* p, cudaStream_t stream) {
  int rc = validate(p);
  if (rc != DSA_OK) return rc;
  if (p->num_tokens == 0) return DSA_OK;
  Plan plan;
  rc = make_plan(*p, p->workspace != nullptr, &plan);
  if (rc != DSA_OK) return rc;
  if (plan.fused) return launch_fused(*p, plan, stream);
  DSA_CHECK_SUPPORTED(p->path != DSA_INDEXER_TOPK_FUSED,
                      "indexer_topk: no fused shape for num_heads=%d max_pages=%d: %s", p->num_heads, p->max_pages,
                      plan.why.c_str());
  DSA_CHECK_ARG(p->workspace != nullptr,
                "indexer_topk: the unfused path (%s) needs workspace (dsa_indexer_topk_workspace_size() = %zu bytes)",
                describe(*p, plan).c_str(),
                unfused_workspace_bytes(p->num_tokens, p->max_pages, p->k));
  return launch_unfused(*p, stream);
}
