// DSA-TRT kernels: paged indexer logits (DESIGN.md §3, plugins/reference.py indexer_logits).
//
//   logits[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]) * k_scale[s]   s < seq_len[t]
//                = -inf                                               seq_len[t] <= s < max_pages*64
//
// fp8 path (memory bound: 132 B of key per 2*H*128 FLOP). One CTA = one warpgroup (128 threads)
// scores one query token against a run of up to 32 pages of its request. Per page the
// warpgroup runs 4 x wgmma m64nHk32 e4m3 (QGMMA) with
//   A = the page's 64 keys in registers: each thread cp.async-copies its own 16-byte chunks into
//       a 4-stage shared-memory ring (3 pages in flight per CTA, no block barriers) and reads
//       them back as its A fragment, and
//   B = the token's q [H, 128], staged once in shared memory (128-byte swizzle),
// so the accumulator holds [64 keys x H heads]: the head reduction is 16 in-thread FMAs per
// key row plus two shuffles. The K dimension is permuted (the dot product does not care): a
// thread's 16-byte loads land in the A-fragment slots directly, and q is written to shared
// memory under the same permutation (kPerm below). relu(x) * w = (x + |x|) * (w / 2): FADD
// with an |x| operand instead of the half-rate FMNMX (DeepGEMM PR #452).
//
// bf16 path (exact mode): plain CUDA cores, one thread per key, fp32 accumulation. Correctness
// only.
#include <cuda_bf16.h>
#include <math_constants.h>

#include "common.cuh"

namespace {

constexpr int kThreads = 128;           // one warpgroup
constexpr int kMaxPagesPerCta = 32;     // page ids of a CTA live in one warp's lanes
constexpr int kIndexKeyBytes = DSA_PAGE_SIZE * DSA_INDEX_DIM;  // 8192
constexpr int kCtasPerSm = 5;

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor, K-major operand with the 128-byte swizzle (8 rows x 128 B
// atoms, stride 1024 B between 8-row groups). Base must be 1024-byte aligned.
__device__ __forceinline__ uint64_t make_desc_sw128(const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t desc = (uint64_t)((addr & 0x3FFFF) >> 4);
  desc |= (uint64_t)(16 >> 4) << 16;    // leading byte offset (unused for swizzled K-major)
  desc |= (uint64_t)(1024 >> 4) << 32;  // stride byte offset: next 8-row group
  desc |= (uint64_t)1 << 62;            // SWIZZLE_128B
  return desc;
}

// D[64 x N] (+)= A[64 x 32] (registers, e4m3) * B[N x 32]^T (shared, e4m3), fp32 accumulate.
template <int N>
struct Wgmma;

template <>
struct Wgmma<64> {
  __device__ __forceinline__ static void run(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d));
  }
};

template <>
struct Wgmma<32> {
  __device__ __forceinline__ static void run(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d));
  }
};

// The K permutation. wgmma's A fragment (e4m3, k32) gives lane (g = lane/4, c = lane%4) the
// logical k bytes [32s + 16h + 4c, +4) of rows g and g+8 in register a{2h} / a{2h+1} of k-step s.
// A thread instead loads physical bytes [16c, 16c+16) and [16(c+4), 16(c+4)+16) of its rows, so
// logical word (s, h, c) sits at physical byte 16*(c + 4*(s/2)) + 8*(s%2) + 4*h.

// A page's keys for one thread: rows r and r+8, 32 bytes each, plus the scale this lane stores.
struct PageFrag {
  uint4 lo0, hi0, lo1, hi1;  // row r: bytes [16c,+16), [16c+64,+16); row r+8: the same
  float scale;
};

// One pipeline stage in shared memory. Each thread copies (cp.async) and later reads back only its
// own 16-byte chunks, so stages need no block barrier; [chunk][thread] keeps LDS conflict-free.
struct Stage {
  uint4 keys[4][kThreads];
  float scale[kThreads];
};
constexpr int kStages = 4;  // pages in flight per CTA: kStages - 1

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
               "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
               "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <int H>
constexpr size_t fp8_smem_bytes() {
  return 1024 + H * DSA_INDEX_DIM + kStages * sizeof(Stage);  // alignment slack, q tile, stages
}

