// DSA-TRT kernels: the PTX wrappers several kernels share (sparse MLA, the fp8 GEMMs), free of any
// kernel's layout. sm_90a: setmaxnreg is Hopper's. Kernel-specific wrappers (mbarriers on
// pointers or on addresses, TMA, cp.async variants) stay with their kernel.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace dsa_ptx {

// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// x as lane 0 of the warp holds it. For a value the same in every lane that ptxas cannot prove so
// (read from shared memory, derived from threadIdx or a generic pointer): a broadcast result is
// warp-uniform to ptxas, which can then keep it, and what is computed from it (mbarrier addresses,
// wgmma descriptors), in uniform registers (docs/kernels.md, "Compiler constraints").
template <typename T>
__device__ __forceinline__ T warp_uniform(T x) {
  return __shfl_sync(0xffffffffu, x, 0);
}

// Barrier `id` of the CTA among `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Generic-proxy shared-memory writes (cp.async, st.shared, stmatrix) -> visible to wgmma (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Warp-specialised register budgets: the calling warpgroup's registers per thread grow / shrink to kRegs.
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace dsa_ptx
