// DSA-TRT kernels: DsaMoeExperts (dsa_moe_kernels.h), the routed experts of one rank on the pairs
// (token t, slot j) whose expert is local. Every size is static (bounded by P = T * top_k pairs);
// what depends on the routing lives in the workspace, so nothing syncs with the host and the
// launch sequence is CUDA-graph safe:
//   1. moe_prep (one CTA per 2048 pairs; above one chunk a count and a scan kernel first): counts
//      per local expert, exclusive scan, the expert-sorted pair list
//      (stable: pair order within an expert), pair -> position map, and the tile table of the
//      grouped GEMMs (tiles of BN positions of one expert; their count is on the device).
//   2. act_quant of x (fp8_linear.cu's numerics, here per 128 columns of D): once per token
//      (legacy), or written to each of its positions in the sorted order (tma paths).
//   3. grouped GEMM 1 over (128 rows of w13_e) x (tiles) -> gate|up bf16 [P, 2I], one of
//      - "tma-fused" (prefill: more than 64 pairs per local expert on average, I % 128 == 0; or
//        DSA_MOE_GEMM_PATH=tma-fused): fp8_gemm_ws.cuh's warp-specialised TMA GEMM with kPipe and
//        kSwiGLU, grouped (128 positions x one 128-column group of h per unit: its 64 + 64 gate
//        and up rows twice; a persistent grid over the units of the device's tile count), step 4
//        in its epilogue (no gate|up in memory). TMA cannot gather rows, so step 2 writes the
//        quantised rows of x per position, in the sorted order (P rows, not T);
//      - "tma-pipe" (the same GEMM unfused: 128 positions x 128 weight rows per unit; prefill when
//        I % 128 != 0, or DSA_MOE_GEMM_PATH=tma-pipe; "tma" also without the pipelined mainloop);
//      - "legacy" (decode): fp8_gemm.cuh's cp.async swap-AB tile, BN = 8..128 positions per
//        tile, x rows gathered through the sorted pair list. Grid: the static bound
//        sum_e ceil(P_e / BN) <= ceil(P / BN) + E_local tiles; CTAs past the real count exit.
//   4. swiglu_quant: h = bf16(silu(gate) * up) in fp32, act_quant per 128 columns -> e4m3 + scales
//      (a kernel of its own unless fused into 3).
//   5. grouped GEMM 2 (down, the same path) -> y bf16 [P, D].
//   6. combine: out[t] = sum_j w[t, j] * y[pos(t, j)] in fp32, in ascending expert order (the
//      reference's; deterministic, no atomics); tokens without a local pair get 0.
// Both paths compute every row's sums in the same order (K blocks in order, one wgmma k128 per
// block, the same promotion), so a row's bits do not depend on the path or on the other rows.
// bf16 weights (the exact-comparison mode) take steps 1, 3', 4 (bf16 h), 5', 6 with 3'/5' a plain
// CUDA-core warp-per-output GEMM: correct, not fast.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>

#include <cub/block/block_scan.cuh>

#include "fp8_gemm_ws_launch.cuh"

