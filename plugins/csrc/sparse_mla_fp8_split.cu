// DSA-TRT sparse MLA, fp8 pool, split-KV (flash-decoding) for small T.
//
// One token's 64 heads are a single CTA, so at decode (T = 1..8) the unsplit kernel keeps a
// handful of the 132 SMs busy for the whole top-k list. Here the list is cut into chunks of whole
// 64-key tiles (sparse_mla.cu picks the count): the wgmma kernel (sparse_mla_fp8.cuh, kSplit)
// runs one CTA per (token, head block, chunk) and writes the chunk's normalised out (fp16, fp8
// units) and lse to the workspace; the combine kernel below merges the chunks into bf16 out and lse.
//
// Numerics: each chunk runs the unsplit kernel's online softmax over its own keys, with its own
// (exact, unrounded) running max, so its P = 2^(z - m_chunk + 8) rounds to e4m3 differently from
// the unsplit run's; the lse-weighted merge is exact math (flash-decoding). Split and unsplit runs
// therefore agree to fp8 noise, not bitwise; tests/test_kernels_sparse_mla.py checks a split run
// against a per-chunk float64 replay combined by lse (docs/kernels.md, "Sparse MLA").
#include <cuda_bf16.h>
#include <math.h>

#include "common.cuh"
#include "sparse_mla.cuh"
#include "sparse_mla_fp8.cuh"

namespace dsa_sparse_mla {
namespace {

// out[row] = kv_scale * sum_s w_s * part_out[s][row] / sum_s w_s with w_s = exp(lse_s - max_s lse_s),
// and lse[row] = max + log(sum_s w_s). A chunk without a valid slot (lse -inf, part_out 0) weighs
// 0; when every chunk is -inf the row is empty: out 0, lse -inf. A NaN chunk lse (a NaN score or
// latent in that chunk) makes the row NaN, as in the unsplit kernel.
//
// Two kernels compute it, the same sums in the same order (bitwise equal):

constexpr int kWideThreads = kVDim / 4;  // 128: one (token, head) row per CTA, 4 dims per thread
constexpr int kCombineRowsPerCta = 4;                     // one warp per (token, head) row
constexpr int kCombineThreads = 32 * kCombineRowsPerCta;
constexpr int kLaneDims = kVDim / 32;                     // 16 dims per lane: two 16-byte fp16 loads per chunk
constexpr int kChunkGroup = 4;                            // chunks whose loads are in flight at once (registers)
static_assert(kLaneDims == 16, "a lane's dims are two uint4 of fp16");

// The merge weights of a row's chunks, over its warp: lane s holds chunk s's lse x (-inf past the
// chunk count); m = the max lse, w = exp(x - m) this lane's chunk weight, sum = the warp's sum of w.
struct ChunkWeights {
  float m, w, sum;
};
__device__ __forceinline__ ChunkWeights chunk_weights(float x) {
  float m = x;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));  // fmaxf skips NaN
  const float w = x == -INFINITY ? 0.f : expf(x - m);  // NaN x -> NaN w, also when m is -inf
  float w_sum = w;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) w_sum += __shfl_xor_sync(0xffffffffu, w_sum, o);
  return {m, w, w_sum};
}

// The combine of more than kChunkGroup chunks (decode of a few tokens: up to 32 chunks): a CTA per
// row, 4 dims a thread, every chunk's 8-byte load in flight at once (its rows are few: latency, not
// occupancy, bounds it).
__global__ void __launch_bounds__(kWideThreads)
    sparse_mla_combine_wide_kernel(const DsaSparseMlaParams p, const SplitPlan plan) {
  static_assert(kMaxSplits <= 32, "one chunk per lane");
  dsa_pdl_wait();
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t row = blockIdx.x;
  const int n = plan.n_splits, lane = threadIdx.x & 31;
  const float x = lane < n ? plan.part_lse[lane * rows + row] : -INFINITY;  // chunk `lane`
  const uint2* part = reinterpret_cast<const uint2*>(plan.part_out + row * kVDim) + threadIdx.x;  // 4 x fp16
  const int64_t part_stride = rows * (kVDim / 4);  // uint2 between chunks
  uint2 v[kMaxSplits];
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s)
    if (s < n) v[s] = part[s * part_stride];
  const ChunkWeights cw = chunk_weights(x);
  const float m = cw.m, w = cw.w, w_sum = cw.sum;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s >= n) break;
    const float ws = __shfl_sync(0xffffffffu, w, s);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v[s].x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v[s].y));
    acc[0] = fmaf(ws, lo.x, acc[0]);
    acc[1] = fmaf(ws, lo.y, acc[1]);
    acc[2] = fmaf(ws, hi.x, acc[2]);
    acc[3] = fmaf(ws, hi.y, acc[3]);
  }
  const bool empty = w_sum == 0.f;  // otherwise >= 1: the max chunk weighs exp(0)
  const float scale = empty ? 0.f : p.kv_scale / w_sum;
  const __nv_bfloat162 lo = __floats2bfloat162_rn(acc[0] * scale, acc[1] * scale);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(acc[2] * scale, acc[3] * scale);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&lo);
  packed.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.out) + row * kVDim + 4 * threadIdx.x) = packed;
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[row] = empty ? -INFINITY : m + logf(w_sum);
}

