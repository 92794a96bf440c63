// DSA-TRT kernels: the fp8 block-scaled GEMM core shared by the linear (fp8_linear.cu) and the
// routed-MoE experts (moe_experts.cu), and the 1x128 activation quantiser of both
// (dsa_moe_kernels.h gives the numerics).
//
// "Swap AB": the weight rows are the wgmma M dimension and the tokens its N dimension. A CTA (two
// warpgroups, 256 threads) computes a 128-row weight tile (one weight-scale row block, so s_w is
// one scalar per K block) against BN token rows (BN = 8..128, picked from the token count: decode
// is bound by the weight read, so small BN and many CTAs; prefill takes BN = 128). Warpgroup wg
// owns weight rows [64 wg, 64 wg + 64) of the tile.
//
// K runs in 128-wide blocks. Per block: 4 x wgmma m64nBNk32 e4m3 (both operands in shared memory,
// K-major, 128-byte swizzle) into a per-block fp32 accumulator, then the promotion
// total += acc * (s_w * s_x[token]), as the reference's fp8_gemm does. Operand tiles come through
// a kStages-deep cp.async ring filled by all 256 threads (each thread owns fixed 16-byte chunks);
// rows past N or past the token range and K past the end of a partial block are zero-filled
// (cp.async src-size 0), stores are predicated.
//
// Token rows come through an optional index list (a_index: output row -> activation row), so the
// MoE's grouped GEMM reads x by the expert-sorted pair list without a gathered copy.
//
// Activations arrive quantised (quant_group_store): e4m3 rows of nkb * 128 bytes (zero past K) and
// fp32 scales [rows, nkb].
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"
#include "dsa_moe_kernels.h"
#include "indexer_tile.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace dsa_fp8 {

using dsa_indexer::align_smem_1024;
using dsa_indexer::cp_async_commit;
using dsa_indexer::cp_async_wait;
using dsa_indexer::fence_operand;
using dsa_indexer::make_desc_sw128;
using dsa_indexer::make_desc_sw128_u32;
using dsa_ptx::fence_proxy_async;  // before the barrier: cp.async writes -> wgmma operand reads

constexpr int kBlock = DSA_FP8_BLOCK;  // 128: K block and weight-scale block
constexpr int kTileM = 128;            // weight rows per CTA
constexpr int kThreads = 256;          // two warpgroups
constexpr float kE4m3Max = 448.f;
constexpr float kE4m3MaxInv = 1.f / 448.f;  // the official act_quant multiplies by the fp32 reciprocal
constexpr float kAmaxFloor = 1e-4f;

// ---------------------------------------------------------------- activation quantisation
__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// Four consecutive bf16 values from p, of which `valid` exist (the rest read as 0); vec: p is
// 8-byte aligned (one 8-byte load when all four exist).
__device__ __forceinline__ void load_bf16x4(const uint16_t* p, int valid, bool vec, float (&v)[4]) {
  if (vec && valid >= 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    v[0] = __uint_as_float(u.x << 16);
    v[1] = __uint_as_float(u.x & 0xFFFF0000u);
    v[2] = __uint_as_float(u.y << 16);
    v[3] = __uint_as_float(u.y & 0xFFFF0000u);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = e < valid ? bf16_bits_to_float(p[e]) : 0.f;
  }
}

// s = max(amax, 1e-4) * fp32(1/448) (not amax / 448: the two differ in the last bit, and x / s
// often lands on an e4m3 tie), rounded up to a power of two for ue8m0 (adding the mantissa mask
// carries into the exponent unless the mantissa is already zero: a positive normal becomes
// 2^ceil(log2 s); s >= 2.2e-7 is always normal).
__device__ __forceinline__ float act_scale(float amax, bool pow2) {
  float s = __fmul_rn(fmaxf(amax, kAmaxFloor), kE4m3MaxInv);
  if (pow2) s = __uint_as_float((__float_as_uint(s) + 0x7FFFFFu) & 0xFF800000u);
  return s;
}

