// DSA-TRT sparse MLA, bf16 pool (the exact-comparison mode): a plain fp32 CUDA-core kernel.
//
// Correctness path only (docs/architecture.md §8: the exact mode matches the HF oracle); the deployed fp8 pool
// runs the wgmma kernel. One warp per (token, head), 8 heads per CTA sharing each staged tile
// of 16 latent rows; lane l owns dims l + 32i. Online softmax in natural-log fp32, like the
// reference.
#include <cuda_bf16.h>
#include <math.h>

#include "common.cuh"
#include "sparse_mla.cuh"

namespace dsa_sparse_mla {
namespace {

constexpr int kDimB = DSA_MLA_DIM;
constexpr int kVDimB = DSA_MLA_V_DIM;
constexpr int kHeadsPerCtaB = 8;
constexpr int kTileKeysB = 16;
constexpr int kQPerLane = kDimB / 32;   // 18
constexpr int kOPerLane = kVDimB / 32;  // 16

__global__ void __launch_bounds__(kHeadsPerCtaB * 32) sparse_mla_bf16_kernel(const DsaSparseMlaParams p) {
  __shared__ float kv[kTileKeysB][kDimB];
  __shared__ int64_t row_slot[kTileKeysB];
  const int head_groups = p.num_heads / kHeadsPerCtaB;
  const int64_t t = blockIdx.x / head_groups;
  const int head = static_cast<int>(blockIdx.x % head_groups) * kHeadsPerCtaB + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  const __nv_bfloat16* pool = static_cast<const __nv_bfloat16*>(p.pool);
  const __nv_bfloat16* qrow = static_cast<const __nv_bfloat16*>(p.q) + t * p.q_stride_token + head * p.q_stride_head;
  float qv[kQPerLane];
#pragma unroll
  for (int i = 0; i < kQPerLane; ++i) qv[i] = __bfloat162float(qrow[lane + 32 * i]);
  float o[kOPerLane];
#pragma unroll
  for (int i = 0; i < kOPerLane; ++i) o[i] = 0.f;
  float m = -INFINITY, l = 0.f;

  for (int k0 = 0; k0 < p.topk; k0 += kTileKeysB) {
    __syncthreads();  // previous tile fully consumed
    if (threadIdx.x < kTileKeysB) {
      const int k = k0 + threadIdx.x;
      int64_t s = k < p.topk ? p.slots[t * p.topk + k] : -1;
      row_slot[threadIdx.x] = (s >= 0 && s < p.num_slots) ? s : -1;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < kTileKeysB * kDimB; idx += blockDim.x) {
      const int key = idx / kDimB, d = idx % kDimB;
      const int64_t s = row_slot[key];
      kv[key][d] = s >= 0 ? __bfloat162float(pool[s * kDimB + d]) : 0.f;
    }
    __syncthreads();
    for (int key = 0; key < kTileKeysB; ++key) {
      if (row_slot[key] < 0) continue;  // block-uniform
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kQPerLane; ++i) dot = fmaf(qv[i], kv[key][lane + 32 * i], dot);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);  // same sum on all lanes
      const float s = dot * p.sm_scale;
      const float m_new = fmaxf(m, s);
      const float alpha = m == -INFINITY ? 0.f : expf(m - m_new);
      const float w = expf(s - m_new);
      l = l * alpha + w;
#pragma unroll
      for (int i = 0; i < kOPerLane; ++i) o[i] = fmaf(o[i], alpha, w * kv[key][lane + 32 * i]);
      m = m_new;
    }
  }
  const bool empty = l == 0.f;
  __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.out) + (t * p.num_heads + head) * kVDimB;
#pragma unroll
  for (int i = 0; i < kOPerLane; ++i) orow[lane + 32 * i] = __float2bfloat16_rn(empty ? 0.f : o[i] / l);
  if (lane == 0 && p.lse != nullptr) p.lse[t * p.num_heads + head] = empty ? -INFINITY : m + logf(l);
}

}  // namespace

int launch_bf16(const DsaSparseMlaParams& p, cudaStream_t stream) {
  const int64_t blocks = p.num_tokens * (p.num_heads / kHeadsPerCtaB);
  DSA_CHECK_ARG(blocks <= INT32_MAX, "sparse_mla: num_tokens=%lld gives %lld blocks (> 2^31 - 1)",
                static_cast<long long>(p.num_tokens), static_cast<long long>(blocks));
  sparse_mla_bf16_kernel<<<static_cast<unsigned>(blocks), kHeadsPerCtaB * 32, 0, stream>>>(p);
  DSA_CUDA_CHECK_LAUNCH();
  return DSA_OK;
}

}  // namespace dsa_sparse_mla
