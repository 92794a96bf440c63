// DSA-TRT kernel library: shared helpers of the .cu files (error reporting, dispatch).
//
// Small and stable on purpose; every plugins/csrc/*.cu includes it.
//
//   dsa_set_error(code, fmt, ...)        record a printf-formatted message for
//                                        dsa_last_error_message() (thread-local) and return code.
//   DSA_CHECK_ARG(cond, fmt, ...)        if !cond: return DSA_ERR_INVALID_ARG with the message.
//   DSA_CHECK_SUPPORTED(cond, fmt, ...)  if !cond: return DSA_ERR_UNSUPPORTED with the message.
//   DSA_CUDA_CHECK(call)                 CUDA runtime call; on error return DSA_ERR_CUDA.
//   DSA_CUDA_CHECK_LAUNCH()              after a <<<>>> launch: cudaGetLastError -> DSA_ERR_CUDA.
//   DSA_DISPATCH_INT2/INT4(op, name, value, CONST, A, B[, C, D], stmts...)
//                                        switch on a runtime int; in the matching case
//                                        `constexpr int CONST = value` and stmts run; any other
//                                        value returns DSA_ERR_UNSUPPORTED naming it, e.g.
//                                        "indexer_logits: num_heads=48 unsupported (32, 64)".
//   DSA_DISPATCH_FORMAT(op, value, CONST, stmts...)  the same over DsaCacheFormat (fp8, bf16).
//   dsa_pdl_attr() / dsa_pdl_wait()      programmatic dependent launch (below).
//
// The dispatch macros `return` from the enclosing launcher on an unsupported value, so use them
// only in functions returning int (a DsaStatus). stmts usually end with `break;`-free code such as
// `return launch<CONST>(p, stream);`.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dsa_kernels.h"

#if defined(__GNUC__)
#define DSA_PRINTF_FMT(a, b) __attribute__((format(printf, a, b)))
#else
#define DSA_PRINTF_FMT(a, b)
#endif

// Defined in errors.cu (C++ linkage, internal to the library).
int dsa_set_error(int code, const char* fmt, ...) DSA_PRINTF_FMT(2, 3);
// Raises `kernel`'s dynamic shared-memory limit on the current device to at least smem_bytes (and
// allows cluster sizes over 8 if asked) unless that was done already. These are per-device
// attributes: a process driving several GPUs sets them on each. Thread-safe, and not a stream
// operation (safe while a CUDA graph is captured). DSA_ERR_UNSUPPORTED, naming `op`, when the
// device's opt-in limit is smaller.
int dsa_kernel_attributes(const char* op, const void* kernel, size_t smem_bytes, bool non_portable_clusters = false);

#define DSA_CHECK_ARG(cond, ...)                                   \
  do {                                                             \
    if (!(cond)) return dsa_set_error(DSA_ERR_INVALID_ARG, __VA_ARGS__); \
  } while (0)

#define DSA_CHECK_SUPPORTED(cond, ...)                             \
  do {                                                             \
    if (!(cond)) return dsa_set_error(DSA_ERR_UNSUPPORTED, __VA_ARGS__); \
  } while (0)

#define DSA_CUDA_CHECK(call)                                                                \
  do {                                                                                      \
    cudaError_t dsa_e_ = (call);                                                            \
    if (dsa_e_ != cudaSuccess)                                                              \
      return dsa_set_error(DSA_ERR_CUDA, "%s: %s failed: %s", __func__, #call,              \
                           cudaGetErrorString(dsa_e_));                                     \
  } while (0)

#define DSA_CUDA_CHECK_LAUNCH()                                                             \
  do {                                                                                      \
    cudaError_t dsa_e_ = cudaGetLastError();                                                \
    if (dsa_e_ != cudaSuccess)                                                              \
      return dsa_set_error(DSA_ERR_CUDA, "%s: kernel launch failed: %s", __func__,          \
                           cudaGetErrorString(dsa_e_));                                     \
  } while (0)