// e4m3(x / s) of two values (quant4: four), packed little-endian (saturating: |x / s| <= 448 up to rounding).
// pow2 (s = 2^k, act_scale's ue8m0 scales): x * 2^-k instead of the IEEE division. 2^-k is exact
// (biased exponent 254 - E; a finite amax gives s in [2^-22, 2^120]), and x / s and x * 2^-k are
// both the correctly rounded value of the same real number, subnormal results included: the same
// bits, for a multiply in place of a ~10-instruction division per element. An infinite amax keeps
// the division.
__device__ __forceinline__ uint16_t quant2(float a, float b, float s, bool pow2) {
  float d0, d1;
  if (pow2 && s < INFINITY) {
    const float r = __uint_as_float(0x7F000000u - __float_as_uint(s));
    d0 = __fmul_rn(a, r);
    d1 = __fmul_rn(b, r);
  } else {
    d0 = __fdiv_rn(a, s);
    d1 = __fdiv_rn(b, s);
  }
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(d0, d1), __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ uint32_t quant4(const float (&v)[4], float s, bool pow2) {
  return static_cast<uint32_t>(quant2(v[0], v[1], s, pow2)) | (static_cast<uint32_t>(quant2(v[2], v[3], s, pow2)) << 16);
}

// The MoE's h = bf16(silu(gate) * up) of the bf16 gate and up (the reference casts the fp32 product
// to bf16 before the down linear), as a float; moe_swiglu_kernel and the gate/up GEMM's fused
// epilogue (fp8_gemm_ws.cuh kSwiGLU) share it, so their bits agree.
__device__ __forceinline__ float swiglu_bf16(float gate, float up) {
  const float silu = __fdiv_rn(gate, __fadd_rn(1.f, expf(-gate)));
  return bf16_bits_to_float(float_to_bf16_bits(__fmul_rn(silu, up)));
}

// One warp quantises one 128-group: lane l holds elements [4l, 4l + 4) (zero past K). -> the
// lane's 4 e4m3 bytes; *s = the group's scale (every lane).
__device__ __forceinline__ uint32_t quant_group(const float (&v)[4], bool pow2, float* s) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  *s = act_scale(amax, pow2);
  return quant4(v, *s, pow2);
}
// quant_group, then the 128 e4m3 bytes at q_group (4-byte aligned) and, from lane 0, the scale.
__device__ __forceinline__ void quant_group_store(const float (&v)[4], bool pow2, uint8_t* q_group, float* s_out,
                                                  int lane) {
  float s;
  reinterpret_cast<uint32_t*>(q_group)[lane] = quant_group(v, pow2, &s);
  if (lane == 0) *s_out = s;
}

// ---------------------------------------------------------------- GEMM core
struct GemmArgs {
  const uint8_t* w;          // [E][N, K] e4m3 (E = 1 for the linear), rows of K bytes
  const float* w_scale;      // [E][ceil(N/128), nkb] fp32
  int64_t w_expert_stride;   // N * K (bytes)
  int64_t ws_expert_stride;  // ceil(N/128) * nkb (floats)
  int n, k, nkb;             // N, K, ceil(K/128)
  const uint8_t* a;          // [rows, a_stride] e4m3 activations, zero past K
  const float* a_scale;      // [rows, nkb] fp32
  int64_t a_stride;          // bytes per activation row (nkb * 128)
  const int32_t* a_index;    // [rows] activation row of each output row, or NULL (identity)
  void* out;                 // bf16 [rows, out_stride], or fp32 partials [splits][rows, out_stride]
  int64_t out_stride;        // elements
  int64_t out_split_stride;  // elements between the fp32 partial slabs of two K splits
  int vec_store;             // 1: out rows are 16-byte aligned (vector stores)
  // the linear: token rows [0, rows), K blocks split in runs of kb_per_split
  int64_t rows;
  int kb_per_split;
  // the MoE: tile t covers sorted rows [tile_start[t], min(+BN, expert_offsets[e + 1])) of expert
  // e = tile_expert[t]; tiles >= *num_tiles have no work
  const int32_t* tile_expert;
  const int32_t* tile_start;
  const int32_t* expert_offsets;
  const int32_t* num_tiles;
};

template <int BN>
struct Tile {
  static constexpr int kW = kTileM * kBlock;  // weight tile bytes (16 KB)
  static constexpr int kA = BN * kBlock;      // activation tile bytes (multiple of 1024)
  static constexpr int kS = 1024;             // BN activation scales, padded: stages stay 1024-aligned
  static constexpr int kStage = kW + kA + kS;
  static constexpr int kStages = BN == 64 ? 4 : 5;  // BN <= 64: two CTAs per SM; 128: one
  static constexpr int kAChunks = (BN * 8 + kThreads - 1) / kThreads;  // 16-byte activation chunks per thread
  // the epilogue's transposed tile [BN][kTileM + pad] (pad: conflict-free writes, rows 16-aligned)
  static constexpr int kOutPadBf16 = kTileM + 8;
  static constexpr int kOutPadF32 = kTileM + 4;
  static constexpr int kSmem = kStages * kStage + 1024;  // + alignment slack
  static_assert(kStages * kStage >= BN * kOutPadF32 * 4, "epilogue tile must fit the ring");
  static_assert(BN * 4 <= kS, "scales must fit their slot");
};
template <int BN>
constexpr int kCtasPerSm = BN >= 128 ? 1 : 2;

