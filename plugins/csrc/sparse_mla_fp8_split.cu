// DSA-TRT sparse MLA, fp8 pool, split-KV (flash-decoding) for small T.
//
// One token's 64 heads are a single CTA, so at decode (T = 1..8) the unsplit kernel keeps a
// handful of the 132 SMs busy for the whole top-k list. Here the list is cut into chunks of whole
// 64-key tiles (sparse_mla.cu picks the count): the wgmma kernel (sparse_mla_fp8.cuh, kSplit)
// runs one CTA per (token, head block, chunk) and writes the chunk's normalised fp32 out and lse
// to the workspace; the combine kernel below merges the chunks into bf16 out and lse.
//
// Numerics: each chunk runs the unsplit kernel's online softmax over its own keys, with its own
// (exact, unrounded) running max, so its P = 2^(z - m_chunk + 8) rounds to e4m3 differently from
// the unsplit run's; the lse-weighted merge is exact math (flash-decoding). Split and unsplit runs
// therefore agree to fp8 noise, not bitwise; tests/test_kernels_sparse_mla.py checks a split run
// against a per-chunk float64 replay combined by lse (docs/sparse_mla_notes.md, "Running max").
#include <cuda_bf16.h>
#include <math.h>

#include "common.cuh"
#include "sparse_mla.cuh"
#include "sparse_mla_fp8.cuh"

namespace dsa_sparse_mla {
namespace {

constexpr int kCombineThreads = kVDim / 4;  // 128: one (token, head) row per CTA, 4 dims per thread

// out[row] = sum_s w_s * part_out[s][row] / sum_s w_s with w_s = exp(lse_s - max_s lse_s), and
// lse[row] = max + log(sum_s w_s). A chunk without a valid slot (lse -inf, part_out 0) weighs 0;
// when every chunk is -inf the row is empty: out 0, lse -inf. A NaN chunk lse (a NaN score or
// latent in that chunk) makes the row NaN, as in the unsplit kernel.
__global__ void __launch_bounds__(kCombineThreads)
    sparse_mla_combine_kernel(const DsaSparseMlaParams p, const SplitPlan plan) {
  dsa_pdl_wait();
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t row = blockIdx.x;
  const float* lse_part = plan.part_lse + row;  // chunk s: lse_part[s * rows]
  float m = -INFINITY;
  for (int s = 0; s < plan.n_splits; ++s) m = fmaxf(m, lse_part[s * rows]);  // fmaxf skips NaN
  const float4* part = reinterpret_cast<const float4*>(plan.part_out + row * kVDim) + threadIdx.x;
  const int64_t part_stride = rows * (kVDim / 4);  // float4 between chunks
  float w_sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = 0; s < plan.n_splits; ++s) {
    const float x = lse_part[s * rows];
    const float w = x == -INFINITY ? 0.f : expf(x - m);  // NaN x -> NaN w, also when m is -inf
    const float4 v = part[s * part_stride];
    w_sum += w;
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
  }
  const bool empty = w_sum == 0.f;  // otherwise >= 1: the max chunk weighs exp(0)
  const float inv = empty ? 0.f : 1.f / w_sum;
  const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&lo);
  packed.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.out) + row * kVDim + 4 * threadIdx.x) = packed;
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[row] = empty ? -INFINITY : m + logf(w_sum);
}

template <int kRows, int kHeadBlocks>
int launch_split(const DsaSparseMlaParams& p, const SplitPlan& plan, cudaStream_t stream) {
  const int status = launch_kernel<kRows, kHeadBlocks, true>(p, plan, stream);
  if (status != DSA_OK) return status;
  const int64_t rows = p.num_tokens * p.num_heads;
  DSA_CHECK_ARG(rows <= INT32_MAX, "sparse_mla: num_tokens=%lld x num_heads=%d rows exceed 2^31 - 1",
                static_cast<long long>(p.num_tokens), p.num_heads);
  DSA_CUDA_CHECK(dsa_launch_pdl(sparse_mla_combine_kernel, dim3(static_cast<unsigned>(rows)), dim3(kCombineThreads), 0,
                                stream, p, plan));
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
