// DSA-TRT kernels: paged indexer logits (DESIGN.md §3, plugins/reference.py indexer_logits).
//
//   logits[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]) * k_scale[s]   s < seq_len[t]
//                = -inf                                               seq_len[t] <= s < max_pages*64
//
// fp8 path. One CTA = one warpgroup (128 threads) scores a group of TT query tokens against a run
// of pages of their request, with the page scoring of indexer_tile.cuh (4 x wgmma m64n(TT*H)k32
// e4m3, A = the page's keys in registers, B = the tokens' q in shared memory; TT = 1 is shared
// with the fused indexer_topk.cu so both give bitwise the same scores). Each thread cp.async-copies
// its own 16-byte chunks of a page into a 4-stage shared-memory ring (3 pages in flight per CTA, no
// block barriers) and reads them back as its A fragment. The page ids come 32 at a time (a warp's
// lanes), the next 32 loaded while the current ones are used.
//   TT = 1 (decode: one token per request): memory bound, 132 B of key per 2*H*128 FLOP.
//   TT = 2 (the launcher's choice when there are more tokens than requests: prefill, MTP decode):
//     consecutive tokens of one request share every page they both see, so a page is copied and
//     read once per pair (one token per CTA re-read each page per token: prefill 4096 x 32K took
//     2858 us, pairs 2163). What bounds the pair kernel is shared memory (ncu: L1 76%, tensor
//     pipe 49%, issue 47%): per page-pair the wgmma reads q, 16 KB, as its B operand, and the
//     keys pass through shared memory twice (cp.async in, LDS out: 16.5 KB), ~260 cycles at 128
//     B/cycle against 256 cycles of QGMMA. A pair whose tokens belong to different requests (a
//     request boundary) runs two passes, one per token.
//
// bf16 path (exact mode): plain CUDA cores, one thread per key, fp32 accumulation. Correctness
// only.
#include <cuda_bf16.h>
#include <math_constants.h>

#include "common.cuh"
#include "indexer_tile.cuh"