namespace dsa_moe {

using namespace dsa_fp8;

constexpr int kPrepThreads = 1024;
constexpr int kPrepWarps = kPrepThreads / 32;
constexpr int kMaxLocalExperts = kPrepThreads;  // one prep thread per local expert
constexpr int kMaxTopK = 32;
constexpr int kMinBn = 8;  // the tile table is sized for the smallest token tile

// ---------------------------------------------------------------- 1. routing prep
// The pairs are cut into chunks of kPrepChunk (G = ceil(P / kPrepChunk) chunks, one CTA each).
// One chunk (decode): moe_prep_kernel alone. More (prefill): moe_prep_count_kernel counts each
// chunk's pairs per local expert, moe_prep_scan_kernel turns the counts into each (chunk, expert)'s
// first position and writes the offsets and the tile table, then moe_prep_kernel places each
// chunk's pairs. Either way a pair's position is its expert's offset + the number of earlier pairs
// of that expert (pair order): the same positions whatever G.
constexpr int kPrepChunk = 2048;

__device__ __forceinline__ int prep_local_expert(const int32_t* __restrict__ ids, int pidx, int end, int num_experts,
                                                 int num_local, int expert_offset) {
  if (pidx >= end) return -1;
  const int id = ids[pidx], le = id - expert_offset;
  return (id >= 0 && id < num_experts && le >= 0 && le < num_local) ? le : -1;
}

// Thread e < num_local holds tot = expert e's pair count; all kPrepThreads threads call it. ->
// e's first position; writes expert_offsets[0..num_local], *num_tiles and the tile table.
__device__ __forceinline__ int prep_scan_experts(int tot, int num_local, int bn, int32_t* expert_offsets,
                                                 int32_t* num_tiles, int32_t* tile_expert, int32_t* tile_start) {
  using Scan = cub::BlockScan<int, kPrepThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int tid = threadIdx.x;
  const int ntile = tid < num_local ? (tot + bn - 1) / bn : 0;
  int off = 0, total = 0, toff = 0, ttotal = 0;
  Scan(scan_tmp).ExclusiveSum(tid < num_local ? tot : 0, off, total);
  __syncthreads();
  Scan(scan_tmp).ExclusiveSum(ntile, toff, ttotal);
  if (tid < num_local) {
    expert_offsets[tid] = off;
    for (int j = 0; j < ntile; ++j) {
      tile_expert[toff + j] = tid;
      tile_start[toff + j] = off + j * bn;
    }
  }
  if (tid == 0) {
    expert_offsets[num_local] = total;
    *num_tiles = ttotal;
  }
  return off;
}

// Chunk g's pairs per local expert -> chunk_cnt[g * num_local + e] (shared atomics: a count).
__global__ void __launch_bounds__(kPrepThreads) moe_prep_count_kernel(const int32_t* __restrict__ ids, int num_pairs,
                                                                      int num_experts, int num_local,
                                                                      int expert_offset, int32_t* chunk_cnt) {
  extern __shared__ int32_t cnt[];  // [num_local]
  for (int i = threadIdx.x; i < num_local; i += kPrepThreads) cnt[i] = 0;
  __syncthreads();
  const int begin = blockIdx.x * kPrepChunk, end = min(num_pairs, begin + kPrepChunk);
  for (int pidx = begin + threadIdx.x; pidx < end; pidx += kPrepThreads) {
    const int le = prep_local_expert(ids, pidx, end, num_experts, num_local, expert_offset);
    if (le >= 0) atomicAdd(&cnt[le], 1);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_local; i += kPrepThreads) chunk_cnt[blockIdx.x * num_local + i] = cnt[i];
}

// One CTA: the counts of the G chunks -> offsets and tile table; chunk_cnt becomes each (chunk,
// expert)'s first position (in place).
__global__ void __launch_bounds__(kPrepThreads) moe_prep_scan_kernel(int num_chunks, int num_local, int bn,
                                                                     int32_t* chunk_cnt, int32_t* expert_offsets,
                                                                     int32_t* num_tiles, int32_t* tile_expert,
                                                                     int32_t* tile_start) {
  const int tid = threadIdx.x;
  int tot = 0;
  if (tid < num_local)
    for (int g = 0; g < num_chunks; ++g) tot += chunk_cnt[g * num_local + tid];
  int run = prep_scan_experts(tot, num_local, bn, expert_offsets, num_tiles, tile_expert, tile_start);
  if (tid < num_local)
    for (int g = 0; g < num_chunks; ++g) {
      const int c = chunk_cnt[g * num_local + tid];
      chunk_cnt[g * num_local + tid] = run;
      run += c;
    }
}

// CTA g places chunk g. Pass 1: warp w walks its part of the chunk 32 pairs at a time; lanes with
// the same local expert find each other (match_any) and their leader adds their count to
// cnt[w][e]. cnt then becomes each (expert, warp)'s first position: from chunk_base[g][e] (more
// than one chunk) or from this CTA's own scan, which also writes the offsets and the tile table
// (one chunk: chunk_base NULL). Pass 2 walks again and places each pair at its position + its
// rank among the earlier lanes of the same expert.
__global__ void __launch_bounds__(kPrepThreads) moe_prep_kernel(const int32_t* __restrict__ ids, int num_pairs,
                                                                int top_k, int num_experts, int num_local,
                                                                int expert_offset, int bn, const int32_t* chunk_base,
                                                                int32_t* sorted_token, int32_t* sorted_expert,
                                                                int32_t* pair_pos, int32_t* expert_offsets,
                                                                int32_t* num_tiles, int32_t* tile_expert,
                                                                int32_t* tile_start) {
  extern __shared__ int32_t cnt[];  // [kPrepWarps][num_local]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < kPrepWarps * num_local; i += kPrepThreads) cnt[i] = 0;
  __syncthreads();

  const int c_begin = blockIdx.x * kPrepChunk, c_end = chunk_base ? min(num_pairs, c_begin + kPrepChunk) : num_pairs;
  const int per_warp = (c_end - c_begin + kPrepWarps - 1) / kPrepWarps;
  const int begin = c_begin + warp * per_warp, end = min(c_end, begin + per_warp);
  for (int base = begin; base < end; base += 32) {
    const int le = prep_local_expert(ids, base + lane, end, num_experts, num_local, expert_offset);
    const unsigned peers = __match_any_sync(0xffffffffu, le);
    if (le >= 0 && lane == __ffs(peers) - 1) cnt[warp * num_local + le] += __popc(peers);
    __syncwarp();  // the next round's leader of this expert may be another lane: order the shared RMWs
  }
  __syncthreads();

  int run = 0;
  if (chunk_base) {
    if (tid < num_local) run = chunk_base[blockIdx.x * num_local + tid];
  } else {
    int tot = 0;
    if (tid < num_local)
      for (int w = 0; w < kPrepWarps; ++w) tot += cnt[w * num_local + tid];
    run = prep_scan_experts(tot, num_local, bn, expert_offsets, num_tiles, tile_expert, tile_start);
  }
  if (tid < num_local)
    for (int w = 0; w < kPrepWarps; ++w) {
      const int c = cnt[w * num_local + tid];
      cnt[w * num_local + tid] = run;
      run += c;
    }
  __syncthreads();

  const unsigned lanes_below = (1u << lane) - 1u;
  for (int base = begin; base < end; base += 32) {
    const int pidx = base + lane, le = prep_local_expert(ids, pidx, end, num_experts, num_local, expert_offset);
    const unsigned peers = __match_any_sync(0xffffffffu, le);
    const int pos = le >= 0 ? cnt[warp * num_local + le] + __popc(peers & lanes_below) : -1;
    __syncwarp();
    if (le >= 0 && lane == __ffs(peers) - 1) cnt[warp * num_local + le] += __popc(peers);
    __syncwarp();
    if (pidx < end) {
      pair_pos[pidx] = pos;
      if (pos >= 0) {
        sorted_token[pos] = pidx / top_k;
        sorted_expert[pos] = le;
      }
    }
  }
}

// ---------------------------------------------------------------- 2. act_quant of x
// One warp per (token t, K block kb), the 1x128 quantiser. pair_pos NULL (legacy): the token's row
// of q [T, nkb 128] and its scale at scale[t * nkb + kb]. Else (tma paths: TMA cannot gather rows)
// the bytes go to each of the token's local positions pos = pair_pos[t * top_k + j] >= 0 (rows of
// q [P, nkb 128]) and the scale to scale[kb * p_pad + pos] (transposed: a tile's scales of one K
// block are one TMA box).
__global__ void __launch_bounds__(256) moe_act_quant_kernel(const uint16_t* __restrict__ x, int64_t num_tokens,
                                                             int d, int nkb, const int32_t* __restrict__ pair_pos,
                                                             int top_k, uint8_t* __restrict__ q,
                                                             float* __restrict__ scale, int64_t p_pad, int pow2,
                                                             int vec) {
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= num_tokens * nkb) return;
  const int64_t t = gw / nkb;
  const int kb = static_cast<int>(gw % nkb);
  const int k0 = kb * kBlock + 4 * lane;
  float v[4];
  load_bf16x4(x + t * d + k0, d - k0, vec != 0, v);
  if (pair_pos == nullptr) {
    quant_group_store(v, pow2 != 0, q + (t * nkb + kb) * kBlock, scale + t * nkb + kb, lane);
    return;
  }
  const int my_pos = lane < top_k ? pair_pos[t * top_k + lane] : -1;  // top_k <= kMaxTopK = 32
  float s;
  const uint32_t packed = quant_group(v, pow2 != 0, &s);
  for (int j = 0; j < top_k; ++j) {
    const int pos = __shfl_sync(0xffffffffu, my_pos, j);
    if (pos < 0) continue;
    reinterpret_cast<uint32_t*>(q + (static_cast<int64_t>(pos) * nkb + kb) * kBlock)[lane] = packed;
    if (lane == 0) scale[kb * p_pad + pos] = s;
  }
}

