// DSA-TRT kernels: paged indexer logits (DESIGN.md §3, plugins/reference.py indexer_logits).
//
//   logits[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]) * k_scale[s]   s < seq_len[t]
//                = -inf                                               seq_len[t] <= s < max_pages*64
//
// fp8 path (memory bound: 132 B of key per 2*H*128 FLOP). One CTA = one warpgroup (128 threads)
// scores one query token against a run of up to 32 pages of its request, with the page scoring
// of indexer_tile.cuh (4 x wgmma m64nHk32 e4m3, A = the page's keys in registers, B = q in shared
// memory; shared with the fused indexer_topk.cu so both give bitwise the same scores). Each thread
// cp.async-copies its own 16-byte chunks of a page into a 4-stage shared-memory ring (3 pages in
// flight per CTA, no block barriers) and reads them back as its A fragment.
//
// bf16 path (exact mode): plain CUDA cores, one thread per key, fp32 accumulation. Correctness
// only.
#include <cuda_bf16.h>
#include <math_constants.h>

#include "common.cuh"
#include "indexer_tile.cuh"

namespace {

using namespace dsa_indexer;

constexpr int kThreads = kWgThreads;    // one warpgroup
constexpr int kMaxPagesPerCta = 32;     // page ids of a CTA live in one warp's lanes
constexpr int kCtasPerSm = 5;

template <int H>
constexpr size_t fp8_smem_bytes() {
  return 1024 + H * DSA_INDEX_DIM + kStages * sizeof(Stage);  // alignment slack, q tile, stages
}

template <int H>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    indexer_logits_fp8_kernel(const DsaIndexerLogitsParams p, const int pages_per_cta) {
  dsa_pdl_wait();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = align_smem_1024(smem_raw);
  Stage* stages = reinterpret_cast<Stage*>(sq + H * DSA_INDEX_DIM);

  const int t = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31;
  const int max_cols = p.max_pages * DSA_PAGE_SIZE;
  const int seq_len = min(max(p.seq_lens[t], 0), max_cols);
  const int valid_pages = (seq_len + DSA_PAGE_SIZE - 1) / DSA_PAGE_SIZE;
  const int p_begin = blockIdx.y * pages_per_cta;
  const int p_end = min(p_begin + pages_per_cta, p.max_pages);
  const int p_valid_end = min(p_end, valid_pages);
  float* out = p.logits + (int64_t)t * p.logits_stride;

  for (int col = max(p_begin, p_valid_end) * DSA_PAGE_SIZE + tid; col < p_end * DSA_PAGE_SIZE; col += kThreads)
    out[col] = -CUDART_INF_F;
  const int n = p_valid_end - p_begin;
  if (n <= 0) return;

  // Lane i of every warp holds the page id of page p_begin + i.
  const int req = p.req_idx[t];
  const int my_page = lane < n ? p.page_table[(int64_t)req * p.max_pages + p_begin + lane] : 0;

  const uint8_t* pool = static_cast<const uint8_t*>(p.pool);
  const FragOffsets fo = frag_offsets(tid);
  auto issue = [&](int i) {  // page i -> stage i % kStages (always commits a group)
    if (i < n) {
      const int page = __shfl_sync(0xffffffffu, my_page, i);
      issue_page(stages[i % kStages], pool + (int64_t)page * DSA_INDEX_PAGE_BYTES, fo, tid);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // q[t] -> shared (overlaps the first pages), head weights -> registers.
  stage_q<H, kThreads>(sq, static_cast<const uint8_t*>(p.q) + (int64_t)t * H * DSA_INDEX_DIM, tid);
  float wr[H / 8][2];
  load_head_weights<H>(wr, p.weights + (int64_t)t * H, tid);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t desc = make_desc_sw128(sq);

  const int row = score_row(tid);
  const bool stores = stores_score(tid);
  float d[H / 2];
  for (int i = 0; i < n; ++i) {
    cp_async_wait<kStages - 2>();  // this thread's copies of page i have landed
    const PageFrag f = read_frag(stages[i % kStages], tid);
    issue(i + kStages - 1);  // into the stage read (and consumed) in iteration i - 1

    const float score = score_page<H>(d, f, desc, wr, tid);
    if (stores) {
      const int col = (p_begin + i) * DSA_PAGE_SIZE + row;
      out[col] = col < seq_len ? score : -CUDART_INF_F;
    }
  }
  cp_async_wait<0>();
}

// Exact mode: bf16 q and keys, fp32 accumulation on CUDA cores. One CTA = one (token, page).
template <int H>
__global__ void __launch_bounds__(DSA_PAGE_SIZE) indexer_logits_bf16_kernel(const DsaIndexerLogitsParams p) {
  __shared__ float sq[H][DSA_INDEX_DIM];
  const int t = blockIdx.x, page_idx = blockIdx.y, row = threadIdx.x;
  const int max_cols = p.max_pages * DSA_PAGE_SIZE;
  const int seq_len = min(max(p.seq_lens[t], 0), max_cols);
  const int col = page_idx * DSA_PAGE_SIZE + row;
  float* out = p.logits + (int64_t)t * p.logits_stride;
  if (page_idx * DSA_PAGE_SIZE >= seq_len) {  // uniform over the CTA
    out[col] = -CUDART_INF_F;
    return;
  }
  const __nv_bfloat16* qg = static_cast<const __nv_bfloat16*>(p.q) + (int64_t)t * H * DSA_INDEX_DIM;
  for (int i = row; i < H * DSA_INDEX_DIM; i += DSA_PAGE_SIZE) sq[i / DSA_INDEX_DIM][i % DSA_INDEX_DIM] = __bfloat162float(qg[i]);
  __syncthreads();
  const int req = p.req_idx[t];
  const int64_t page = p.page_table[(int64_t)req * p.max_pages + page_idx];
  const __nv_bfloat16* key = static_cast<const __nv_bfloat16*>(p.pool) + (page * DSA_PAGE_SIZE + row) * DSA_INDEX_DIM;
  float acc[H];
#pragma unroll
  for (int h = 0; h < H; ++h) acc[h] = 0.f;
  for (int d0 = 0; d0 < DSA_INDEX_DIM; d0 += 8) {
    float kv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) kv[e] = __bfloat162float(key[d0 + e]);
#pragma unroll
    for (int h = 0; h < H; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h] = fmaf(sq[h][d0 + e], kv[e], acc[h]);
  }
  float r = 0.f;
  const float* wt = p.weights + (int64_t)t * H;
#pragma unroll
  for (int h = 0; h < H; ++h) r = fmaf(wt[h], fmaxf(acc[h], 0.f), r);
  out[col] = col < seq_len ? r : -CUDART_INF_F;
}

int num_sms() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

template <int H, int kFormat>
int launch(const DsaIndexerLogitsParams& p, cudaStream_t stream) {
  if constexpr (kFormat == DSA_CACHE_FP8) {
    const int64_t work = p.num_tokens * p.max_pages;
    int64_t ppc = dsa_ceil_div(work, (int64_t)num_sms() * kCtasPerSm);
    ppc = ppc < 1 ? 1 : (ppc > kMaxPagesPerCta ? kMaxPagesPerCta : ppc);
    const int64_t splits = dsa_ceil_div(p.max_pages, ppc);
    DSA_CHECK_SUPPORTED(splits <= 65535, "indexer_logits: max_pages=%d too large (page splits %lld > 65535)",
                        p.max_pages, (long long)splits);
    const dim3 grid((unsigned)p.num_tokens, (unsigned)splits);
    constexpr size_t smem = fp8_smem_bytes<H>();
    static_assert(smem <= 48 * 1024, "fp8 logits kernel: keep under the default dynamic shared memory limit");
    DSA_CUDA_CHECK(dsa_launch_pdl(indexer_logits_fp8_kernel<H>, grid, dim3(kThreads), smem, stream, p, (int)ppc));
  } else {
    DSA_CHECK_SUPPORTED(p.max_pages <= 65535, "indexer_logits: bf16 mode max_pages=%d > 65535", p.max_pages);
    const dim3 grid((unsigned)p.num_tokens, (unsigned)p.max_pages);
    indexer_logits_bf16_kernel<H><<<grid, DSA_PAGE_SIZE, 0, stream>>>(p);
  }
  DSA_CUDA_CHECK_LAUNCH();
  return DSA_OK;
}

}  // namespace

extern "C" int dsa_launch_indexer_logits(const DsaIndexerLogitsParams* p, cudaStream_t stream) {
  DSA_CHECK_ARG(p != nullptr, "indexer_logits: params is NULL");
  DSA_CHECK_ARG(p->num_tokens >= 0 && p->num_tokens <= INT32_MAX, "indexer_logits: num_tokens=%lld out of range",
                (long long)p->num_tokens);
  DSA_CHECK_ARG(p->max_pages >= 0 && (int64_t)p->max_pages * DSA_PAGE_SIZE <= INT32_MAX,
                "indexer_logits: max_pages=%d out of range", p->max_pages);
  if (p->num_tokens == 0 || p->max_pages == 0) return DSA_OK;
  DSA_CHECK_ARG(p->q && p->weights && p->pool && p->page_table && p->req_idx && p->seq_lens && p->logits,
                "indexer_logits: NULL pointer (q=%p weights=%p pool=%p page_table=%p req_idx=%p seq_lens=%p "
                "logits=%p)",
                p->q, (const void*)p->weights, p->pool, (const void*)p->page_table, (const void*)p->req_idx,
                (const void*)p->seq_lens, (const void*)p->logits);
  DSA_CHECK_ARG(p->logits_stride >= (int64_t)p->max_pages * DSA_PAGE_SIZE,
                "indexer_logits: logits_stride=%lld < max_pages*64=%lld", (long long)p->logits_stride,
                (long long)p->max_pages * DSA_PAGE_SIZE);
  DSA_CHECK_ARG(reinterpret_cast<uintptr_t>(p->pool) % 16 == 0 && reinterpret_cast<uintptr_t>(p->q) % 16 == 0,
                "indexer_logits: pool=%p and q=%p must be 16-byte aligned", p->pool, p->q);
  DSA_DISPATCH_INT2("indexer_logits", "num_heads", p->num_heads, H, 64, 32,
                    DSA_DISPATCH_FORMAT("indexer_logits", p->format, kFormat, return launch<H, kFormat>(*p, stream)));
  return DSA_OK;
}
