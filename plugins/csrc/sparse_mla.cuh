// DSA-TRT sparse MLA: host-side entry points shared by sparse_mla.cu (validation, dispatch) and
// the per-format kernel files (sparse_mla_fp8.cu, sparse_mla_bf16.cu). Internal to the library.
#pragma once

#include <cuda_runtime.h>

#include "dsa_kernels.h"

namespace dsa_sparse_mla {

// Both assume dsa_launch_sparse_mla validated p (non-NULL pointers, num_heads in {16, 32, 64,
// 128}, 1 <= topk <= 2048, alignment) and num_tokens > 0.
int launch_fp8(const DsaSparseMlaParams& p, cudaStream_t stream);   // sparse_mla_fp8.cu
int launch_bf16(const DsaSparseMlaParams& p, cudaStream_t stream);  // sparse_mla_bf16.cu

}  // namespace dsa_sparse_mla