__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_4_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// The fp32 promotion of one K block, total += acc * scale, on wgmma's m64nN accumulator layout:
// acc[4j + {0,1}] are row r, columns 8j + 2c + {0,1}; acc[4j + {2,3}] row r + 8, the same columns.
// promote_by_row: one scale per row (s_lo for row r, s_hi for row r + 8), every j in [J0, J1)
// (the fused gate/up tile: its gate and up column halves have their own weight scales).
template <int R, int J0 = 0, int J1 = R / 4>
__device__ __forceinline__ void promote_by_row(float (&total)[R], const float (&acc)[R], float s_lo, float s_hi) {
#pragma unroll
  for (int j = J0; j < J1; ++j) {
    total[4 * j + 0] = fmaf(acc[4 * j + 0], s_lo, total[4 * j + 0]);
    total[4 * j + 1] = fmaf(acc[4 * j + 1], s_lo, total[4 * j + 1]);
    total[4 * j + 2] = fmaf(acc[4 * j + 2], s_hi, total[4 * j + 2]);
    total[4 * j + 3] = fmaf(acc[4 * j + 3], s_hi, total[4 * j + 3]);
  }
}

// promote_by_column: group j only, one scale per column (s_even for 8j + 2c, s_odd for 8j + 2c + 1).
template <int R>
__device__ __forceinline__ void promote_by_column(float (&total)[R], const float (&acc)[R], int j, float s_even,
                                                  float s_odd) {
  total[4 * j + 0] = fmaf(acc[4 * j + 0], s_even, total[4 * j + 0]);
  total[4 * j + 1] = fmaf(acc[4 * j + 1], s_odd, total[4 * j + 1]);
  total[4 * j + 2] = fmaf(acc[4 * j + 2], s_even, total[4 * j + 2]);
  total[4 * j + 3] = fmaf(acc[4 * j + 3], s_odd, total[4 * j + 3]);
}

// One CTA's tile: weight rows [128 m_tile, +128) of expert `expert` against output rows
// [row_begin, row_end) (at most BN), K blocks [kb_begin, kb_end). kF32Out: fp32 partials of split
// `split` (the linear's split-K), else bf16 rows.
template <int BN, bool kF32Out>
__device__ __forceinline__ void gemm_tile(const GemmArgs& g, uint8_t* smem, int expert, int m_tile, int64_t row_begin,
                                          int64_t row_end, int kb_begin, int kb_end, int split) {
  using L = Tile<BN>;
  constexpr int S = L::kStages;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int m0 = m_tile * kTileM;
  const uint8_t* w = g.w + expert * g.w_expert_stride;
  const float* ws = g.w_scale + expert * g.ws_expert_stride + static_cast<int64_t>(m_tile) * g.nkb;

  // This thread's chunks: column cch (16 bytes) of tile rows crow + 32 i, stored at the swizzled
  // position (chunk ^ row % 8) of a 128-byte row. The weight tile takes 4 rows per thread, the
  // activation tile kAChunks (rows < BN), the scales one float (tid < BN).
  const int crow = tid >> 3, cch = tid & 7;
  const uint32_t dst0 = crow * kBlock + ((cch ^ (crow & 7)) << 4);
  const uint8_t* wsrc[4];
  bool wok[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = m0 + crow + 32 * i;
    wok[i] = r < g.n;
    wsrc[i] = w + static_cast<int64_t>(wok[i] ? r : 0) * g.k + cch * 16;
  }
  const uint8_t* asrc[L::kAChunks];
  bool aok[L::kAChunks];
#pragma unroll
  for (int i = 0; i < L::kAChunks; ++i) {
    const int64_t r = row_begin + crow + 32 * i;
    aok[i] = crow + 32 * i < BN && r < row_end;
    const int64_t ar = aok[i] ? (g.a_index ? g.a_index[r] : r) : 0;
    asrc[i] = g.a + ar * g.a_stride + cch * 16;
  }
  const bool sok = tid < BN && row_begin + tid < row_end;
  const float* ssrc = g.a_scale;
  if (sok) ssrc += (g.a_index ? g.a_index[row_begin + tid] : row_begin + tid) * static_cast<int64_t>(g.nkb);

  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // the same base and this warpgroup's operand offset, warp-uniform to ptxas, for the wgmma
  // descriptors only: they stay in uniform registers (docs/kernels.md, "Compiler constraints")
  const uint32_t sbase_u = dsa_ptx::warp_uniform(sbase);
  const uint32_t wg_off = dsa_ptx::warp_uniform(static_cast<uint32_t>(wg * 64 * kBlock));
  auto issue = [&](int stage, int kb) {
    const uint32_t st = sbase + stage * L::kStage;
    const bool kok = kb * kBlock + cch * 16 < g.k;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool ok = wok[i] && kok;
      cp_async_16_zfill(st + dst0 + i * 32 * kBlock, ok ? wsrc[i] + kb * kBlock : g.w, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < L::kAChunks; ++i)
      if (crow + 32 * i < BN)
        cp_async_16_zfill(st + L::kW + dst0 + i * 32 * kBlock, aok[i] ? asrc[i] + kb * kBlock : g.a, aok[i] ? 16 : 0);
    if (tid < BN) cp_async_4_zfill(st + L::kW + L::kA + 4 * tid, sok ? ssrc + kb : g.a_scale, sok ? 4 : 0);
  };

  const int nk = kb_end - kb_begin;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < nk) issue(s, kb_begin + s);
    cp_async_commit();
  }

  float total[BN / 2], acc[BN / 2];