template <int H>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    indexer_logits_fp8_kernel(const DsaIndexerLogitsParams p, const int pages_per_cta) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  Stage* stages = reinterpret_cast<Stage*>(sq + H * DSA_INDEX_DIM);

  const int t = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int c = lane & 3, g = lane >> 2;
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
  const int r0 = 16 * warp + g;  // this thread's key rows in the page: r0 and r0 + 8
  auto issue = [&](int i) {      // page i -> stage i % kStages (always commits a group)
    if (i < n) {
      Stage& st = stages[i % kStages];
      const int page = __shfl_sync(0xffffffffu, my_page, i);
      const uint8_t* base = pool + (int64_t)page * DSA_INDEX_PAGE_BYTES;
      cp_async16(&st.keys[0][tid], base + r0 * DSA_INDEX_DIM + 16 * c);
      cp_async16(&st.keys[1][tid], base + r0 * DSA_INDEX_DIM + 16 * (c + 4));
      cp_async16(&st.keys[2][tid], base + (r0 + 8) * DSA_INDEX_DIM + 16 * c);
      cp_async16(&st.keys[3][tid], base + (r0 + 8) * DSA_INDEX_DIM + 16 * (c + 4));
      cp_async4(&st.scale[tid], base + kIndexKeyBytes + 4 * (c == 1 ? r0 + 8 : r0));
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // q[t] -> shared, K-permuted, 128-byte swizzled rows (row = head). Overlaps the first pages.
  // All 16-byte loads are issued before any store (a load-store loop here cost ~10 us of
  // serial latency per CTA). Physical word wi of chunk ch of row h is logical word
  // 8*s + 4*hh + c with c = ch & 3, s = 2*(ch >> 2) + (wi >> 1), hh = wi & 1 (kperm inverse).
  {
    constexpr int kQChunks = H * DSA_INDEX_DIM / 16 / kThreads;  // 16-byte chunks per thread
    const uint4* qg = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(p.q) + (int64_t)t * H * DSA_INDEX_DIM);
    uint4 qv[kQChunks];
#pragma unroll
    for (int j = 0; j < kQChunks; ++j) qv[j] = qg[tid + j * kThreads];
#pragma unroll
    for (int j = 0; j < kQChunks; ++j) {
      const int u = tid + j * kThreads, h = u >> 3, ch = u & 7;
      const uint32_t w4[4] = {qv[j].x, qv[j].y, qv[j].z, qv[j].w};
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        const int lw = 8 * (2 * (ch >> 2) + (wi >> 1)) + 4 * (wi & 1) + (ch & 3), kb = 4 * lw;
        *reinterpret_cast<uint32_t*>(sq + h * 128 + (((kb >> 4) ^ (h & 7)) << 4) + (kb & 15)) = w4[wi];
      }
    }
  }
  // Head weights of this lane's accumulator columns 8j + 2c + {0,1}, halved for (x + |x|).
  float wr[H / 8][2];
  const float* wt = p.weights + (int64_t)t * H;
#pragma unroll
  for (int j = 0; j < H / 8; ++j) {
    wr[j][0] = 0.5f * wt[8 * j + 2 * c];
    wr[j][1] = 0.5f * wt[8 * j + 2 * c + 1];
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t desc = make_desc_sw128(sq);

  float d[H / 2];
  for (int i = 0; i < n; ++i) {
    cp_async_wait<kStages - 2>();  // this thread's copies of page i have landed
    const Stage& st = stages[i % kStages];
    PageFrag f;
    f.lo0 = st.keys[0][tid];
    f.hi0 = st.keys[1][tid];
    f.lo1 = st.keys[2][tid];
    f.hi1 = st.keys[3][tid];
    f.scale = st.scale[tid];
    issue(i + kStages - 1);  // into the stage read (and consumed) in iteration i - 1

#pragma unroll
    for (int j = 0; j < H / 2; ++j) fence_operand(d[j]);
    wgmma_fence();
    Wgmma<H>::run(d, f.lo0.x, f.lo1.x, f.lo0.y, f.lo1.y, desc + 0, 0);
    Wgmma<H>::run(d, f.lo0.z, f.lo1.z, f.lo0.w, f.lo1.w, desc + 2, 1);
    Wgmma<H>::run(d, f.hi0.x, f.hi1.x, f.hi0.y, f.hi1.y, desc + 4, 1);
    Wgmma<H>::run(d, f.hi0.z, f.hi1.z, f.hi0.w, f.hi1.w, desc + 6, 1);
    wgmma_commit();
    wgmma_wait0();
#pragma unroll
    for (int j = 0; j < H / 2; ++j) fence_operand(d[j]);

    float s0 = 0.f, s1 = 0.f;  // rows r0 and r0 + 8, this lane's 2*H/8 heads
#pragma unroll
    for (int j = 0; j < H / 8; ++j) {
      s0 = fmaf(wr[j][0], d[4 * j + 0] + fabsf(d[4 * j + 0]), s0);
      s0 = fmaf(wr[j][1], d[4 * j + 1] + fabsf(d[4 * j + 1]), s0);
      s1 = fmaf(wr[j][0], d[4 * j + 2] + fabsf(d[4 * j + 2]), s1);
      s1 = fmaf(wr[j][1], d[4 * j + 3] + fabsf(d[4 * j + 3]), s1);
    }
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if (c < 2) {
      const int col = (p_begin + i) * DSA_PAGE_SIZE + (c == 0 ? r0 : r0 + 8);
      out[col] = col < seq_len ? (c == 0 ? s0 : s1) * f.scale : -CUDART_INF_F;
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
    indexer_logits_fp8_kernel<H><<<grid, kThreads, smem, stream>>>(p, (int)ppc);
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
