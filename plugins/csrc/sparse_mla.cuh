// DSA-TRT sparse MLA: host-side entry points shared by sparse_mla.cu (validation, dispatch, the
// split rule) and the per-format kernel files (sparse_mla_fp8.cu, sparse_mla_fp8_split.cu,
// sparse_mla_bf16.cu). Internal to the library.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "dsa_kernels.h"

namespace dsa_sparse_mla {

// Split-KV of the fp8 kernel: token t's tiles [s * tiles_per_split, min((s + 1) * tiles_per_split,
// tiles)) go to chunk s < n_splits (every chunk holds at least one tile). Workspace layout:
// part_out [n_splits, T * H, 512] fp16, the chunk's normalised out in the pool's fp8 units (out /
// kv_scale: a convex combination of e4m3 values, |x| <= 448 * 1.07 with P rounded to e4m3, so fp16
// keeps 11 bits and cannot overflow), then part_lse [n_splits, T * H] fp32 (natural log, -inf for
// a chunk without a valid slot).
constexpr int kMaxTopk = 2048;
constexpr int kMaxSplits = kMaxTopk / 64;  // 32: every chunk holds at least one 64-key tile
struct SplitPlan {
  int n_splits;
  int tiles_per_split;
  __half* part_out;
  float* part_lse;
};

// All assume dsa_launch_sparse_mla validated p (non-NULL pointers, num_heads in {16, 32, 64,
// 128}, 1 <= topk <= 2048, alignment) and num_tokens > 0.
int launch_fp8(const DsaSparseMlaParams& p, cudaStream_t stream);                               // sparse_mla_fp8.cu
int launch_fp8_split(const DsaSparseMlaParams& p, const SplitPlan& plan, cudaStream_t stream);  // sparse_mla_fp8_split.cu
int launch_bf16(const DsaSparseMlaParams& p, cudaStream_t stream);                              // sparse_mla_bf16.cu

// *sms = the current device's SM count (cached per device; safe during graph capture).  sparse_mla.cu
int current_sm_count(int* sms);

}  // namespace dsa_sparse_mla
