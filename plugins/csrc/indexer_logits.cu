// DSA-TRT kernels: paged indexer logits (docs/architecture.md §4, plugins/reference.py indexer_logits).
//
//   logits[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]) * k_scale[s]   s < seq_len[t]
//                = -inf                                               seq_len[t] <= s < max_pages*64
//
// fp8 path. One CTA = one warpgroup (128 threads) scores a group of TT query tokens against a run
// of pages of their request, with the page scoring of indexer_tile.cuh (4 x wgmma m64n(TT*H)k32
// e4m3, A = the page's keys in registers, B = the tokens' q in shared memory). Each thread cp.async-copies
// its own 16-byte chunks of a page into a 4-stage shared-memory ring (3 pages in flight per CTA, no
// block barriers) and reads them back as its A fragment. The page ids come 32 at a time (a warp's
// lanes), the next 32 loaded while the current ones are used.
//   TT = 1 (decode: one token per request): memory bound, 132 B of key per 2*H*128 FLOP.
//   TT = 2 (the launcher's choice when there are more tokens than requests but fewer than 64 per
//     request: MTP decode, steps mixing decode and prefill, short prefills): consecutive tokens
//     of one request share every page they both see, so a page is copied and read once per pair
//     (one token per CTA re-reads each page per token). What bounds the pair kernel is shared
//     memory (ncu: L1 busier than the tensor pipe or the issue slots): per page-pair the wgmma
//     reads q, 16 KB, as its B operand, and the keys pass through shared memory twice (cp.async in, LDS
//     out: 16.5 KB), ~260 cycles at 128 B/cycle against 256 cycles of QGMMA. A pair whose tokens
//     belong to different requests (a request boundary) runs two passes, one per token.
// Token groups (64 or more tokens per request on average: prefill): indexer_logits_group_kernel
// below, 8 tokens per CTA, warp-specialised, both wgmma operands in shared memory.
//
// bf16 path (exact mode): plain CUDA cores, one thread per key, fp32 accumulation. Correctness
// only.
#include <algorithm>

#include <cuda_bf16.h>
#include <math_constants.h>

#include "common.cuh"
#include "indexer_tile.cuh"
#include "sparse_mla_ptx.cuh"