// Up to kChunkGroup chunks: a warp per row (16 dims a lane, two 16-byte loads per chunk, all in
// flight: two memory latencies a row), not a CTA of 4 dims a thread: at 40 tokens x 128 heads x 3
// chunks the grid's threads fit the GPU at once (H200: 71.2 -> 63.9 us for kernel + combine).
__global__ void __launch_bounds__(kCombineThreads, 6)  // <= 80 registers: 24 warps an SM
    sparse_mla_combine_kernel(const DsaSparseMlaParams p, const SplitPlan plan) {
  static_assert(kMaxSplits <= 32, "one chunk per lane");
  dsa_pdl_wait();
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;  // warp-uniform
  const int n = plan.n_splits, lane = threadIdx.x & 31;
  const float x = lane < n ? plan.part_lse[lane * rows + row] : -INFINITY;  // chunk `lane`
  const uint4* part = reinterpret_cast<const uint4*>(plan.part_out + row * kVDim + lane * kLaneDims);
  const int64_t part_stride = rows * (kVDim / 8);  // uint4 between chunks
  const ChunkWeights cw = chunk_weights(x);
  const float m = cw.m, w = cw.w, w_sum = cw.sum;
  float acc[kLaneDims] = {};
  for (int s0 = 0; s0 < n; s0 += kChunkGroup) {
    uint4 v[kChunkGroup][2];
#pragma unroll
    for (int j = 0; j < kChunkGroup; ++j)
      if (s0 + j < n) {
        v[j][0] = part[(s0 + j) * part_stride];
        v[j][1] = part[(s0 + j) * part_stride + 1];
      }
#pragma unroll
    for (int j = 0; j < kChunkGroup; ++j) {
      if (s0 + j >= n) break;
      const float ws = __shfl_sync(0xffffffffu, w, s0 + j);
      const __half2* h = reinterpret_cast<const __half2*>(v[j]);  // 8 x half2
#pragma unroll
      for (int d = 0; d < kLaneDims / 2; ++d) {
        const float2 f = __half22float2(h[d]);
        acc[2 * d] = fmaf(ws, f.x, acc[2 * d]);
        acc[2 * d + 1] = fmaf(ws, f.y, acc[2 * d + 1]);
      }
    }
  }
  const bool empty = w_sum == 0.f;  // otherwise >= 1: the max chunk weighs exp(0)
  const float scale = empty ? 0.f : p.kv_scale / w_sum;
  uint2* out = reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.out) + row * kVDim + lane * kLaneDims);
#pragma unroll
  for (int q = 0; q < kLaneDims / 4; ++q) {  // out is 8-byte aligned (the launcher's contract)
    const __nv_bfloat162 lo = __floats2bfloat162_rn(acc[4 * q] * scale, acc[4 * q + 1] * scale);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(acc[4 * q + 2] * scale, acc[4 * q + 3] * scale);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo);
    packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    out[q] = packed;
  }
  if (lane == 0 && p.lse != nullptr) p.lse[row] = empty ? -INFINITY : m + logf(w_sum);
}

template <int kRows, int kHeadBlocks>
int launch_split(const DsaSparseMlaParams& p, const SplitPlan& plan, cudaStream_t stream) {
  const int status = launch_kernel<kRows, kHeadBlocks, true>(p, plan, stream);
  if (status != DSA_OK) return status;
  const int64_t rows = p.num_tokens * p.num_heads;
  DSA_CHECK_ARG(rows <= INT32_MAX, "sparse_mla: num_tokens=%lld x num_heads=%d rows exceed 2^31 - 1",
                static_cast<long long>(p.num_tokens), p.num_heads);
  if (plan.n_splits > kChunkGroup) {
    DSA_CUDA_CHECK(dsa_launch_pdl(sparse_mla_combine_wide_kernel, dim3(static_cast<unsigned>(rows)), dim3(kWideThreads),
                                  0, stream, p, plan));
  } else {
    const int64_t ctas = (rows + kCombineRowsPerCta - 1) / kCombineRowsPerCta;
    DSA_CUDA_CHECK(dsa_launch_pdl(sparse_mla_combine_kernel, dim3(static_cast<unsigned>(ctas)), dim3(kCombineThreads),
                                  0, stream, p, plan));
  }
  return DSA_OK;
}

}  // namespace

int launch_fp8_split(const DsaSparseMlaParams& p, const SplitPlan& plan, cudaStream_t stream) {
  switch (p.num_heads) {
    case 16: return launch_split<16, 1>(p, plan, stream);
    case 32: return launch_split<32, 1>(p, plan, stream);
    case 64: return launch_split<64, 1>(p, plan, stream);
    case 128: return launch_split<64, 2>(p, plan, stream);
    default: break;
  }
  return dsa_set_error(DSA_ERR_UNSUPPORTED, "sparse_mla: num_heads=%d unsupported (16, 32, 64, 128)", p.num_heads);
}

}  // namespace dsa_sparse_mla