// ---------------------------------------------------------------- 3 / 5. grouped fp8 GEMM
template <int BN>
__global__ void __launch_bounds__(kThreads, kCtasPerSm<BN>) moe_gemm_kernel(const GemmArgs g) {
  const int tile = blockIdx.y;
  if (tile >= *g.num_tiles) return;  // CTA-uniform, before any barrier
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  const int e = g.tile_expert[tile];
  const int64_t rb = g.tile_start[tile], re = min(rb + BN, static_cast<int64_t>(g.expert_offsets[e + 1]));
  gemm_tile<BN, false>(g, smem, e, blockIdx.x, rb, re, 0, g.nkb, 0);
}

// ---------------------------------------------------------------- 3' / 5'. bf16 fallback GEMM
// out[q, n] = bf16(sum_k a[row(q), k] * w[e(q), n, k]), fp32, one warp per output (lanes stride K,
// then a fixed shuffle tree: deterministic). Positions past the routed count do nothing.
__global__ void __launch_bounds__(256) moe_bf16_gemm_kernel(const uint16_t* __restrict__ a, int64_t a_stride,
                                                             const int32_t* a_index, const uint16_t* __restrict__ w,
                                                             const int32_t* sorted_expert, const int32_t* total,
                                                             int n, int k, uint16_t* __restrict__ out,
                                                             int64_t out_stride) {
  const int64_t q = blockIdx.x;
  const int col = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (q >= *total || col >= n) return;
  const uint16_t* ar = a + (a_index ? a_index[q] : q) * a_stride;
  const uint16_t* wr = w + (static_cast<int64_t>(sorted_expert[q]) * n + col) * k;
  float s = 0.f;
  for (int kk = lane; kk < k; kk += 32) s = fmaf(bf16_bits_to_float(ar[kk]), bf16_bits_to_float(wr[kk]), s);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) out[q * out_stride + col] = float_to_bf16_bits(s);
}

// ---------------------------------------------------------------- 4. swiglu + act_quant
// One warp per (position, 128 columns of I). h = swiglu_bf16(gate, up) from the bf16 gate/up;
// then the 1x128 quantiser, its scale at sh[q * st_q + kb * st_kb] ([P, nkb] for the legacy GEMM, [nkb, p_pad] for the TMA one),
// or (bf16 weights) h stored as is.
__global__ void __launch_bounds__(256) moe_swiglu_kernel(const uint16_t* __restrict__ gu, int64_t num_pos,
                                                          const int32_t* total, int inter, int nkb,
                                                          uint8_t* __restrict__ qh, float* __restrict__ sh,
                                                          int64_t st_q, int64_t st_kb,
                                                          uint16_t* __restrict__ h_bf16, int pow2, int vec) {
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= num_pos * nkb) return;
  const int64_t q = gw / nkb;
  const int kb = static_cast<int>(gw % nkb);
  if (q >= *total) return;
  const int i0 = kb * kBlock + 4 * lane;
  float g4[4], u4[4], v[4];
  load_bf16x4(gu + q * 2 * inter + i0, inter - i0, vec != 0, g4);
  load_bf16x4(gu + q * 2 * inter + inter + i0, inter - i0, vec != 0, u4);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    v[e] = i0 + e < inter ? swiglu_bf16(g4[e], u4[e]) : 0.f;
    if (h_bf16 && i0 + e < inter) h_bf16[q * inter + i0 + e] = float_to_bf16_bits(v[e]);
  }
  if (!h_bf16) quant_group_store(v, pow2 != 0, qh + q * nkb * kBlock + kb * kBlock, sh + q * st_q + kb * st_kb, lane);
}

// ---------------------------------------------------------------- 6. combine
constexpr int kCombineLoads = 8;
__global__ void __launch_bounds__(256) moe_combine_kernel(const uint16_t* __restrict__ y, const int32_t* pair_pos,
                                                           const float* __restrict__ topk_weights, int top_k, int d,
                                                           float* __restrict__ out, int vec) {
  __shared__ int32_t pos[kMaxTopK];
  __shared__ float wt[kMaxTopK];
  __shared__ int num_local;
  const int64_t t = blockIdx.x;
  if (threadIdx.x < top_k) {
    pos[threadIdx.x] = pair_pos[t * top_k + threadIdx.x];
    wt[threadIdx.x] = topk_weights[t * top_k + threadIdx.x];
  }
  __syncthreads();
  // The token's local pairs by ascending position = ascending expert, then pair order (the
  // sorted list is stable): the reference's summation order. Insertion sort of <= 32 entries.
  if (threadIdx.x == 0) {
    int n = 0;
    for (int j = 0; j < top_k; ++j) {
      if (pos[j] < 0) continue;
      const int pj = pos[j];
      const float wj = wt[j];
      int i = n++;
      for (; i > 0 && pos[i - 1] > pj; --i) {
        pos[i] = pos[i - 1];
        wt[i] = wt[i - 1];
      }
      pos[i] = pj;
      wt[i] = wj;
    }
    num_local = n;
  }
  __syncthreads();
  const int n_local = num_local;
  // product rounded, then added: the reference's y += out * w (no FMA contraction)
  if (vec) {  // 8 columns per thread: one 16-byte load per pair, two 16-byte stores
    for (int c = 8 * threadIdx.x; c < d; c += 8 * blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j0 = 0; j0 < n_local; j0 += kCombineLoads) {  // the loads of kCombineLoads pairs in flight together
        uint4 u[kCombineLoads];
#pragma unroll
        for (int i = 0; i < kCombineLoads; ++i)
          if (j0 + i < n_local) u[i] = *reinterpret_cast<const uint4*>(y + static_cast<int64_t>(pos[j0 + i]) * d + c);
#pragma unroll
        for (int i = 0; i < kCombineLoads; ++i) {
          if (j0 + i >= n_local) break;
          const float w = wt[j0 + i];
          const uint32_t w4[4] = {u[i].x, u[i].y, u[i].z, u[i].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            acc[2 * e] = __fadd_rn(acc[2 * e], __fmul_rn(w, __uint_as_float(w4[e] << 16)));
            acc[2 * e + 1] = __fadd_rn(acc[2 * e + 1], __fmul_rn(w, __uint_as_float(w4[e] & 0xFFFF0000u)));
          }
        }
      }
      float4* o = reinterpret_cast<float4*>(out + t * d + c);
      o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    return;
  }
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < n_local; ++j)
      acc = __fadd_rn(acc, __fmul_rn(wt[j], bf16_bits_to_float(y[static_cast<int64_t>(pos[j]) * d + c])));
    out[t * d + c] = acc;
  }
}

