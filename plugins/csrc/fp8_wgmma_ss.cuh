// DSA-TRT kernels: e4m3 wgmma with both operands in shared memory for every token-tile width of
// the fp8 block GEMM (fp8_gemm.cuh): dsa_fp8_mma::SS<N>::run(d, desc_a, desc_b, scale_d),
// D[64 x N] (+)= A[64 x 32] * B[N x 32]^T, N = 8, 16, 32 here and 64, 128 from wgmma.cuh.
// d: this thread's N / 2 fp32 accumulators; scale_d = 0 overwrites D. Ordering as in wgmma.cuh.
#pragma once

#include <stdint.h>

#include "wgmma.cuh"

#define DSA_WGMMA_D4 "{%0, %1, %2, %3}"
#define DSA_WGMMA_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define DSA_WGMMA_F4(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])

namespace dsa_fp8_mma {

template <int N>
struct SS;

template <>
struct SS<8> {
  __device__ __forceinline__ static void run(float (&d)[4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 " DSA_WGMMA_D4 ", %4, %5, p, 1, 1;\n}\n"
        : DSA_WGMMA_F4(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct SS<16> {
  __device__ __forceinline__ static void run(float (&d)[8], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 " DSA_WGMMA_D8 ", %8, %9, p, 1, 1;\n}\n"
        : DSA_WGMMA_F8(d, 0)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct SS<32> {
  __device__ __forceinline__ static void run(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " DSA_WGMMA_D16 ", %16, %17, p, 1, 1;\n}\n"
        : DSA_WGMMA_F16(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct SS<64> : dsa_wgmma::SS<64> {};
template <>
struct SS<128> : dsa_wgmma::SS<128> {};

}  // namespace dsa_fp8_mma

#undef DSA_WGMMA_D4
#undef DSA_WGMMA_D8
#undef DSA_WGMMA_F4