namespace {

using namespace dsa_indexer;

constexpr int kThreads = kWgThreads;  // one warpgroup

// A request's pages over blockIdx.y: splits y < big of ppc pages, then splits of small_ppc pages
// (the launcher's decode plan ends with a wave of smaller CTAs; big = all splits elsewhere).
struct PageSplits {
  int ppc, big, small_ppc;
  __device__ __forceinline__ int begin(int y) const { return y < big ? y * ppc : big * ppc + (y - big) * small_ppc; }
  __device__ __forceinline__ int size(int y) const { return y < big ? ppc : small_ppc; }
};

template <int H, int TT>
struct Fp8Shape {
  static constexpr int kMinCtasPerSm = TT == 1 ? 5 : 3;  // registers: TT*H/2 accumulators
  static constexpr size_t kSmem = 1024 + TT * H * DSA_INDEX_DIM + kStages * sizeof(Stage);  // slack, q, ring
};

template <int H, int TT>
__global__ void __launch_bounds__(kThreads, (Fp8Shape<H, TT>::kMinCtasPerSm))
    indexer_logits_fp8_kernel(const DsaIndexerLogitsParams p, const PageSplits splits, const uint64_t l2_policy) {
  // Two tokens, not four: 4 tokens per CTA (N = 256) fit 2 CTAs per SM instead of 3, too few warps
  // to hide the wgmma and shared-memory latency (slower on the prefill shape).
  static_assert(TT == 1 || TT == 2, "one or two tokens per CTA");
  dsa_pdl_wait();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = align_smem_1024(smem_raw);
  Stage* stages = reinterpret_cast<Stage*>(sq + TT * H * DSA_INDEX_DIM);

  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t t0 = (int64_t)blockIdx.x * TT;
  const int max_cols = p.max_pages * DSA_PAGE_SIZE;
  const int p_begin = splits.begin(blockIdx.y);
  const int p_end = min(p_begin + splits.size(blockIdx.y), p.max_pages);

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

// ---------------------------------------------------------------- token groups (prefill)
// With many tokens per request (prefill: the launcher's choice when num_tokens >= 64 * requests),
// one CTA scores 8 consecutive tokens against a run of pages, warp-specialised:
//   warpgroup 0 (its warp 0): copies page after page (keys in the 128-byte swizzled layout, the
//     64 scales beside them) into a ring of kGroupStages stages with cp.async, announcing each
//     stage on its `full` mbarrier;
//   warpgroups 1 and 2: 4 tokens each. Per page, wgmma m64n(2H)k32 with both operands in shared
//     memory (A = the page's 64 keys, B = two tokens' q, natural K order) for tokens {0, 1} and
//     {2, 3} as two commit groups: the head reduction of the first pair (reduce_page_group, the
//     pair kernel's arithmetic) runs while the tensor core does the second.
// Shared-memory traffic per page and 8 tokens (H = 64): the copy writes 8.25 KB, each consumer's
// wgmmas read the keys twice (16 KB) and its 4 tokens' q once (32 KB): 104 KB per 8.4 MFLOP,
// against 130 KB for the pair kernel's 4 page-pairs (cp.async + LDS of the keys, q as B per pair).
// Neither ping-pong across pages (pair 0 of page j + 1 issued before pair 1 of page j is reduced)
// nor one m64n(4H) group per page was faster; a commit group in flight across the loop's back
// edge also makes ptxas serialise every wgmma (docs/kernels.md, "Compiler constraints").
// The scores differ from the decode path's in the last bits (K is summed in natural order here, in
// indexer_tile.cuh's permuted order there); a token's scores do not depend on which group or
// position it lands in (tested).
constexpr int kGroupTokens = 8;    // tokens per CTA, 4 per consumer warpgroup
// The launcher's threshold. A decode token in a group costs a pass of its own (~2.7 us more than
// in a pair at 32K), a prefill token ~0.06 us less, so groups win only when prefill tokens
// outnumber decode tokens ~45 to 1; at 64 tokens per request every measured shape takes its
// faster kernel (docs/kernels.md, "Indexer logits").
constexpr int64_t kGroupMinTokensPerRequest = 64;
constexpr int kGroupStages = 8;    // page ring
constexpr int kGroupThreads = 3 * kWgThreads;
constexpr uint32_t kGroupProducerRegs = 40, kGroupConsumerRegs = 232;  // 128*40 + 256*232 <= 65536

template <int H>
struct GroupSmem {
  uint8_t q[kGroupTokens][H * DSA_INDEX_DIM];        // row h of token u: 128 B, 128-byte swizzle
  uint8_t keys[kGroupStages][kIndexKeyBytes];       // 64 rows of 128 B, 128-byte swizzle
  float scales[kGroupStages][DSA_PAGE_SIZE];
  uint64_t full[kGroupStages], empty[kGroupStages];
  int seq[kGroupTokens];      // visible keys of each token (0: not a token)
  int leader[kGroupTokens];   // the pass that stores the token (its request's first token in the group), -1: none
  int pass_req[kGroupTokens], pass_pages[kGroupTokens];  // pass u: pages [p_begin, p_begin + n) of request req
};

template <int H>
__global__ void __launch_bounds__(kGroupThreads, 1)
    indexer_logits_group_kernel(const DsaIndexerLogitsParams p, const int pages_per_cta) {
  namespace ptx = dsa_sparse_mla;
  extern __shared__ uint8_t smem_raw[];
  GroupSmem<H>& sm = *reinterpret_cast<GroupSmem<H>*>(align_smem_1024(smem_raw));
  const int tid = threadIdx.x, lane = tid & 31;
  // Groups in token order: a step's decode tokens come first (runtime/scheduler.py), and their
  // groups, one pass per request, are the longest CTAs. (The last groups first, longest first in a
  // causal prefill, helps a pure prefill a little but puts those CTAs in the last wave of a mixed
  // step.)
  const int64_t t0 = (int64_t)blockIdx.x * kGroupTokens;
  const int max_cols = p.max_pages * DSA_PAGE_SIZE;
  const int p_begin = blockIdx.y * pages_per_cta;
  const int p_end = min(p_begin + pages_per_cta, p.max_pages);
  dsa_pdl_wait();
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kGroupStages; ++s) {
      ptx::mbar_init(&sm.full[s], 32);  // the copying warp's lanes (cp.async arrivals)
      ptx::mbar_init(&sm.empty[s], 8);  // the consumers' warps
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // The tokens, their passes (one per distinct request of the group, usually one).
    int req[kGroupTokens], page_end[kGroupTokens];
    for (int u = 0; u < kGroupTokens; ++u) {
      const bool valid = t0 + u < p.num_tokens;
      sm.seq[u] = valid ? min(max(p.seq_lens[t0 + u], 0), max_cols) : 0;
      req[u] = valid ? p.req_idx[t0 + u] : -1;
      page_end[u] = max(p_begin, min(p_end, (sm.seq[u] + DSA_PAGE_SIZE - 1) / DSA_PAGE_SIZE));
      int lead = valid ? u : -1;
      for (int w = u - 1; w >= 0 && valid; --w)
        if (req[w] == req[u]) lead = w;
      sm.leader[u] = lead;
      sm.pass_req[u] = req[u];
      sm.pass_pages[u] = 0;
    }
    for (int u = 0; u < kGroupTokens; ++u)
      if (sm.leader[u] >= 0) sm.pass_pages[sm.leader[u]] = max(sm.pass_pages[sm.leader[u]], page_end[u] - p_begin);
  }
  __syncthreads();

  if (tid < kWgThreads) {  // ---- producer
    ptx::setmaxnreg_dec<kGroupProducerRegs>();
    if (tid >= 32) return;
    const uint8_t* pool = static_cast<const uint8_t*>(p.pool);
    // lane's chunk k of a page: 16 bytes at 512 k + 16 lane, key row 4 k + lane / 8, column chunk lane % 8
    const uint32_t dst0 = ((lane >> 3) * 128) + (((lane & 7) ^ (lane >> 3)) << 4);
    const uint32_t dst1 = ((4 + (lane >> 3)) * 128) + (((lane & 7) ^ (4 + (lane >> 3))) << 4);
    int j = 0;
    for (int ps = 0; ps < kGroupTokens; ++ps) {
      const int n = sm.pass_pages[ps];
      if (n <= 0) continue;
      const int32_t* ids = p.page_table + (int64_t)sm.pass_req[ps] * p.max_pages + p_begin;
      int ids_cur = lane < n ? ids[lane] : 0, ids_next = lane + 32 < n ? ids[lane + 32] : 0;
      for (int i = 0; i < n; ++i, ++j) {
        if ((i & 31) == 0 && i > 0) {
          ids_cur = ids_next;
          ids_next = i + 32 + lane < n ? ids[i + 32 + lane] : 0;
        }
        const int page = __shfl_sync(0xffffffffu, ids_cur, i & 31);
        const int st = j % kGroupStages;
        if (j >= kGroupStages) ptx::mbar_wait(&sm.empty[st], (j / kGroupStages - 1) & 1);
        const uint8_t* src = pool + (int64_t)page * DSA_INDEX_PAGE_BYTES + 16 * lane;
        const uint32_t keys = ptx::smem_u32(sm.keys[st]);
#pragma unroll
        for (int k = 0; k < 16; k += 2) {  // rows 4k.. (row & 7 = lane / 8) and 4k + 4.. (4 + lane / 8)
          ptx::cp_async_16(keys + 512 * k + dst0, src + 512 * k, 16);
          ptx::cp_async_16(keys + 512 * k + dst1, src + 512 * (k + 1), 16);
        }
        if (lane < 16) ptx::cp_async_16(ptx::smem_u32(sm.scales[st]) + 16 * lane, src + kIndexKeyBytes, 16);
        ptx::mbar_arrive_cp_async(&sm.full[st]);
      }
    }
    return;
  }

  // ---- consumers
  ptx::setmaxnreg_inc<kGroupConsumerRegs>();
  const int c = tid / kWgThreads - 1, wtid = tid % kWgThreads;
  const int u0 = 4 * c;  // this warpgroup's first token in the group
  {  // q of the 4 tokens -> shared (zeros for missing tokens); head weights below
    constexpr int kChunksPerToken = H * DSA_INDEX_DIM / 16;
    const uint8_t* qg = static_cast<const uint8_t*>(p.q);
#pragma unroll 4
    for (int id = wtid; id < 4 * kChunksPerToken; id += kWgThreads) {
      const int u = id / kChunksPerToken, rem = id % kChunksPerToken, h = rem >> 3, ch = rem & 7;
      const bool valid = sm.leader[u0 + u] >= 0;
      const uint8_t* src = valid ? qg + ((t0 + u0 + u) * H * DSA_INDEX_DIM + 16 * rem) : qg;
      ptx::cp_async_16(ptx::smem_u32(sm.q[u0 + u]) + h * 128 + ((ch ^ (h & 7)) << 4), src, valid ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  }
  // -inf past each token's last visible page (inside this CTA's pages)
  for (int u = u0; u < u0 + 4; ++u) {
    if (sm.leader[u] < 0) continue;
    const int from = max(p_begin, min(p_end, (sm.seq[u] + DSA_PAGE_SIZE - 1) / DSA_PAGE_SIZE)) * DSA_PAGE_SIZE;
    float* out = p.logits + (t0 + u) * p.logits_stride;
    for (int col = from + wtid; col < p_end * DSA_PAGE_SIZE; col += kWgThreads) out[col] = -CUDART_INF_F;
  }
  float wr[2][2][H / 8][2];  // [pair][token of the pair]
#pragma unroll
  for (int hf = 0; hf < 2; ++hf)
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const int u = u0 + 2 * hf + v;
      if (sm.leader[u] >= 0) {
        load_head_weights<H>(wr[hf][v], p.weights + (t0 + u) * H, wtid);
      } else {
#pragma unroll
        for (int jh = 0; jh < H / 8; ++jh) wr[hf][v][jh][0] = wr[hf][v][jh][1] = 0.f;
      }
    }
  ptx::fence_proxy_async();  // q (cp.async, generic proxy) -> wgmma
  ptx::named_bar_sync(1 + c, kWgThreads);

  // This lane's outputs: token u0 + 2 hf + tok of pair hf, key row `row` of each page.
  const int tok = (lane & 2) >> 1, row = score_row(wtid);
  int seq[2], lead[2];
  float* out[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int u = u0 + 2 * hf + tok;
    seq[hf] = sm.seq[u] - row;  // page i's score is visible where 64 * (p_begin + i) < seq
    lead[hf] = sm.leader[u];
    out[hf] = p.logits + (t0 + u) * p.logits_stride + row;
  }
  // The ring's and q's shared addresses, the pass counts and the run flags are broadcast from
  // lane 0: read from shared memory, ptxas cannot prove them warp-uniform, and then every stage
  // wait takes a per-thread address and every wgmma descriptor goes through R2UR (docs/kernels.md,
  // "The ring out of uniform registers"). tests/test_kernel_sass.py checks the waits.
  const uint32_t keys_u = dsa_ptx::warp_uniform(ptx::smem_u32(sm.keys[0]));
  const uint64_t qdesc0 = make_desc_sw128_u32(dsa_ptx::warp_uniform(ptx::smem_u32(sm.q[u0])));
  const uint64_t qdesc1 = make_desc_sw128_u32(dsa_ptx::warp_uniform(ptx::smem_u32(sm.q[u0 + 2])));
  // Page j of the CTA: wait for its stage. No proxy fence between the copies' arrival and the
  // wgmmas: cp.async wrote the stage, and FlashAttention-3's paged (non-TMA) K loads hand cp.async
  // data to wgmma through the mbarrier alone too. A fence here (ptxas: MEMBAR.ALL.CTA, which waits
  // for this thread's logits stores) costs ~1% on the prefill shape.
  const uint32_t full_u = dsa_ptx::warp_uniform(ptx::smem_u32(&sm.full[0]));
  auto stage_ready = [&](int j) {
    const int st = j % kGroupStages;
    ptx::mbar_wait(full_u + 8 * st, (j / kGroupStages) & 1);
    return st;
  };
  auto release = [&](int st) {  // this warp no longer reads the stage
    if (lane == 0) ptx::mbar_arrive(&sm.empty[st]);
  };
  auto mma = [&](float (&d)[H], uint64_t kdesc, uint64_t qdesc) {
    dsa_wgmma::ss_k128<2 * H>(d, kdesc, qdesc);
    wgmma_commit();
  };
  float d0[H], d1[H];  // m64n(2H): pair 0, pair 1
  int j = 0;
  for (int ps = 0; ps < kGroupTokens; ++ps) {
    const int n = dsa_ptx::warp_uniform(sm.pass_pages[ps]);
    if (n <= 0) continue;
    const bool st0 = lead[0] == ps, st1 = lead[1] == ps;
    // The pairs of this warpgroup with a token in the pass (uniform over the warpgroup). A group of
    // decode tokens of 8 requests (a step mixing decode and prefill) runs 8 passes of one token.
    // Each loop below is free of branches around its wgmmas (ptxas serialises them otherwise).
    const bool run0 = dsa_ptx::warp_uniform(sm.leader[u0] == ps || sm.leader[u0 + 1] == ps);
    const bool run1 = dsa_ptx::warp_uniform(sm.leader[u0 + 2] == ps || sm.leader[u0 + 3] == ps);
    if (run0 && run1) {  // both pairs (prefill): pair 0 is reduced while pair 1's wgmmas run
      for (int i = 0; i < n; ++i, ++j) {
        const int st = stage_ready(j);
        const float scale = sm.scales[st][row];
        const uint64_t kdesc = make_desc_sw128_u32(keys_u + st * kIndexKeyBytes);
#pragma unroll
        for (int e = 0; e < H; ++e) fence_operand(d0[e]), fence_operand(d1[e]);
        wgmma_fence();
        mma(d0, kdesc, qdesc0);
        mma(d1, kdesc, qdesc1);
        wgmma_wait<1>();
        float s0[1], s1[1];
        reduce_page_group<H, 2>(d0, scale, wr[0], wtid, s0);
        wgmma_wait<0>();
        release(st);
        reduce_page_group<H, 2>(d1, scale, wr[1], wtid, s1);
        const int col = (p_begin + i) * DSA_PAGE_SIZE;
        if (st0) out[0][col] = col < seq[0] ? s0[0] : -CUDART_INF_F;
        if (st1) out[1][col] = col < seq[1] ? s1[0] : -CUDART_INF_F;
      }
    } else if (run0 || run1) {  // one pair
      const int hf = run0 ? 0 : 1;
      const bool mine = hf == 0 ? st0 : st1;
      const uint64_t qdesc = hf == 0 ? qdesc0 : qdesc1;
      float* const o = hf == 0 ? out[0] : out[1];
      const int vis = hf == 0 ? seq[0] : seq[1];
      for (int i = 0; i < n; ++i, ++j) {
        const int st = stage_ready(j);
        const float scale = sm.scales[st][row];
#pragma unroll
        for (int e = 0; e < H; ++e) fence_operand(d0[e]);
        wgmma_fence();
        mma(d0, make_desc_sw128_u32(keys_u + st * kIndexKeyBytes), qdesc);
        wgmma_wait<0>();
        release(st);
        float s[1];
        if (hf == 0)
          reduce_page_group<H, 2>(d0, scale, wr[0], wtid, s);
        else
          reduce_page_group<H, 2>(d0, scale, wr[1], wtid, s);
        const int col = (p_begin + i) * DSA_PAGE_SIZE;
        if (mine) o[col] = col < vis ? s[0] : -CUDART_INF_F;
      }
    } else {  // no token here: only keep the ring's phases
      for (int i = 0; i < n; ++i, ++j) release(stage_ready(j));
    }
  }
}

int num_sms() {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

// Pages per CTA for `groups` token groups over max_pages pages with `resident` CTAs on the GPU
// at once (docs/kernels.md, "Indexer logits"):
//   TT = 1 (decode, memory bound): the work spread over every resident CTA, at most 16 pages per
//     CTA. Many short CTAs balance the SMs through the block scheduler (fewer, longer CTAs and one
//     wave of long CTAs were slower at 128K, B = 128). Rounded up to a power of two
//     (power-of-two page counts split evenly: no CTA left with a sliver of pages), and at most 8
//     for a grid of fewer than two waves (smaller CTAs even out its tail).
//   TT = 2 (pairs, compute bound): a grid of N CTAs of ppc pages takes about ceil(N / resident)
//     waves of (ppc + ~2 pages of per-CTA cost: q staging, the first pages' latency); the cheapest
//     split wins (the fewest CTAs on a tie). Splits with more than max_ppc pages per CTA are left out (token groups:
//     launch_group).
constexpr int kMaxDecodePagesPerCta = 16;
constexpr int kCtaFixedPages = 2;
constexpr int kMaxSplits = 1024;
template <int TT>
int64_t pages_per_cta(int64_t groups, int max_pages, int64_t resident, int64_t max_ppc = INT64_MAX) {
  if (TT == 1) {
    const int64_t spread = dsa_ceil_div(groups * max_pages, resident);
    int64_t ppc = 1;
    while (ppc < spread && ppc < kMaxDecodePagesPerCta) ppc *= 2;
    if (ppc > 8 && groups * dsa_ceil_div(max_pages, ppc) < 2 * resident) ppc = 8;
    return ppc;
  }
  int64_t best_ppc = max_pages, best_cost = INT64_MAX, prev_ppc = -1;
  for (int s = 1; s <= max_pages && s <= kMaxSplits; ++s) {
    const int64_t ppc = dsa_ceil_div(max_pages, s);
    if (ppc == prev_ppc || (ppc > max_ppc && s < max_pages && s < kMaxSplits)) continue;
    prev_ppc = ppc;
    const int64_t ctas = groups * dsa_ceil_div(max_pages, ppc);
    const int64_t cost = dsa_ceil_div(ctas, resident) * (ppc + kCtaFixedPages);
    if (cost < best_cost) best_cost = cost, best_ppc = ppc;
  }
  return best_ppc;
}

// The decode plan's splits of a request's max_pages: ppc pages per CTA (pages_per_cta<1>), and
// past one wave of resident CTAs, the request's last pages in CTAs of a quarter of that (at least
// 1), as many per request as make one wave in all. Those CTAs start last, so the grid's tail is
// made of them; a CTA's time is mostly its fixed latency (page ids, then the first page ~3.5 us
// after its copy), so smaller last CTAs end the grid sooner. Quarters in one wave measured best
// against halves, eighths and two waves of quarters; grids of one wave or less are unchanged.
PageSplits decode_splits(int64_t groups, int max_pages, int64_t resident, int64_t* count) {
  const int ppc = (int)pages_per_cta<1>(groups, max_pages, resident);
  const int64_t uniform = dsa_ceil_div(max_pages, ppc);
  const int small_ppc = ppc / 4;
  if (groups * uniform <= resident || small_ppc < 1) {
    *count = uniform;
    return PageSplits{ppc, (int)uniform, ppc};
  }
  const int64_t small_per_group = dsa_ceil_div(resident, groups);
  const int64_t big = std::max<int64_t>(0, (max_pages - small_per_group * small_ppc) / ppc);
  *count = big + dsa_ceil_div(max_pages - big * ppc, small_ppc);
  return PageSplits{ppc, (int)big, small_ppc};
}

template <int H, int TT>
int launch_fp8(const DsaIndexerLogitsParams& p, cudaStream_t stream) {
  using Shape = Fp8Shape<H, TT>;
  const int rc = dsa_kernel_attributes("indexer_logits", (const void*)indexer_logits_fp8_kernel<H, TT>, Shape::kSmem);
  if (rc != DSA_OK) return rc;
  static int per_sm = 0;  // resident CTAs per SM (occupancy of this instantiation)
  if (per_sm == 0) {
    int n = 0;
    DSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, indexer_logits_fp8_kernel<H, TT>, kThreads,
                                                                 Shape::kSmem));
    DSA_CHECK_SUPPORTED(n > 0, "indexer_logits: the fp8 kernel (heads=%d, %d tokens per CTA) does not fit an SM", H, TT);
    per_sm = n;
  }
  const int64_t groups = dsa_ceil_div(p.num_tokens, TT), resident = (int64_t)num_sms() * per_sm;
  int64_t splits = 0;
  PageSplits plan;
  if constexpr (TT == 1) {
    plan = decode_splits(groups, p.max_pages, resident, &splits);
  } else {
    const int ppc = (int)pages_per_cta<TT>(groups, p.max_pages, resident);
    splits = dsa_ceil_div(p.max_pages, ppc);
    plan = PageSplits{ppc, (int)splits, ppc};
  }
  DSA_CHECK_SUPPORTED(splits <= 65535, "indexer_logits: max_pages=%d too large (page splits %lld > 65535)",
                      p.max_pages, (long long)splits);
  const dim3 grid((unsigned)groups, (unsigned)splits);
  // Decode reads each page once: evict-first (pairs copy without a policy, ring_issue<false>).
  DSA_CUDA_CHECK(dsa_launch_pdl(indexer_logits_fp8_kernel<H, TT>, grid, dim3(kThreads), Shape::kSmem, stream, p,
                                plan, kL2EvictFirst));
  return DSA_OK;
}

// Token groups (prefill): one CTA per SM (registers), pages per CTA by the waves cost model. A
// group spanning several requests runs one pass per request, so a CTA of decode tokens of 8
// requests (a step mixing decode with a prefill chunk) does up to 8 passes over its pages: its
// pages are capped so that such a CTA takes no more than an SM's share of the one-pass work
// (uncapped, the 8-pass CTAs of decode groups ran after the prefill's and doubled the step).
template <int H>
int launch_group(const DsaIndexerLogitsParams& p, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(GroupSmem<H>) + 1024;  // + slack to align to 1024
  const int rc = dsa_kernel_attributes("indexer_logits", (const void*)indexer_logits_group_kernel<H>, kSmem);
  if (rc != DSA_OK) return rc;
  const int64_t groups = dsa_ceil_div(p.num_tokens, kGroupTokens), sms = num_sms();
  const int64_t passes = p.num_requests < kGroupTokens ? p.num_requests : kGroupTokens;  // at most, per group
  const int64_t max_ppc = dsa_ceil_div(groups * p.max_pages, sms * passes);
  const int64_t ppc = pages_per_cta<kGroupTokens>(groups, p.max_pages, sms, max_ppc);
  const int64_t splits = dsa_ceil_div(p.max_pages, ppc);
  DSA_CHECK_SUPPORTED(splits <= 65535, "indexer_logits: max_pages=%d too large (page splits %lld > 65535)",
                      p.max_pages, (long long)splits);
  DSA_CUDA_CHECK(dsa_launch_pdl(indexer_logits_group_kernel<H>, dim3((unsigned)groups, (unsigned)splits),
                                dim3(kGroupThreads), kSmem, stream, p, (int)ppc));
  return DSA_OK;
}

template <int H, int kFormat>
int launch(const DsaIndexerLogitsParams& p, cudaStream_t stream) {
  if constexpr (kFormat == DSA_CACHE_FP8) {
    // Groups of 8 tokens when requests have kGroupMinTokensPerRequest or more tokens on average
    // (prefill), pairs when there are more tokens than requests (MTP decode, steps mixing decode
    // and prefill), one token per CTA otherwise (decode).
    const bool groups = p.num_requests > 0 && p.num_tokens >= kGroupMinTokensPerRequest * p.num_requests;
    const bool pairs = p.num_requests > 0 && p.num_tokens > p.num_requests;
    const int rc = groups ? launch_group<H>(p, stream) : pairs ? launch_fp8<H, 2>(p, stream) : launch_fp8<H, 1>(p, stream);
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