// ---------------------------------------------------------------- plan and workspace
enum class GemmPath { kAuto, kTma, kTmaPipe, kTmaFused, kTmaFusedNoMc, kLegacy };

struct MoePlan {
  int64_t pairs, p_pad;  // P, and P rounded up to 4 (the transposed scales' 16-byte rows)
  int nkb_d, nkb_i, bn, max_tiles, prep_chunks;
  bool tma;              // the expert GEMMs on fp8_gemm_ws.cuh (bn = 128)
  bool pipe;             // ... with its pipelined mainloop (kPipe; DSA_MOE_GEMM_PATH=tma: without)
  bool fused;            // ... and step 4 in the gate/up GEMM's epilogue (kSwiGLU; needs I % 128 == 0)
  int mc;                // CTAs per cluster of the fused plan's GEMMs: 2 = pairs on adjacent weight tiles
  size_t off_qx, off_sx, off_qxs, off_sxs, off_gu, off_qh, off_sh, off_y, off_sorted_token, off_sorted_expert,
      off_pair_pos, off_offsets, off_tile_expert, off_tile_start, off_chunk_cnt, total;
};

static size_t align256(size_t b) { return (b + 255) & ~static_cast<size_t>(255); }

static int pick_bn(int64_t avg_pairs) {
  if (avg_pairs <= 8) return 8;
  if (avg_pairs <= 16) return 16;
  if (avg_pairs <= 32) return 32;
  if (avg_pairs <= 64) return 64;
  return 128;
}

// The path and tile width depend on (T, top_k, E_local) and DSA_MOE_GEMM_PATH only. The workspace's
// size is the same for every path, so it is known without a device: one region of P rows holds the
// per-position buffers, each placed where it overlaps only buffers that are dead by the time it is
// written (per position: X = x in e4m3, G = bf16 gate|up, H = h, Y = bf16 y; Q = max(X, G, Y)):
//   y at 0 (written by the down GEMM, after x and gate|up are last read);
//   gate|up at 0 (the unfused paths: read by step 4 only, before the down GEMM writes y);
//   h at Q (live from step 4 or the fused epilogue until the down GEMM has read it);
//   x at 0 (tma-fused: read by the gate/up GEMM, which writes h at Q) or at G (the unfused paths,
//   beside gate|up; legacy quantises x once per token, T rows there).
// At V3.2's D = 7168, I = 2048 that is 16 KB per position instead of the 31 KB of separate buffers.
static MoePlan plan_moe(int64_t t, int top_k, int num_local, int d, int inter, int fmt,
                        GemmPath forced = GemmPath::kAuto) {
  MoePlan p{};
  t = std::max<int64_t>(t, 0);
  const int64_t e = std::max(num_local, 1);
  p.pairs = t * std::max(top_k, 0);
  p.p_pad = (p.pairs + 3) / 4 * 4;
  p.nkb_d = static_cast<int>(dsa_ceil_div(std::max(d, 1), kBlock));
  p.nkb_i = static_cast<int>(dsa_ceil_div(std::max(inter, 1), kBlock));
  p.bn = pick_bn(dsa_ceil_div(p.pairs, e));
  const bool fp8 = fmt == DSA_MOE_FP8_BLOCK;
  p.tma = fp8 && (forced == GemmPath::kAuto ? p.bn == kTileM : forced != GemmPath::kLegacy);
  p.pipe = p.tma && forced != GemmPath::kTma;
  // tma-fused, the automatic prefill path where its 128-column h groups tile I exactly; its two
  // GEMMs run in CTA pairs sharing each token tile by multicast (tma-fused-nomc: without)
  p.fused = p.pipe && forced != GemmPath::kTmaPipe && inter % kBlock == 0;
  p.mc = p.fused && forced != GemmPath::kTmaFusedNoMc ? 2 : 1;
  if (p.tma) p.bn = kTileM;
  p.max_tiles = static_cast<int>(dsa_ceil_div(p.pairs, p.bn) + e);
  const size_t P = static_cast<size_t>(p.pairs), D = std::max(d, 0), I = std::max(inter, 0);
  const size_t X = fp8 ? P * p.nkb_d * kBlock : 0, G = align256(P * 2 * I * 2), Y = P * D * 2;
  const size_t H = fp8 ? P * p.nkb_i * kBlock : P * I * 2;
  const size_t Q = align256(std::max({X, G, Y}));
  p.off_y = p.off_gu = 0;
  p.off_qh = Q;
  p.off_qxs = p.fused ? 0 : G;  // the tma paths' per-position x
  p.off_qx = G;                 // legacy's per-token x (T <= P rows)
  size_t o = align256(std::max(Q + H, G + X));
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o += align256(bytes);
    return at;
  };
  p.off_sx = take(fp8 ? static_cast<size_t>(t) * p.nkb_d * 4 : 0);
  p.off_sxs = take(fp8 ? static_cast<size_t>(p.p_pad) * p.nkb_d * 4 : 0);  // the tma paths' x scales
  p.off_sh = take(fp8 ? static_cast<size_t>(p.p_pad) * p.nkb_i * 4 : 0);
  p.off_sorted_token = take(P * 4);
  p.off_sorted_expert = take(P * 4);
  p.off_pair_pos = take(P * 4);
  p.off_offsets = take((e + 2) * 4);  // expert_offsets[E + 1], then num_tiles
  const size_t table = static_cast<size_t>(dsa_ceil_div(p.pairs, kMinBn) + e);
  p.off_tile_expert = take(table * 4);
  p.off_tile_start = take(table * 4);
  p.prep_chunks = static_cast<int>(std::max<int64_t>(1, dsa_ceil_div(p.pairs, kPrepChunk)));
  p.off_chunk_cnt = take(p.prep_chunks > 1 ? static_cast<size_t>(p.prep_chunks) * e * 4 : 0);
  p.total = o;
  return p;
}