#define DSA_DISPATCH_INT2(op, name, value, CONST, A, B, ...)                                \
  switch (value) {                                                                          \
    case (A): { constexpr int CONST = (A); __VA_ARGS__; } break;                            \
    case (B): { constexpr int CONST = (B); __VA_ARGS__; } break;                            \
    default:                                                                                \
      return dsa_set_error(DSA_ERR_UNSUPPORTED, "%s: %s=%d unsupported (%d, %d)", op, name, \
                           (int)(value), (A), (B));                                         \
  }

#define DSA_DISPATCH_INT4(op, name, value, CONST, A, B, C, D, ...)                          \
  switch (value) {                                                                          \
    case (A): { constexpr int CONST = (A); __VA_ARGS__; } break;                            \
    case (B): { constexpr int CONST = (B); __VA_ARGS__; } break;                            \
    case (C): { constexpr int CONST = (C); __VA_ARGS__; } break;                            \
    case (D): { constexpr int CONST = (D); __VA_ARGS__; } break;                            \
    default:                                                                                \
      return dsa_set_error(DSA_ERR_UNSUPPORTED, "%s: %s=%d unsupported (%d, %d, %d, %d)",   \
                           op, name, (int)(value), (A), (B), (C), (D));                     \
  }

#define DSA_DISPATCH_FORMAT(op, value, CONST, ...)                                          \
  switch (value) {                                                                          \
    case DSA_CACHE_FP8: { constexpr int CONST = DSA_CACHE_FP8; __VA_ARGS__; } break;        \
    case DSA_CACHE_BF16: { constexpr int CONST = DSA_CACHE_BF16; __VA_ARGS__; } break;      \
    default:                                                                                \
      return dsa_set_error(DSA_ERR_UNSUPPORTED,                                             \
                           "%s: format=%d unsupported (0 = DSA_CACHE_FP8, 1 = DSA_CACHE_BF16)", \
                           op, (int)(value));                                               \
  }

static inline int64_t dsa_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Programmatic dependent launch (sm_90). The decode chain's kernels (indexer logits, top-k, the
// sparse MLA and its combine) are launched with dsa_pdl_attr(), so each
// one's launch and scheduling overlap the previous kernel's tail instead of following its drain.
// Such a kernel calls dsa_pdl_wait() before its first global-memory access, read or write (the
// previous kernel's writes are visible after it; the kernel may still read what ours writes), and
// lets its own dependents launch once every CTA is past that point. Launched without a
// programmatic predecessor, the wait returns at once.
__device__ __forceinline__ void dsa_pdl_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
// L2 cache policies for the .L2::cache_hint forms of global loads and cp.async (sm_80+).
// kL2EvictFirst marks what a kernel reads once (a decode's key pages, a top-k's score rows): its
// lines are the first replaced when later lines need room, so a stream does not push out what
// stays in L2 (the logits the next kernel reads, other kernels' data, dirty lines whose write-back
// would share DRAM with the stream).
// The value is what createpolicy.fractional.L2::evict_first (fraction 1.0) produces on sm_90
// (ptxas folds the createpolicy to this constant). Kernels take it as a parameter: made in the
// kernel by createpolicy, ptxas 13.0 can drop the createpolicy in front of cp.async and leave the
// LDGSTS reading an unwritten descriptor register (illegal instruction on the H200;
// triton-lang/triton#11660 and IST-DASLab/marlin#44 report the same).
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
// A read-only 16-byte load under an L2 policy (non-coherent path, as __ldg).
__device__ __forceinline__ float4 ldg_f4_policy(const float4* ptr, uint64_t policy) {
  float4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(ptr), "l"(policy));
  return v;
}
static inline cudaLaunchAttribute dsa_pdl_attr() {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}
// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch.
template <typename... KernelArgs, typename... Args>
static inline cudaError_t dsa_launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                                         cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1] = {dsa_pdl_attr()};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}
