// DSA-TRT sparse MLA: dsa_launch_sparse_mla (dsa_kernels.h), the one validated entry point.
//
//   out[t,h] = sum_j softmax_j(sm_scale * q[t,h] . kv[slot_j]) * kv[slot_j][0:512]   (slot_j valid)
//
// fp8 pool  -> sparse_mla_fp8.cu: fp8 wgmma kernel (q quantised per head to e4m3, P in e4m3).
// bf16 pool -> sparse_mla_bf16.cu: fp32 CUDA-core kernel (exact-comparison mode).
// Slots < 0 and slots >= num_slots are skipped (the pool is never read out of bounds); a row
// with no valid slot gives out = 0 and lse = -inf.
#include <math.h>

#include "common.cuh"
#include "sparse_mla.cuh"

namespace {

constexpr int kMaxTopk = 2048;

bool aligned(const void* ptr, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; }

}  // namespace

extern "C" int dsa_launch_sparse_mla(const DsaSparseMlaParams* p, cudaStream_t stream) {
  DSA_CHECK_ARG(p != nullptr, "sparse_mla: params is NULL");
  DSA_CHECK_ARG(p->num_tokens >= 0, "sparse_mla: num_tokens=%lld < 0", static_cast<long long>(p->num_tokens));
  DSA_DISPATCH_INT4("sparse_mla", "num_heads", p->num_heads, kHeads, 16, 32, 64, 128, (void)kHeads);
  DSA_CHECK_ARG(p->topk >= 1 && p->topk <= kMaxTopk, "sparse_mla: topk=%d out of range [1, %d]", p->topk, kMaxTopk);
  DSA_CHECK_ARG(p->format == DSA_CACHE_FP8 || p->format == DSA_CACHE_BF16,
                "sparse_mla: format=%d unsupported (0 = DSA_CACHE_FP8, 1 = DSA_CACHE_BF16)", p->format);
  if (p->num_tokens == 0) return DSA_OK;
  DSA_CHECK_ARG(p->q != nullptr && p->pool != nullptr && p->slots != nullptr && p->out != nullptr,
                "sparse_mla: q=%p pool=%p slots=%p out=%p: all must be non-NULL", p->q, p->pool,
                static_cast<const void*>(p->slots), p->out);
  DSA_CHECK_ARG(p->num_slots > 0, "sparse_mla: num_slots=%lld must be > 0", static_cast<long long>(p->num_slots));
  DSA_CHECK_ARG(p->q_stride_token >= 0 && p->q_stride_head >= 0,
                "sparse_mla: q strides (%lld, %lld) must be >= 0 (elements)", static_cast<long long>(p->q_stride_token),
                static_cast<long long>(p->q_stride_head));
  DSA_CHECK_ARG(isfinite(p->sm_scale), "sparse_mla: sm_scale=%g is not finite", p->sm_scale);
  if (p->format == DSA_CACHE_BF16) return dsa_sparse_mla::launch_bf16(*p, stream);

  DSA_CHECK_ARG(isfinite(p->kv_scale) && p->kv_scale > 0.f, "sparse_mla: kv_scale=%g must be finite and > 0",
                p->kv_scale);
  // The fp8 kernel reads q as 8-byte (4 x bf16) vectors, the pool as 16-byte chunks, writes 8-byte out vectors.
  DSA_CHECK_ARG(aligned(p->q, 8) && p->q_stride_token % 4 == 0 && p->q_stride_head % 4 == 0,
                "sparse_mla: q=%p with strides (%lld, %lld) elements must be 8-byte aligned with strides "
                "multiple of 4",
                p->q, static_cast<long long>(p->q_stride_token), static_cast<long long>(p->q_stride_head));
  DSA_CHECK_ARG(aligned(p->pool, 16), "sparse_mla: pool=%p must be 16-byte aligned", p->pool);
  DSA_CHECK_ARG(aligned(p->out, 8), "sparse_mla: out=%p must be 8-byte aligned", p->out);
  DSA_CHECK_ARG(p->num_slots <= INT32_MAX + 1LL, "sparse_mla: num_slots=%lld exceeds the int32 slot range",
                static_cast<long long>(p->num_slots));
  return dsa_sparse_mla::launch_fp8(*p, stream);
}