template <int BN>
static int launch_grouped(const GemmArgs& g, int max_tiles, cudaStream_t stream) {
  auto kernel = moe_gemm_kernel<BN>;
  constexpr int smem = Tile<BN>::kSmem;
  const int st = dsa_kernel_attributes("moe_experts", reinterpret_cast<const void*>(kernel), smem);
  if (st != DSA_OK) return st;
  kernel<<<dim3(static_cast<unsigned>(dsa_ceil_div(g.n, kTileM)), max_tiles), kThreads, smem, stream>>>(g);
  DSA_CUDA_CHECK_LAUNCH();
  return DSA_OK;
}

// DSA_MOE_GEMM_PATH -> the forced path; DSA_ERR_INVALID_ARG for a value it does not know.
static int forced_path(GemmPath* out) {
  const char* e = getenv("DSA_MOE_GEMM_PATH");
  *out = GemmPath::kAuto;
  if (e == nullptr || *e == '\0' || strcmp(e, "auto") == 0) return DSA_OK;
  if (strcmp(e, "tma") == 0) *out = GemmPath::kTma;
  else if (strcmp(e, "tma-pipe") == 0) *out = GemmPath::kTmaPipe;
  else if (strcmp(e, "tma-fused") == 0) *out = GemmPath::kTmaFused;
  else if (strcmp(e, "tma-fused-nomc") == 0) *out = GemmPath::kTmaFusedNoMc;
  else if (strcmp(e, "legacy") == 0) *out = GemmPath::kLegacy;
  else
    return dsa_set_error(DSA_ERR_INVALID_ARG, "moe_experts: DSA_MOE_GEMM_PATH=%s unknown (auto, tma, tma-pipe, tma-fused, tma-fused-nomc, legacy)", e);
  return DSA_OK;
}

// The grouped TMA GEMM: out[q, n] over the positions q of the tile table (128 per tile) and the
// n < N rows of their expert's weight (w: [E_local N, K] e4m3, ws: [E_local][ceil(N/128), nkb]);
// a: [P, nkb 128] e4m3 positions, as: their scales [nkb, p_pad].
// Fused (gate/up only, N = 2I, plan.fused): h's e4m3 rows qh [P, I] and scales sh [I / 128, p_pad]
// instead of out (fp8_gemm_ws.cuh kSwiGLU).
struct FusedSwiglu {
  int inter, pow2;
  uint8_t* qh;
  float* sh;
};
static int launch_grouped_tma(const uint8_t* w, const float* ws, int e_local, int n, int k, const uint8_t* a,
                              const float* as, int64_t pairs, int64_t p_pad, uint16_t* out, const MoePlan& plan,
                              const int32_t* tile_expert, const int32_t* tile_start, const int32_t* offsets,
                              const int32_t* num_tiles, const FusedSwiglu* fused, cudaStream_t stream) {
  using namespace dsa_fp8_ws;
  const int nkb = static_cast<int>(dsa_ceil_div(k, kBlock));
  CUtensorMap mw, mx, ms;
  // the fused tile loads 64 gate and 64 up rows per stage: two 64-row boxes
  int st = encode_tensor_map_2d(&mw, w, CU_TENSOR_MAP_DATA_TYPE_UINT8, k, static_cast<uint64_t>(e_local) * n, k,
                                kBlock, fused ? kTileM / 2 : kTileM, CU_TENSOR_MAP_SWIZZLE_128B,
                                "moe_experts: expert weights");
  if (st != DSA_OK) return st;
  // pipelined and unfused: the bf16 tiles leave by TMA stores (whole 64-row halves; a tile's rows
  // that end inside its expert by 16-byte segments: g.rows = 0 never matches a tile's end)
  const bool vec_store = (reinterpret_cast<uintptr_t>(out) & 15) == 0 && n % 8 == 0;
  const bool tma_store = plan.pipe && !fused && vec_store;
  // the fused plan's GEMMs in CTA pairs: each loads 64 rows of the token tile into both
  const int mc = (fused || tma_store) ? plan.mc : 1;
  st = encode_tensor_map_2d(&mx, a, CU_TENSOR_MAP_DATA_TYPE_UINT8, static_cast<uint64_t>(nkb) * kBlock, pairs,
                            static_cast<uint64_t>(nkb) * kBlock, kBlock, kTileM / mc, CU_TENSOR_MAP_SWIZZLE_128B,
                            "moe_experts: quantised positions");
  if (st != DSA_OK) return st;
  // tiles start at any position: the scale box reaches 4 back (fp8_gemm_ws.cuh WsArgs::s_box)
  constexpr int kScaleBox = kTileM + 4;
  st = encode_tensor_map_2d(&ms, as, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, pairs, nkb, p_pad * 4, kScaleBox, 1,
                            CU_TENSOR_MAP_SWIZZLE_NONE, "moe_experts: position scales");
  if (st != DSA_OK) return st;
  WsArgs g{};
  g.w_scale = ws;
  g.out = out;
  g.out_stride = n;  // bf16 rows (one split: the grouped units read no split fields)
  g.n = n;
  g.nkb = nkb;
  g.w_tiles = static_cast<int>(dsa_ceil_div(fused ? n / 2 : n, kTileM));  // fused: h's 128-column groups
  g.vec_store = vec_store;
  g.tile_expert = tile_expert;
  g.tile_start = tile_start;
  g.expert_offsets = offsets;
  g.num_tiles = num_tiles;
  g.w_expert_rows = n;
  g.ws_expert_stride = dsa_ceil_div(n, kTileM) * nkb;
  g.s_box = kScaleBox;
  g.x_rows = static_cast<int>(pairs);
  CUtensorMap mo = mw;
  if (tma_store) {
    st = encode_tensor_map_2d(&mo, out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, n, pairs, static_cast<uint64_t>(n) * 2,
                              64, 64, CU_TENSOR_MAP_SWIZZLE_128B, "moe_experts: expert GEMM out");
    if (st != DSA_OK) return st;
  }
  if (fused) {
    g.inter = fused->inter;
    g.qh = fused->qh;
    g.qh_stride = fused->inter;
    g.sh = fused->sh;
    g.sh_stride = p_pad;
    g.pow2 = fused->pow2;
  }
  using Kernel = decltype(&fp8_gemm_ws_kernel<false, kTileM, false, 1>);
  const Kernel kernel = fused     ? (mc > 1 ? fp8_gemm_ws_kernel<false, kTileM, false, 2, true, false, true, true>
                                            : fp8_gemm_ws_kernel<false, kTileM, false, 1, true, false, true>)
                        : tma_store ? (mc > 1 ? fp8_gemm_ws_kernel<false, kTileM, false, 2, true, true, false, true>
                                              : fp8_gemm_ws_kernel<false, kTileM, false, 1, true, true>)
                        : plan.pipe ? fp8_gemm_ws_kernel<false, kTileM, false, 1, true>
                                    : fp8_gemm_ws_kernel<false, kTileM, false, 1>;
  const int smem = tma_store ? WsTile<false, kTileM, true>::kSmem : WsTile<false, kTileM>::kSmem;
  const int64_t max_units = dsa_ceil_div(g.w_tiles, mc) * static_cast<int64_t>(plan.max_tiles);  // one per cluster
  DSA_CHECK_SUPPORTED(max_units < (1ll << 31) && static_cast<int64_t>(e_local) * n < (1ll << 31),
                      "moe_experts: %lld work units / %lld weight rows exceed int32", (long long)max_units,
                      (long long)e_local * n);
  // cluster b runs units b, b + clusters, ... of the units the device-side tile count gives
  static std::atomic<int> cache[6][64];  // one per kernel above
  const int which = (fused ? 0 : tma_store ? 2 : plan.pipe ? 4 : 5) + (mc > 1 ? 1 : 0);
  return launch_persistent("moe_experts", kernel, mc, smem, max_units, false, cache[which], stream, g, mw, mx, ms, mo);
}

