// DSA-TRT kernels: the two cache writes (docs/architecture.md §4-5, plugins/reference.py).
//
//   dsa_launch_mla_cache_write        bf16 [T,512] + [T,64] -> pool row of 576 e4m3 bytes
//                                     (e4m3(x / kv_scale), saturated to +-448) or 576 bf16.
//   dsa_launch_indexer_k_cache_write  bf16 [T,128] -> 128 e4m3 bytes + one fp32 power-of-two scale
//                                     2^ceil(log2(max(amax, 1e-4) / 448)) in the 8448-byte page,
//                                     or 128 bf16.
//
// Both are tiny (a few hundred bytes per token); they are written for exactness, not speed:
// x / kv_scale is an IEEE division and the e4m3 rounding is the hardware's RNE with satfinite,
// which is what the reference's clamp + .to(float8_e4m3fn) computes.
// Slots outside [0, num_slots) (including -1) are skipped.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common.cuh"

namespace {

constexpr int kMlaGroup = 4;                                  // elements per thread
constexpr int kMlaGroupsPerToken = DSA_MLA_DIM / kMlaGroup;   // 144
constexpr int kMlaLatentGroups = DSA_MLA_V_DIM / kMlaGroup;   // 128: groups 0..127 from kv_latent
constexpr int kIndexKeyBytes = DSA_PAGE_SIZE * DSA_INDEX_DIM; // 8192: key matrix, then scales
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-4f;

__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

template <int kFormat>
__global__ void mla_cache_write_kernel(DsaMlaCacheWriteParams p) {
  const int64_t total = p.num_tokens * kMlaGroupsPerToken;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / kMlaGroupsPerToken;
    const int g = (int)(i % kMlaGroupsPerToken);
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.num_slots) continue;
    const __nv_bfloat16* src =
        g < kMlaLatentGroups
            ? static_cast<const __nv_bfloat16*>(p.kv_latent) + t * p.kv_latent_stride + g * kMlaGroup
            : static_cast<const __nv_bfloat16*>(p.k_pe) + t * p.k_pe_stride + (g - kMlaLatentGroups) * kMlaGroup;
    if constexpr (kFormat == DSA_CACHE_FP8) {
      float x[kMlaGroup];
#pragma unroll
      for (int j = 0; j < kMlaGroup; ++j) x[j] = __fdiv_rn(__bfloat162float(src[j]), p.kv_scale);
      uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(p.pool) + slot * DSA_MLA_DIM) + g;
      *dst = pack_e4m3x4(x[0], x[1], x[2], x[3]);
    } else {
      __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.pool) + slot * DSA_MLA_DIM + g * kMlaGroup;
#pragma unroll
      for (int j = 0; j < kMlaGroup; ++j) dst[j] = src[j];
    }
  }
}

// One warp per token; lane l holds elements 4l..4l+3 of the 128.
template <int kFormat>
__global__ void indexer_k_cache_write_kernel(DsaIndexerKCacheWriteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32; t < p.num_tokens; t += warps) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.num_slots) continue;  // warp-uniform
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.index_k) + t * p.index_k_stride + lane * 4;
    const int64_t page = slot / DSA_PAGE_SIZE, off = slot % DSA_PAGE_SIZE;
    if constexpr (kFormat == DSA_CACHE_FP8) {
      float x[4];
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[j] = __bfloat162float(src[j]);
        amax = fmaxf(amax, fabsf(x[j]));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      // Same float ops as the reference: ceil(log2(amax / 448)) is never near an integer boundary
      // for bf16 amax (amax / 448 = m * 2^e / 7 with m < 256), so the power of two is exact.
      const float scale = exp2f(ceilf(log2f(__fdiv_rn(fmaxf(amax, kFp8AmaxFloor), kFp8Max))));
      uint8_t* page_base = static_cast<uint8_t*>(p.pool) + page * DSA_INDEX_PAGE_BYTES;
      uint32_t* key = reinterpret_cast<uint32_t*>(page_base + off * DSA_INDEX_DIM) + lane;
      *key = pack_e4m3x4(__fdiv_rn(x[0], scale), __fdiv_rn(x[1], scale), __fdiv_rn(x[2], scale),
                         __fdiv_rn(x[3], scale));
      if (lane == 0) reinterpret_cast<float*>(page_base + kIndexKeyBytes)[off] = scale;
    } else {
      __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.pool) + slot * DSA_INDEX_DIM + lane * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[j] = src[j];
    }
  }
}

