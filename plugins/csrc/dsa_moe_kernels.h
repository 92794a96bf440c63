// DSA-TRT kernel library: the real-size linear operators, fp8 block-scaled linear and routed MoE
// experts (the numerics of the official reference, docs/architecture.md §8). Same conventions as
// dsa_kernels.h (included from there): params struct + stream, 0 or a negative DSA_ERR_* code,
// no allocation and no host synchronisation in a launcher (CUDA-graph safe).
//
// Activation quantisation (act_quant): per token, groups of 128 consecutive K elements (the last
// group may be partial); s = max(amax, 1e-4) * fp32(1/448) (the official kernel's reciprocal
// multiply, which can differ from amax / 448 in the last bit), rounded up to a power of two when
// pow2_act_scales (the checkpoint's scale_fmt is ue8m0); q = e4m3(x / s).
// Weights: e4m3 [N, K] with weight_scale [ceil(N/128), ceil(K/128)] fp32 (dequantisation
// multipliers, the checkpoint's weight_scale_inv); edge blocks may be partial. The CUDA kernels
// copy weight rows in 16-byte chunks: e4m3 weights need K % 16 == 0 (DSA_ERR_UNSUPPORTED
// otherwise; every V3.2 / GLM-5 K is a multiple of 128) and 16-byte aligned weight pointers.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DSA_FP8_BLOCK 128

// ---------------------------------------------------------------- DsaFp8BlockLinear
// out[t, n] = bf16( sum_kb s_x[t, kb] * s_w[n / 128, kb] * sum_{k in block kb} q_x[t, k] * w[n, k] )
// with the inner sums of e4m3 products accumulated in fp32 per 128-wide K block.
typedef struct {
  const void* x;              // [T, K] bf16, row stride x_stride (elements), inner stride 1
  const void* weight;         // [N, K] e4m3, contiguous
  const float* weight_scale;  // [ceil(N/128), ceil(K/128)] fp32, contiguous
  void* out;                  // [T, N] bf16, row stride out_stride (elements)
  int64_t num_tokens;         // T (0 allowed: nothing to do)
  int n;                      // N
  int k;                      // K
  int64_t x_stride;
  int64_t out_stride;
  int pow2_act_scales;        // 1: ue8m0 activation scales, 0: plain fp32 scales
  void* workspace;            // dsa_fp8_block_linear_workspace_size(T, N, K) bytes, 16-byte aligned
} DsaFp8BlockLinearParams;

size_t dsa_fp8_block_linear_workspace_size(int64_t num_tokens, int n, int k);
int dsa_launch_fp8_block_linear(const DsaFp8BlockLinearParams* p, cudaStream_t stream);
// The plan a launch of (T, N, K) runs, as text for benchmarks and tests, e.g. "tma 128x128 split 1"
// or "tma-swap 128x8 split 2" (GEMM, weight rows x tokens per tile, K splits); honours
// DSA_FP8_LINEAR_PATH (fp8_linear.cu). Thread-local storage, valid until the next call.
const char* dsa_fp8_block_linear_path(int64_t num_tokens, int n, int k);

// ---------------------------------------------------------------- DsaMoeExperts
// out[t] = sum_{j : e = topk_ids[t, j] in [expert_offset, expert_offset + E_local)}
//            topk_weights[t, j] * down_e( act_quant( silu(gate_e(x_t)) * up_e(x_t) ) )
// in fp32; gate_e / up_e / down_e are fp8 block linears (act_quant of x_t first) or, for
// weight_format DSA_MOE_BF16, bf16 linears with fp32 accumulation (no activation quantisation).
// silu(gate) * up is computed in fp32 from the bf16-rounded linear outputs (as the reference's
// bf16 linears return) and cast to bf16 before the down linear (spec/MODEL.md §5: "SiLU·up is
// computed in fp32 and cast to bf16 before W_down"); down_e returns bf16, and the combine adds
// fp32(w * y) to a zero fp32 row in ascending local-expert order, pair order within an expert
// (the reference's per-expert index_add order; no atomics: deterministic). Pairs whose expert
// lives on another rank add nothing, so expert-parallel ranks sum their partial outputs. Ids
// outside [0, num_experts) are invalid input: the torch op and the TensorRT plugin validate on
// the host where they can; the kernel skips such pairs. fp8 weights need hidden % 16 == 0 and
// inter % 16 == 0; top_k <= 32, num_local_experts <= 1024, num_tokens * top_k < 2^31.
// Accuracy (fp8): the e4m3 MMA sums each 128-wide K block with Hopper's ~13-bit tensor-core
// accumulator before the fp32 promotion (as the official fp8_gemm does); through the bf16 / e4m3
// re-roundings of gate, up and h that moves some pairs' h by an e4m3 step, so against an exact-sum
// reference the output differs by ~0.2-1.5% relative L2 (a few % on the worst token), not per-element
// rounding. Each output row is meant to depend only on its own token and experts, not on the rest
// of the batch or the token tiling (the pairwise tier of tests/helpers/moe_tiers.py checks that).
typedef enum {
  DSA_MOE_FP8_BLOCK = 0,
  DSA_MOE_BF16 = 1,
} DsaMoeWeightFormat;

typedef struct {
  const void* x;              // [T, D] bf16, contiguous
  const int32_t* topk_ids;    // [T, top_k] global expert ids, contiguous
  const float* topk_weights;  // [T, top_k] fp32 combine weights, contiguous
  const void* w13;            // [E_local, 2I, D] e4m3 (or bf16): gate rows [0, I), up rows [I, 2I)
  const float* w13_scale;     // [E_local, ceil(2I/128), ceil(D/128)] fp32 (NULL for bf16)
  const void* w2;             // [E_local, D, I] e4m3 (or bf16)
  const float* w2_scale;      // [E_local, ceil(D/128), ceil(I/128)] fp32 (NULL for bf16)
  float* out;                 // [T, D] fp32, contiguous (overwritten)
  int64_t num_tokens;         // T
  int top_k;                  // experts per token (8 for V3.2)
  int num_experts;            // global routed expert count (256)
  int num_local_experts;      // E_local
  int expert_offset;          // global id of local expert 0
  int hidden;                 // D
  int inter;                  // I
  int weight_format;          // DsaMoeWeightFormat
  int pow2_act_scales;        // as in DsaFp8BlockLinearParams
  void* workspace;            // dsa_moe_experts_workspace_size(...) bytes, 16-byte aligned
} DsaMoeExpertsParams;

size_t dsa_moe_experts_workspace_size(int64_t num_tokens, int top_k, int num_local_experts, int hidden, int inter,
                                      int weight_format);
int dsa_launch_moe_experts(const DsaMoeExpertsParams* p, cudaStream_t stream);
// The expert GEMMs a launch of (T, top_k, E_local, inter) runs with fp8 weights, as text:
// "tma-fused 128x128" (prefill: fp8_gemm_ws.cuh, grouped, SwiGLU in the gate/up epilogue),
// "tma-pipe 128x128" / "tma 128x128" (the same unfused) or "legacy 128xBN" (decode: the cp.async
// tile, BN positions); honours DSA_MOE_GEMM_PATH (auto, tma, tma-pipe, tma-fused, legacy;
// moe_experts.cu). Thread-local, valid until the next call.
const char* dsa_moe_experts_path(int64_t num_tokens, int top_k, int num_local_experts, int inter);

#ifdef __cplusplus
}
#endif