static int launch_grouped_bn(int bn, const GemmArgs& g, int max_tiles, cudaStream_t stream) {
  switch (bn) {
    case 8: return launch_grouped<8>(g, max_tiles, stream);
    case 16: return launch_grouped<16>(g, max_tiles, stream);
    case 32: return launch_grouped<32>(g, max_tiles, stream);
    case 64: return launch_grouped<64>(g, max_tiles, stream);
    default: return launch_grouped<128>(g, max_tiles, stream);
  }
}

// The cp.async grouped GEMM (legacy path): out[q, n] = bf16 rows of a (row a_index[q], or q) against
// the n < N rows of their expert's weight (w: [E_local][N, K] e4m3, ws: [E_local][ceil(N/128), nkb]);
// as: the scales [rows, nkb].
static int launch_grouped_cp(const uint8_t* w, const float* ws, int n, int k, const uint8_t* a, const float* as,
                             const int32_t* a_index, uint16_t* out, const MoePlan& plan, const int32_t* tile_expert,
                             const int32_t* tile_start, const int32_t* offsets, const int32_t* num_tiles,
                             cudaStream_t stream) {
  const int nkb = static_cast<int>(dsa_ceil_div(k, kBlock));
  GemmArgs g{};
  g.w = w;
  g.w_scale = ws;
  g.n = n;
  g.k = k;
  g.nkb = nkb;
  g.w_expert_stride = static_cast<int64_t>(n) * k;
  g.ws_expert_stride = dsa_ceil_div(n, kBlock) * nkb;
  g.a = a;
  g.a_scale = as;
  g.a_stride = static_cast<int64_t>(nkb) * kBlock;
  g.a_index = a_index;
  g.out = out;
  g.out_stride = n;
  g.vec_store = n % 8 == 0;
  g.tile_expert = tile_expert;
  g.tile_start = tile_start;
  g.expert_offsets = offsets;
  g.num_tiles = num_tiles;
  return launch_grouped_bn(plan.bn, g, plan.max_tiles, stream);
}

}  // namespace dsa_moe

using namespace dsa_moe;

extern "C" size_t dsa_moe_experts_workspace_size(int64_t num_tokens, int top_k, int num_local_experts, int hidden,
                                                 int inter, int weight_format) {
  return plan_moe(num_tokens, top_k, num_local_experts, hidden, inter, weight_format).total;
}

extern "C" const char* dsa_moe_experts_path(int64_t num_tokens, int top_k, int num_local_experts, int inter) {
  static thread_local char text[48];
  GemmPath forced = GemmPath::kAuto;
  if (forced_path(&forced) != DSA_OK) return "invalid DSA_MOE_GEMM_PATH";
  const MoePlan p = plan_moe(num_tokens, top_k, num_local_experts, 1, inter, DSA_MOE_FP8_BLOCK, forced);
  if (p.tma)
    snprintf(text, sizeof(text), p.fused   ? (p.mc > 1 ? "tma-fused 128x128 x2" : "tma-fused-nomc 128x128")
                                 : p.pipe ? "tma-pipe 128x128"
                                          : "tma 128x128");
  else
    snprintf(text, sizeof(text), "legacy 128x%d", p.bn);
  return text;
}