int grid_for(int64_t work_items, int threads) {
  const int64_t blocks = dsa_ceil_div(work_items, threads);
  return (int)(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

extern "C" int dsa_launch_mla_cache_write(const DsaMlaCacheWriteParams* p, cudaStream_t stream) {
  DSA_CHECK_ARG(p != nullptr, "mla_cache_write: params is NULL");
  DSA_CHECK_ARG(p->num_tokens >= 0, "mla_cache_write: num_tokens=%lld < 0", (long long)p->num_tokens);
  if (p->num_tokens == 0) return DSA_OK;
  DSA_CHECK_ARG(p->kv_latent && p->k_pe && p->slot_mapping && p->pool,
                "mla_cache_write: NULL pointer (kv_latent=%p k_pe=%p slot_mapping=%p pool=%p)", p->kv_latent,
                p->k_pe, (const void*)p->slot_mapping, p->pool);
  DSA_CHECK_ARG(p->kv_latent_stride >= DSA_MLA_V_DIM, "mla_cache_write: kv_latent_stride=%lld < 512",
                (long long)p->kv_latent_stride);
  DSA_CHECK_ARG(p->k_pe_stride >= DSA_MLA_DIM - DSA_MLA_V_DIM, "mla_cache_write: k_pe_stride=%lld < 64",
                (long long)p->k_pe_stride);
  DSA_CHECK_ARG(p->num_slots >= 0, "mla_cache_write: num_slots=%lld < 0", (long long)p->num_slots);
  DSA_CHECK_ARG(p->format != DSA_CACHE_FP8 || (p->kv_scale > 0.f && isfinite(p->kv_scale)),
                "mla_cache_write: kv_scale=%g must be finite and > 0", (double)p->kv_scale);
  constexpr int kThreads = 256;
  const int grid = grid_for(p->num_tokens * kMlaGroupsPerToken, kThreads);
  DSA_DISPATCH_FORMAT("mla_cache_write", p->format, kFormat,
                      mla_cache_write_kernel<kFormat><<<grid, kThreads, 0, stream>>>(*p));
  DSA_CUDA_CHECK_LAUNCH();
  return DSA_OK;
}

extern "C" int dsa_launch_indexer_k_cache_write(const DsaIndexerKCacheWriteParams* p, cudaStream_t stream) {
  DSA_CHECK_ARG(p != nullptr, "indexer_k_cache_write: params is NULL");
  DSA_CHECK_ARG(p->num_tokens >= 0, "indexer_k_cache_write: num_tokens=%lld < 0", (long long)p->num_tokens);
  if (p->num_tokens == 0) return DSA_OK;
  DSA_CHECK_ARG(p->index_k && p->slot_mapping && p->pool,
                "indexer_k_cache_write: NULL pointer (index_k=%p slot_mapping=%p pool=%p)", p->index_k,
                (const void*)p->slot_mapping, p->pool);
  DSA_CHECK_ARG(p->index_k_stride >= DSA_INDEX_DIM, "indexer_k_cache_write: index_k_stride=%lld < 128",
                (long long)p->index_k_stride);
  DSA_CHECK_ARG(p->num_slots >= 0, "indexer_k_cache_write: num_slots=%lld < 0", (long long)p->num_slots);
  DSA_CHECK_ARG(p->format != DSA_CACHE_FP8 || reinterpret_cast<uintptr_t>(p->pool) % 4 == 0,
                "indexer_k_cache_write: fp8 pool %p not 4-byte aligned", p->pool);
  constexpr int kThreads = 256;
  const int grid = grid_for(p->num_tokens, kThreads / 32);
  DSA_DISPATCH_FORMAT("indexer_k_cache_write", p->format, kFormat,
                      indexer_k_cache_write_kernel<kFormat><<<grid, kThreads, 0, stream>>>(*p));
  DSA_CUDA_CHECK_LAUNCH();
  return DSA_OK;
}