namespace {

using namespace dsa_indexer;

constexpr int kThreads = kWgThreads;  // one warpgroup

template <int H, int TT>
struct Fp8Shape {
  static constexpr int kMinCtasPerSm = TT == 1 ? 5 : 3;  // registers: TT*H/2 accumulators
  static constexpr size_t kSmem = 1024 + TT * H * DSA_INDEX_DIM + kStages * sizeof(Stage);  // slack, q, ring
};

template <int H, int TT>
__global__ void __launch_bounds__(kThreads, (Fp8Shape<H, TT>::kMinCtasPerSm))
    indexer_logits_fp8_kernel(const DsaIndexerLogitsParams p, const int pages_per_cta, const uint64_t l2_policy) {
  // (4 tokens per CTA, N = 256, fit 2 CTAs per SM and took 2265 us on the prefill shape against
  // 2163 for pairs at 3 CTAs per SM: fewer warps to hide the wgmma and shared-memory latency.)
  static_assert(TT == 1 || TT == 2, "one or two tokens per CTA");
  dsa_pdl_wait();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = align_smem_1024(smem_raw);
  Stage* stages = reinterpret_cast<Stage*>(sq + TT * H * DSA_INDEX_DIM);

  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t t0 = (int64_t)blockIdx.x * TT;
  const int max_cols = p.max_pages * DSA_PAGE_SIZE;
  const int p_begin = blockIdx.y * pages_per_cta;
  const int p_end = min(p_begin + pages_per_cta, p.max_pages);

  bool valid[TT];
  int seq_len[TT], req[TT], page_end[TT];  // page_end: this CTA's last visible page + 1 (or p_begin)
#pragma unroll
  for (int u = 0; u < TT; ++u) {
    valid[u] = t0 + u < p.num_tokens;
    seq_len[u] = valid[u] ? min(max(p.seq_lens[t0 + u], 0), max_cols) : 0;
    req[u] = valid[u] ? p.req_idx[t0 + u] : -1;
    page_end[u] = max(p_begin, min(p_end, (seq_len[u] + DSA_PAGE_SIZE - 1) / DSA_PAGE_SIZE));
    if (valid[u]) {
      float* out = p.logits + (t0 + u) * p.logits_stride;
      for (int col = page_end[u] * DSA_PAGE_SIZE + tid; col < p_end * DSA_PAGE_SIZE; col += kThreads)
        out[col] = -CUDART_INF_F;
    }
  }
  // One pass per distinct request of the group: pass u (u the first token of its request, its
  // leader) scores the pages of req[u] for every token it leads. Usually one pass.
  int leader[TT];
#pragma unroll
  for (int u = 0; u < TT; ++u) {
    leader[u] = u;
#pragma unroll
    for (int w = u - 1; w >= 0; --w)
      if (valid[w] && req[w] == req[u]) leader[u] = w;
  }
  auto pass_pages = [&](int pass) {  // pages of the pass: [p_begin, p_begin + n)
    int e = p_begin;
#pragma unroll
    for (int u = 0; u < TT; ++u)
      if (leader[u] == pass) e = max(e, page_end[u]);
    return e - p_begin;
  };
  int pass = 0;
  while (pass < TT && pass_pages(pass) <= 0) ++pass;  // the first pass with pages
  if (pass == TT) return;

  // This lane's output: key row `row` of token `tok` (TT = 2: lanes c of each quad with c & 2 store
  // the second token, the others the first; TT = 1: lanes c < 2 store token 0).
  const int tok = TT == 1 ? 0 : (lane & 2) >> 1;
  auto pick = [&](const auto (&a)[TT]) { return tok ? a[TT - 1] : a[0]; };  // a[tok], in registers
  const int row = score_row(tid);
  const bool lane_stores = TT > 1 || stores_score(tid);
  // page i of the CTA: out_row[64 i], shown where 64 i < visible
  float* const out_row = p.logits + (t0 + tok) * p.logits_stride + p_begin * DSA_PAGE_SIZE + row;
  const int visible = pick(seq_len) - (p_begin * DSA_PAGE_SIZE + row);

  // TT = 1 (copies with a cache policy): the ring as one warpgroup's of a CTA of several. tid /
  // kWgThreads is 0, but ptxas then does not treat the ring's shared address as CTA-uniform; where
  // it does, ptxas 13.0 addresses the copies by a uniform register and leaves the LDGSTS's
  // descriptor register unwritten (illegal instruction on the H200).
  const PageRing pr = make_page_ring(TT == 1 ? stages + (tid / kWgThreads) * kStages : stages, p.pool, tid, l2_policy);
  // Page ids of the pass, 32 at a time in the lanes of every warp: ids_cur for issue indices
  // [32m, 32m + 32), ids_next for the following 32 (already on its way).
  const int32_t* ids_row = nullptr;
  int n = 0, ids_cur = 0, ids_next = 0;
  auto start_pass = [&](int ps) {
    n = pass_pages(ps);
    int r = req[0];
#pragma unroll
    for (int u = 1; u < TT; ++u)
      if (u == ps) r = req[u];
    ids_row = p.page_table + (int64_t)r * p.max_pages + p_begin;
    ids_cur = lane < n ? ids_row[lane] : 0;
    ids_next = lane + 32 < n ? ids_row[lane + 32] : 0;
  };
  auto issue = [&](int i) {  // page i -> stage i % kStages (always commits a group)
    if (i < n) {
      if ((i & 31) == 0 && i > 0) {
        ids_cur = ids_next;
        ids_next = i + 32 + lane < n ? ids_row[i + 32 + lane] : 0;
      }
      const int page = __shfl_sync(0xffffffffu, ids_cur, i & 31);
      ring_issue<TT == 1>(pr, i % kStages, page);
    }
    cp_async_commit();
  };

  start_pass(pass);
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // q of the tokens -> shared (overlaps the first pages), head weights -> registers.
  float wr[TT][H / 8][2];
#pragma unroll
  for (int u = 0; u < TT; ++u) {
    if (valid[u]) {
      stage_q<H, kThreads>(sq + u * H * DSA_INDEX_DIM,
                           static_cast<const uint8_t*>(p.q) + (t0 + u) * H * DSA_INDEX_DIM, tid);
      load_head_weights<H>(wr[u], p.weights + (t0 + u) * H, tid);
    } else {
#pragma unroll
      for (int j = 0; j < H / 8; ++j) wr[u][j][0] = wr[u][j][1] = 0.f;
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t desc = make_desc_sw128(sq);

  for (;;) {
    const bool stores = lane_stores && pick(valid) && pick(leader) == pass;
    auto store = [&](int i, float score) {
      if (stores) out_row[i * DSA_PAGE_SIZE] = i * DSA_PAGE_SIZE < visible ? score : -CUDART_INF_F;
    };
    auto next_frag = [&](int i) {  // page i's fragment; page i + kStages - 1 into the freed stage
      cp_async_wait<kStages - 2>();  // this thread's copies of page i have landed
      const PageFrag f = ring_read(pr, i % kStages);
      issue(i + kStages - 1);  // into the stage read in an earlier iteration
      return f;
    };
    if constexpr (TT == 1) {
      float d[H / 2];
      for (int i = 0; i < n; ++i) store(i, score_page<H>(d, next_frag(i), desc, wr[0], tid));
    } else {
      float d[TT * H / 2];
      for (int i = 0; i < n; ++i) {
        const PageFrag f = next_frag(i);
        mma_page_group<H, TT>(d, f, desc);
        wgmma_wait<0>();
        float score[TT / 2];  // TT = 2: one score per lane
        reduce_page_group<H, TT>(d, f.scale, wr, tid, score);
        store(i, score[0]);
      }
    }
    cp_async_wait<0>();
    do ++pass; while (pass < TT && pass_pages(pass) <= 0);
    if (pass >= TT) break;
    start_pass(pass);
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue(i);
  }
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

// Pages per CTA for `groups` token groups over max_pages pages with `resident` CTAs on the GPU
// at once (measured on the H200, benchmarks/RESULTS.md):
//   TT = 1 (decode, memory bound): the work spread over every resident CTA, at most 16 pages per
//     CTA. Many short CTAs balance the SMs through the block scheduler: at 128K, B = 128, 16 pages
//     per CTA took 579 us, 32 pages 584, one wave of 410 pages 614.
//   TT = 2 (pairs, compute bound): a grid of N CTAs of ppc pages takes about ceil(N / resident)
//     waves of (ppc + ~2 pages of per-CTA cost: q staging, the first pages' latency); the cheapest
//     split wins (the fewest CTAs on a tie). Prefill 4096 x 32K: 2401 us against 2476 for 32
//     pages per CTA.
constexpr int kMaxDecodePagesPerCta = 16;
constexpr int kCtaFixedPages = 2;
constexpr int kMaxSplits = 1024;
template <int TT>
int64_t pages_per_cta(int64_t groups, int max_pages, int64_t resident) {
  if (TT == 1) {
    const int64_t ppc = dsa_ceil_div(groups * max_pages, resident);
    return ppc < 1 ? 1 : (ppc > kMaxDecodePagesPerCta ? kMaxDecodePagesPerCta : ppc);
  }
  int64_t best_ppc = max_pages, best_cost = INT64_MAX, prev_ppc = -1;
  for (int s = 1; s <= max_pages && s <= kMaxSplits; ++s) {
    const int64_t ppc = dsa_ceil_div(max_pages, s);
    if (ppc == prev_ppc) continue;
    prev_ppc = ppc;
    const int64_t ctas = groups * dsa_ceil_div(max_pages, ppc);
    const int64_t cost = dsa_ceil_div(ctas, resident) * (ppc + kCtaFixedPages);
    if (cost < best_cost) best_cost = cost, best_ppc = ppc;
  }
  return best_ppc;
}

template <int H, int TT>
int launch_fp8(const DsaIndexerLogitsParams& p, cudaStream_t stream) {
  using Shape = Fp8Shape<H, TT>;
  static int per_sm = 0;  // resident CTAs per SM (occupancy of this instantiation)
  if (per_sm == 0) {
    DSA_CUDA_CHECK(cudaFuncSetAttribute(indexer_logits_fp8_kernel<H, TT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)Shape::kSmem));
    int n = 0;
    DSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, indexer_logits_fp8_kernel<H, TT>, kThreads,
                                                                 Shape::kSmem));
    DSA_CHECK_SUPPORTED(n > 0, "indexer_logits: the fp8 kernel (heads=%d, %d tokens per CTA) does not fit an SM", H, TT);
    per_sm = n;
  }
  const int64_t groups = dsa_ceil_div(p.num_tokens, TT);
  const int64_t ppc = pages_per_cta<TT>(groups, p.max_pages, (int64_t)num_sms() * per_sm);
  const int64_t splits = dsa_ceil_div(p.max_pages, ppc);
  DSA_CHECK_SUPPORTED(splits <= 65535, "indexer_logits: max_pages=%d too large (page splits %lld > 65535)",
                      p.max_pages, (long long)splits);
  const dim3 grid((unsigned)groups, (unsigned)splits);
  // Decode reads each page once: evict-first (pairs copy without a policy, ring_issue<false>).
  DSA_CUDA_CHECK(dsa_launch_pdl(indexer_logits_fp8_kernel<H, TT>, grid, dim3(kThreads), Shape::kSmem, stream, p,
                                (int)ppc, kL2EvictFirst));
  return DSA_OK;
}

template <int H, int kFormat>
int launch(const DsaIndexerLogitsParams& p, cudaStream_t stream) {
  if constexpr (kFormat == DSA_CACHE_FP8) {
    // Pairs of tokens when there are more tokens than requests (some tokens share a request).
    const bool pairs = p.num_requests > 0 && p.num_tokens > p.num_requests;
    const int rc = pairs ? launch_fp8<H, 2>(p, stream) : launch_fp8<H, 1>(p, stream);
    if (rc != DSA_OK) return rc;
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