extern "C" int dsa_launch_moe_experts(const DsaMoeExpertsParams* p, cudaStream_t stream) {
  DSA_CHECK_ARG(p != nullptr, "moe_experts: params is NULL");
  DSA_CHECK_ARG(p->num_tokens >= 0, "moe_experts: num_tokens=%lld must be >= 0", (long long)p->num_tokens);
  DSA_CHECK_ARG(p->top_k >= 1 && p->top_k <= kMaxTopK, "moe_experts: top_k=%d must be in [1, %d]", p->top_k,
                kMaxTopK);
  DSA_CHECK_ARG(p->num_experts >= 1, "moe_experts: num_experts=%d must be positive", p->num_experts);
  DSA_CHECK_ARG(p->num_local_experts >= 1 && p->expert_offset >= 0 &&
                    p->expert_offset + p->num_local_experts <= p->num_experts,
                "moe_experts: local experts [expert_offset=%d, +num_local_experts=%d) must lie in [0, num_experts=%d)",
                p->expert_offset, p->num_local_experts, p->num_experts);
  DSA_CHECK_SUPPORTED(p->num_local_experts <= kMaxLocalExperts, "moe_experts: num_local_experts=%d unsupported (<= %d)",
                      p->num_local_experts, kMaxLocalExperts);
  DSA_CHECK_ARG(p->hidden > 0 && p->inter > 0, "moe_experts: hidden=%d and inter=%d must be positive", p->hidden,
                p->inter);
  DSA_CHECK_ARG(p->weight_format == DSA_MOE_FP8_BLOCK || p->weight_format == DSA_MOE_BF16,
                "moe_experts: weight_format=%d unsupported (0 = DSA_MOE_FP8_BLOCK, 1 = DSA_MOE_BF16)",
                p->weight_format);
  DSA_CHECK_ARG(p->pow2_act_scales == 0 || p->pow2_act_scales == 1, "moe_experts: pow2_act_scales=%d must be 0 or 1",
                p->pow2_act_scales);
  const bool fp8 = p->weight_format == DSA_MOE_FP8_BLOCK;
  DSA_CHECK_SUPPORTED(!fp8 || (p->hidden % 16 == 0 && p->inter % 16 == 0),
                      "moe_experts: hidden=%d / inter=%d unsupported for fp8 weights: weight rows are copied in "
                      "16-byte chunks, so both must be multiples of 16",
                      p->hidden, p->inter);
  const int64_t pairs = p->num_tokens * p->top_k;
  DSA_CHECK_SUPPORTED(pairs < (1ll << 31), "moe_experts: num_tokens * top_k = %lld pairs exceed int32",
                      (long long)pairs);
  if (p->num_tokens == 0) return DSA_OK;
  DSA_CHECK_ARG(p->x && p->topk_ids && p->topk_weights && p->w13 && p->w2 && p->out && p->workspace,
                "moe_experts: NULL pointer (x=%p topk_ids=%p topk_weights=%p w13=%p w2=%p out=%p workspace=%p)",
                p->x, p->topk_ids, p->topk_weights, p->w13, p->w2, p->out, p->workspace);
  DSA_CHECK_ARG(!fp8 || (p->w13_scale && p->w2_scale),
                "moe_experts: fp8 weights need w13_scale=%p and w2_scale=%p (non-NULL)", p->w13_scale, p->w2_scale);
  DSA_CHECK_ARG((reinterpret_cast<uintptr_t>(p->workspace) & 15) == 0 &&
                    (reinterpret_cast<uintptr_t>(p->w13) & 15) == 0 && (reinterpret_cast<uintptr_t>(p->w2) & 15) == 0,
                "moe_experts: workspace=%p, w13=%p and w2=%p must be 16-byte aligned", p->workspace,
                p->w13, p->w2);

  GemmPath forced = GemmPath::kAuto;
  const int fst = forced_path(&forced);
  if (fst != DSA_OK) return fst;
  const MoePlan plan =
      plan_moe(p->num_tokens, p->top_k, p->num_local_experts, p->hidden, p->inter, p->weight_format, forced);
  DSA_CHECK_SUPPORTED(plan.max_tiles <= 65535, "moe_experts: %d token tiles exceed the grid (num_tokens=%lld)",
                      plan.max_tiles, (long long)p->num_tokens);
  uint8_t* ws = static_cast<uint8_t*>(p->workspace);
  auto at = [&](size_t off) { return ws + off; };
  int32_t* sorted_token = reinterpret_cast<int32_t*>(at(plan.off_sorted_token));
  int32_t* sorted_expert = reinterpret_cast<int32_t*>(at(plan.off_sorted_expert));
  int32_t* pair_pos = reinterpret_cast<int32_t*>(at(plan.off_pair_pos));
  int32_t* offsets = reinterpret_cast<int32_t*>(at(plan.off_offsets));
  int32_t* num_tiles = offsets + p->num_local_experts + 1;
  int32_t* total = offsets + p->num_local_experts;
  int32_t* tile_expert = reinterpret_cast<int32_t*>(at(plan.off_tile_expert));
  int32_t* tile_start = reinterpret_cast<int32_t*>(at(plan.off_tile_start));
  uint16_t* gu = reinterpret_cast<uint16_t*>(at(plan.off_gu));
  uint16_t* y = reinterpret_cast<uint16_t*>(at(plan.off_y));
  const int E = p->num_local_experts, D = p->hidden, I = p->inter;

  // 1. routing
  const size_t prep_smem = static_cast<size_t>(kPrepWarps) * E * sizeof(int32_t);
  int st = dsa_kernel_attributes("moe_experts", reinterpret_cast<const void*>(moe_prep_kernel), prep_smem);
  if (st != DSA_OK) return st;
  int32_t* chunk_cnt = nullptr;
  if (plan.prep_chunks > 1) {
    chunk_cnt = reinterpret_cast<int32_t*>(at(plan.off_chunk_cnt));
    moe_prep_count_kernel<<<plan.prep_chunks, kPrepThreads, E * sizeof(int32_t), stream>>>(
        p->topk_ids, static_cast<int>(pairs), p->num_experts, E, p->expert_offset, chunk_cnt);
    DSA_CUDA_CHECK_LAUNCH();
    moe_prep_scan_kernel<<<1, kPrepThreads, 0, stream>>>(plan.prep_chunks, E, plan.bn, chunk_cnt, offsets, num_tiles,
                                                         tile_expert, tile_start);
    DSA_CUDA_CHECK_LAUNCH();
  }
  moe_prep_kernel<<<plan.prep_chunks, kPrepThreads, prep_smem, stream>>>(
      p->topk_ids, static_cast<int>(pairs), p->top_k, p->num_experts, E, p->expert_offset, plan.bn, chunk_cnt,
      sorted_token, sorted_expert, pair_pos, offsets, num_tiles, tile_expert, tile_start);
  DSA_CUDA_CHECK_LAUNCH();

  const unsigned swiglu_blocks = static_cast<unsigned>(dsa_ceil_div(pairs * plan.nkb_i * 32, 256));
  if (fp8) {
    uint8_t* qx = at(plan.off_qx);
    float* sx = reinterpret_cast<float*>(at(plan.off_sx));
    uint8_t* qh = at(plan.off_qh);
    float* sh = reinterpret_cast<float*>(at(plan.off_sh));
    // one expert GEMM of the plan's path: out[q, n] = x rows a (through a_index) against w / ws
    auto expert_gemm = [&](const void* w, const float* ws, int n, int k, const uint8_t* a, const float* as,
                           const int32_t* a_index, uint16_t* out) {
      return plan.tma ? launch_grouped_tma(static_cast<const uint8_t*>(w), ws, E, n, k, a, as, pairs, plan.p_pad, out,
                                           plan, tile_expert, tile_start, offsets, num_tiles, nullptr, stream)
                      : launch_grouped_cp(static_cast<const uint8_t*>(w), ws, n, k, a, as, a_index, out, plan,
                                          tile_expert, tile_start, offsets, num_tiles, stream);
    };
    // 2. x -> e4m3: once per token (legacy: its rows gathered through the sorted list), or (tma:
    // TMA cannot gather rows) written to each of the token's positions, in the sorted order
    const unsigned quant_blocks = static_cast<unsigned>(dsa_ceil_div(p->num_tokens * plan.nkb_d * 32, 256));
    const bool x_vec = (reinterpret_cast<uintptr_t>(p->x) & 7) == 0;
    uint8_t* a1 = plan.tma ? at(plan.off_qxs) : qx;
    float* s1 = plan.tma ? reinterpret_cast<float*>(at(plan.off_sxs)) : sx;
    const int32_t* a1_index = plan.tma ? nullptr : sorted_token;
    moe_act_quant_kernel<<<quant_blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(p->x), p->num_tokens, D,
                                                           plan.nkb_d, plan.tma ? pair_pos : nullptr, p->top_k, a1,
                                                           s1, plan.p_pad, p->pow2_act_scales, x_vec);
    DSA_CUDA_CHECK_LAUNCH();
    if (plan.fused) {  // 3 + 4 in one kernel
      const FusedSwiglu f{I, p->pow2_act_scales, qh, sh};
      if ((st = launch_grouped_tma(static_cast<const uint8_t*>(p->w13), p->w13_scale, E, 2 * I, D, a1, s1, pairs,
                                   plan.p_pad, nullptr, plan, tile_expert, tile_start, offsets, num_tiles, &f,
                                   stream)) != DSA_OK)
        return st;
    } else {
      // 3. gate | up
      if ((st = expert_gemm(p->w13, p->w13_scale, 2 * I, D, a1, s1, a1_index, gu)) != DSA_OK) return st;
      // 4. h = e4m3(bf16(silu(gate) * up)); scales [P, nkb] (legacy) or transposed [nkb, p_pad] (tma)
      moe_swiglu_kernel<<<swiglu_blocks, 256, 0, stream>>>(gu, pairs, total, I, plan.nkb_i, qh, sh,
                                                           plan.tma ? 1 : plan.nkb_i, plan.tma ? plan.p_pad : 1,
                                                           nullptr, p->pow2_act_scales, 1);  // I % 16 == 0
      DSA_CUDA_CHECK_LAUNCH();
    }
    // 5. down
    if ((st = expert_gemm(p->w2, p->w2_scale, D, I, qh, sh, nullptr, y)) != DSA_OK) return st;
  } else {
    uint16_t* h = reinterpret_cast<uint16_t*>(at(plan.off_qh));
    DSA_CHECK_SUPPORTED(dsa_ceil_div(std::max(2 * I, D), 8) <= 65535,
                        "moe_experts: bf16 path: 2*inter=%d / hidden=%d too large (<= 524280)", 2 * I, D);
    moe_bf16_gemm_kernel<<<dim3(static_cast<unsigned>(pairs), static_cast<unsigned>(dsa_ceil_div(2 * I, 8))), 256, 0,
                           stream>>>(static_cast<const uint16_t*>(p->x), D, sorted_token,
                                     static_cast<const uint16_t*>(p->w13), sorted_expert, total, 2 * I, D, gu, 2 * I);
    DSA_CUDA_CHECK_LAUNCH();
    moe_swiglu_kernel<<<swiglu_blocks, 256, 0, stream>>>(gu, pairs, total, I, plan.nkb_i, nullptr, nullptr, 0, 0, h,
                                                         0, I % 4 == 0);
    DSA_CUDA_CHECK_LAUNCH();
    moe_bf16_gemm_kernel<<<dim3(static_cast<unsigned>(pairs), static_cast<unsigned>(dsa_ceil_div(D, 8))), 256, 0,
                           stream>>>(h, I, nullptr, static_cast<const uint16_t*>(p->w2), sorted_expert, total, D, I, y,
                                     D);
    DSA_CUDA_CHECK_LAUNCH();
  }
  // 6. combine
  moe_combine_kernel<<<static_cast<unsigned>(p->num_tokens), 256, 0, stream>>>(y, pair_pos, p->topk_weights, p->top_k,
                                                                              D, p->out,
      D % 8 == 0 && (reinterpret_cast<uintptr_t>(p->out) & 15) == 0);
  DSA_CUDA_CHECK_LAUNCH();
  return DSA_OK;
}
