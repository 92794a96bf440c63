// DSA-TRT kernels: the e4m3 wgmma instructions (sm_90a) the kernels issue, one struct per form.
//
//   dsa_wgmma::RS<N>::run(d, a0, a1, a2, a3, desc_b, scale_d)
//       D[64 x N] (+)= A[64 x 32] (registers: this thread's 4 fragment words) * B[N x 32]^T (shared
//       memory, by descriptor); N = 32, 64, 128, 256. dsa_wgmma::rs<N>(d, a[4], desc_b, scale_d): the
//       same with the fragment as an array.
//   dsa_wgmma::SS<N>::run(d, desc_a, desc_b, scale_d)
//       D[64 x N] (+)= A[64 x 32] (shared) * B[N x 32]^T (shared); N = 8, 16, 32, 64, 128.
//       dsa_wgmma::ss_k128<N>(d, desc_a, desc_b): D = A[64 x 128] * B[N x 128]^T, one 128-wide K
//       block of 128-byte-swizzled K-major operands in four k32 steps.
//
// d: this thread's N / 2 fp32 accumulators; scale_d = 0 overwrites D, 1 accumulates. The callers
// order them with wgmma_fence / wgmma_commit / wgmma_wait (below). The operand lists, N / 2 accumulators long,
// are spelled once by the macros below.
#pragma once

#include <stdint.h>

#define DSA_WGMMA_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define DSA_WGMMA_R1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DSA_WGMMA_R2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define DSA_WGMMA_R3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DSA_WGMMA_R4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define DSA_WGMMA_R5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define DSA_WGMMA_R6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define DSA_WGMMA_R7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define DSA_WGMMA_D4 "{%0, %1, %2, %3}"
#define DSA_WGMMA_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define DSA_WGMMA_D16 "{" DSA_WGMMA_R0 "}"
#define DSA_WGMMA_D32 "{" DSA_WGMMA_R0 ", " DSA_WGMMA_R1 "}"
#define DSA_WGMMA_D64 "{" DSA_WGMMA_R0 ", " DSA_WGMMA_R1 ", " DSA_WGMMA_R2 ", " DSA_WGMMA_R3 "}"
#define DSA_WGMMA_D128                                                                                 \
  "{" DSA_WGMMA_R0 ", " DSA_WGMMA_R1 ", " DSA_WGMMA_R2 ", " DSA_WGMMA_R3 ", " DSA_WGMMA_R4 ", " DSA_WGMMA_R5 \
  ", " DSA_WGMMA_R6 ", " DSA_WGMMA_R7 "}"
#define DSA_WGMMA_F4(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define DSA_WGMMA_F8(d, i)                                                                              \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define DSA_WGMMA_F16(d) DSA_WGMMA_F8(d, 0), DSA_WGMMA_F8(d, 8)
#define DSA_WGMMA_F32(d) DSA_WGMMA_F16(d), DSA_WGMMA_F8(d, 16), DSA_WGMMA_F8(d, 24)
#define DSA_WGMMA_F64(d) \
  DSA_WGMMA_F32(d), DSA_WGMMA_F8(d, 32), DSA_WGMMA_F8(d, 40), DSA_WGMMA_F8(d, 48), DSA_WGMMA_F8(d, 56)
#define DSA_WGMMA_F128(d)                                                                                    \
  DSA_WGMMA_F64(d), DSA_WGMMA_F8(d, 64), DSA_WGMMA_F8(d, 72), DSA_WGMMA_F8(d, 80), DSA_WGMMA_F8(d, 88),      \
      DSA_WGMMA_F8(d, 96), DSA_WGMMA_F8(d, 104), DSA_WGMMA_F8(d, 112), DSA_WGMMA_F8(d, 120)

namespace dsa_wgmma {

// wgmma.fence before the first wgmma that reads registers written since; commit closes a group of
// issued wgmmas; wgmma_wait<N> waits until at most N groups are pending.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int N>
struct RS;
template <int N>
struct SS;

template <>
struct RS<32> {
  __device__ __forceinline__ static void run(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " DSA_WGMMA_D16
        ", {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
        : DSA_WGMMA_F16(d)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct RS<64> {
  __device__ __forceinline__ static void run(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " DSA_WGMMA_D32
        ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : DSA_WGMMA_F32(d)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct RS<128> {
  __device__ __forceinline__ static void run(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " DSA_WGMMA_D64
        ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : DSA_WGMMA_F64(d)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct RS<256> {
  __device__ __forceinline__ static void run(float (&d)[128], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 " DSA_WGMMA_D128
        ", {%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
        : DSA_WGMMA_F128(d)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d));
  }
};

// RS<N>::run with the A fragment as an array.
template <int N, int R>
__device__ __forceinline__ void rs(float (&d)[R], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  RS<N>::run(d, a[0], a[1], a[2], a[3], desc_b, scale_d);
}

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
struct SS<64> {
  __device__ __forceinline__ static void run(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " DSA_WGMMA_D32 ", %32, %33, p, 1, 1;\n}\n"
        : DSA_WGMMA_F32(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <>
struct SS<128> {
  __device__ __forceinline__ static void run(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " DSA_WGMMA_D64 ", %64, %65, p, 1, 1;\n}\n"
        : DSA_WGMMA_F64(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

// One 128-wide K block: four k32 wgmmas, the first overwriting D. With 128-byte-swizzled K-major
// rows a k32 step is +32 bytes = +2 in descriptor units (the 16-byte-granular start address).
template <int N, int R>
__device__ __forceinline__ void ss_k128(float (&d)[R], uint64_t desc_a, uint64_t desc_b) {
  SS<N>::run(d, desc_a + 0, desc_b + 0, 0);
  SS<N>::run(d, desc_a + 2, desc_b + 2, 1);
  SS<N>::run(d, desc_a + 4, desc_b + 4, 1);
  SS<N>::run(d, desc_a + 6, desc_b + 6, 1);
}

}  // namespace dsa_wgmma
