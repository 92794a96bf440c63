// DSA-TRT sparse MLA, fp8 pool: device primitives (PTX wrappers) shared by the fp8 kernel.
//
// Everything here is sm_90a (wgmma, setmaxnreg, stmatrix). Layout notes are in
// docs/kernels.md, "Sparse MLA"; the kernel itself is sparse_mla_fp8.cuh.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "ptx.cuh"
#include "wgmma.cuh"

namespace dsa_sparse_mla {

using dsa_ptx::fence_proxy_async;
using dsa_ptx::named_bar_sync;
using dsa_ptx::setmaxnreg_dec;
using dsa_ptx::setmaxnreg_inc;
using dsa_ptx::smem_u32;


// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Plain arrive (release.cta): orders this thread's earlier shared-memory writes before the phase flip.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Arrive once all earlier cp.async of this thread have landed; counts as one of the expected
// arrivals (.noinc).
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Block until the phase of parity `parity` has completed (acquire.cta); `bar`: a shared address.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) { mbar_wait(smem_u32(bar), parity); }

// ---------------------------------------------------------------- copies, barriers, fences
// 16-byte global->shared copy through L2 only; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------- wgmma
// Shared-memory matrix descriptor, no swizzle ("interleave"): core matrices of 8 rows x 16 bytes
// stored as 128 contiguous bytes; lbo = byte distance between core matrices adjacent in K,
// sbo = between core matrices adjacent in M/N (PTX ISA, matrix-descriptor format).
__device__ __forceinline__ uint64_t make_smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32);
}

// Same, 128-byte swizzle, K-major: rows of 128 bytes, 8-row atoms of 1024 bytes (sbo), the 16-byte
// chunk c of row r stored at c ^ (r & 7); atoms 1024-aligned; advancing `addr` by 32 bytes
// inside the row selects the next k32 step (DeepGEMM / CUTLASS convention). lbo is unused.
__device__ __forceinline__ uint64_t make_smem_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

using dsa_wgmma::wgmma_commit;
using dsa_wgmma::wgmma_fence;
using dsa_wgmma::wgmma_wait;

// Keeps the compiler from moving reads/writes of wgmma accumulators across wgmma_wait().
template <int kN>
__device__ __forceinline__ void fence_regs(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

}  // namespace dsa_sparse_mla