#pragma unroll
  for (int j = 0; j < BN / 2; ++j) total[j] = 0.f;
  const int c = lane & 3;

  for (int i = 0; i < nk; ++i) {
    cp_async_wait<S - 2>();  // this thread's copies of block i have landed
    fence_proxy_async();
    __syncthreads();  // everyone's copies of block i landed; everyone is done with block i - 1
    if (i + S - 1 < nk) issue((i + S - 1) % S, kb_begin + i + S - 1);
    cp_async_commit();  // (an empty group past the end keeps the wait count uniform)

    uint8_t* st = smem + (i % S) * L::kStage;
    const uint32_t st_u = sbase_u + (i % S) * L::kStage;  // uniform: no R2UR in the wgmma chain
    const uint64_t da = make_desc_sw128_u32(st_u + wg_off), db = make_desc_sw128_u32(st_u + L::kW);
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) fence_operand(acc[j]);
    dsa_wgmma::wgmma_fence();
    dsa_wgmma::ss_k128<BN>(acc, da, db);
    dsa_wgmma::wgmma_commit();
    dsa_wgmma::wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) fence_operand(acc[j]);

    // acc[4j + {0,1}]: weight row 16 warp + g, token columns 8j + 2c + {0,1}; [4j + {2,3}]: row + 8
    const float sw = __ldg(ws + kb_begin + i);
    const float* sx = reinterpret_cast<const float*>(st + L::kW + L::kA);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const float2 s2 = *reinterpret_cast<const float2*>(sx + 8 * j + 2 * c);
      promote_by_column(total, acc, j, sw * s2.x, sw * s2.y);
    }
  }

  // Epilogue: transpose through shared memory ([token][weight row]) so each output row segment of
  // 128 features is written with 16-byte stores.
  cp_async_wait<0>();
  __syncthreads();  // the ring is free
  using OutT = typename std::conditional<kF32Out, float, uint16_t>::type;
  constexpr int kPad = kF32Out ? L::kOutPadF32 : L::kOutPadBf16;
  OutT* tile = reinterpret_cast<OutT*>(smem);
  const int r_lo = 64 * wg + 16 * warp + (lane >> 2);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * j + 2 * c + (e & 1), row = r_lo + ((e & 2) ? 8 : 0);
      if constexpr (kF32Out)
        tile[col * kPad + row] = total[4 * j + e];
      else
        tile[col * kPad + row] = float_to_bf16_bits(total[4 * j + e]);
    }
  }
  __syncthreads();
  constexpr int kPerChunk = 16 / sizeof(OutT);    // elements per 16-byte store
  constexpr int kChunksPerRow = kTileM / kPerChunk;
  OutT* out = static_cast<OutT*>(g.out) + (kF32Out ? split * g.out_split_stride : 0);
  for (int u = tid; u < BN * kChunksPerRow; u += kThreads) {
    const int r = u / kChunksPerRow, n = m0 + (u % kChunksPerRow) * kPerChunk;
    const int64_t row = row_begin + r;
    if (row >= row_end || n >= g.n) continue;
    const OutT* src = tile + r * kPad + (n - m0);
    OutT* dst = out + row * g.out_stride + n;
    if (g.vec_store && n + kPerChunk <= g.n) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < kPerChunk && n + e < g.n; ++e) dst[e] = src[e];
    }
  }
}

}  // namespace dsa_fp8
