// DSA-TRT sparse MLA over the 576-byte fp8 pool: the warp-specialised fp8 wgmma kernel (sm_90a).
//
// One work item = one query token x one block of 64 heads (wgmma M = 64; H = 16 / 32 pad the
// block with zero rows that are never stored) x one chunk of the token's tiles (kSplit: split-KV
// for small T, the partial out (fp16) + lse go to the workspace and sparse_mla_fp8_split.cu
// combines them; otherwise the one chunk is the whole list). A persistent CTA per SM runs every
// gridDim.x-th item, its pipeline running on from one item into the next. All heads share each
// gathered latent row (MQA), so an item streams its chunk of the k selected rows in tiles of 64
// and runs, per tile:
//
//   S[64 h, 64 keys] = q8 . k8^T over 576 dims   fp8 x fp8 wgmma, fp32 accumulate
//   online softmax (log2 domain, per-head scale folded in)
//   O[64 h, 512]    += p8 . v8                    fp8 x fp8 wgmma, fp32 accumulate
//
// Because the pool holds all 576 dims as e4m3 with ONE per-layer scale, the gathered rows are
// used by the tensor cores as they are: no dequantisation at all. q is quantised per (token,
// head) to e4m3 with scale amax/448; kv_scale * q_scale * sm_scale go into the fp32 scores, and
// kv_scale / l into the output. P = 2^(z - m + 8) is stored as e4m3 (max 256 < 448), which keeps
// probabilities down to ~2^-14 of the row max in the normal range; the 2^8 cancels in O / l. The
// running max m is the exact max (the row's dominant P is exactly 2^8, no e4m3 rounding), so a
// split-KV chunk, with its own max, rounds its P differently from the unsplit run: split and
// unsplit agree to fp8 noise, not bitwise (docs/kernels.md, "Sparse MLA").
//
// Warp roles (384 threads, one CTA per SM, ~217 KB shared memory):
//   WG0 producer  warps 0-1 load each tile's 64 slots and gather its rows with 16-byte cp.async
//                 (zero-fill for -1 slots) into the 128B-swizzled K tile; warps 2-3 transpose its
//                 first 512 columns into V^T with ldmatrix.trans + prmt + stmatrix (fp8 wgmma
//                 wants K-major B, i.e. keys contiguous per output dim). 40 registers.
//   WG1, WG2      consumers. O[64 x 512] fp32 needs 256 registers per thread for one warpgroup,
//                 so consumer c owns output dims [256c, 256c + 256) (128 accumulator registers)
//                 and computes the partial S over q/k dims [288c, 288c + 288); the two partial S
//                 are summed through shared memory, so both hold the identical S and statistics;
//                 consumer c exponentiates keys [32c, 32c + 32) and the two swap their halves of
//                 P (e4m3) through shared memory. 232 regs.
//
// Key permutation: the P registers come straight from the S accumulator layout, which holds for
// lane quad q the keys {2q, 2q+1, 8+2q, 9+2q} of each 16-key group where wgmma's A operand
// expects K positions 4q..4q+3; the transpose writes V^T with the same key order, so the
// product is unchanged and no shuffles are needed. It also writes the 512 output dims in a
// permuted row order (even dims, then odd dims, per 16) that the epilogue undoes. Details and
// the accuracy: docs/kernels.md, "Sparse MLA".
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>

#include <algorithm>

#include "common.cuh"
#include "dsa_kernels.h"
#include "sparse_mla.cuh"
#include "sparse_mla_ptx.cuh"
#include "wgmma.cuh"

namespace dsa_sparse_mla {

constexpr int kTileKeys = 64;
constexpr int kDim = DSA_MLA_DIM;      // 576
constexpr int kVDim = DSA_MLA_V_DIM;   // 512
constexpr int kHeadsPerCta = 64;       // wgmma M
constexpr int kKStages = 3;  // gathered K tiles in flight (the gather latency is the exposed one)
constexpr int kVStages = 2;
constexpr int kWarpgroup = 128;
constexpr int kThreads = 3 * kWarpgroup;
constexpr int kCoreBytes = 128;                              // one core matrix: 8 rows x 16 bytes
constexpr int kKChunks = kDim / 16;                          // 36 16-byte chunks per latent row
constexpr int kSwizzleRow = 128;                             // 128B-swizzle: 8 chunks per row, XOR (key & 7)
constexpr int kKBlocks = (kDim + kSwizzleRow - 1) / kSwizzleRow;  // 5 column blocks (the last half used)
constexpr int kKBlockBytes = kTileKeys * kSwizzleRow;        // 8192
constexpr int kKTileBytes = kKBlocks * kKBlockBytes;         // 40960
constexpr int kSmemAlign = 1024;                             // 128B-swizzle atoms (8 rows x 128 B)
constexpr int kVtGroupBytes = kTileKeys / 16 * kCoreBytes;   // 512: 8 V^T rows x 64 keys
constexpr int kVtTileBytes = kVDim / 8 * kVtGroupBytes;      // 32768
constexpr int kQkSteps = kDim / 32;                          // 18 wgmma k-steps of 32
constexpr int kQkStepsPerWg = kQkSteps / 2;                  // 9 per consumer
constexpr int kVHalf = kVDim / 2;                            // 256 output dims per consumer
constexpr int kXchgVecs = 8;                                 // 32 S accumulators = 8 float4
constexpr uint32_t kProducerRegs = 40, kConsumerRegs = 232;  // 128*40 + 256*232 <= 65536
constexpr float kFp8Max = 448.f;
constexpr float kQAmaxFloor = 1e-20f;  // all-zero q rows: scale stays finite and > 0, q8 = 0
constexpr float kPOffset = 8.f;        // log2 of the P pre-scale
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr uint32_t kBarConsumers = 1;  // named barrier of the two consumer warpgroups (0 = __syncthreads)
constexpr int kGatherWarps = 2, kTransposeWarps = 2;  // the producer warpgroup's two crews

struct Fp8Smem {
  uint8_t k_tile[kKStages][kKTileBytes];    // [5 blocks][64 keys][128 B, chunk c at c ^ (key & 7)]: B of QK^T
  uint8_t vt_tile[kVStages][kVtTileBytes];  // [64 row groups][4 key chunks][8 rows][16 B]: K-major B of PV
  float4 xchg[2][kXchgVecs][kWarpgroup];    // [consumer] partial S of the current tile
  uint32_t valid_k[kKStages][kGatherWarps];  // K stage's tile: bit i of word w = key 32w + i has a valid slot
  uint64_t full_k[kKStages], empty_k[kKStages], full_v[kVStages], empty_v[kVStages];
};

__device__ __forceinline__ void warp_arrive(uint64_t* bar) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// Which token / head block / chunk of tiles work item `item` is. A CTA runs the items blockIdx.x,
// blockIdx.x + gridDim.x, ... (persistent: at most one CTA per SM, so the gather of an item's
// first tiles overlaps the previous item's last tiles, epilogue and q prologue). Computed inside
// each role (values live across setmaxnreg would be spilled).
struct CtaWork {
  int64_t t;
  int hb;
  int split;    // chunk index (0 unsplit)
  int tile0;    // first tile of the chunk: keys [64 * tile0, 64 * (tile0 + n_tiles)) of the token
  int n_tiles;  // >= 1
};
template <bool kSplit>
__device__ __forceinline__ int num_items(const DsaSparseMlaParams& p, const SplitPlan& plan, int head_blocks) {
  return static_cast<int>(p.num_tokens) * head_blocks * (kSplit ? plan.n_splits : 1);
}
template <int kHeadBlocks, bool kSplit>
__device__ __forceinline__ CtaWork cta_work(const DsaSparseMlaParams& p, const SplitPlan& plan, int it) {
  // it = (t * n_splits + split) * kHeadBlocks + hb: consecutive CTAs run the two head blocks of a
  // token and chunk at the same time, so the second head block's gathers are L2 hits
  const int tiles = (p.topk + kTileKeys - 1) / kTileKeys;
  const int hb = it % kHeadBlocks;
  const int item = it / kHeadBlocks;
  if constexpr (!kSplit) {
    return {static_cast<int64_t>(item), hb, 0, 0, tiles};
  } else {
    const int split = item % plan.n_splits;
    const int tile0 = split * plan.tiles_per_split;
    return {static_cast<int64_t>(item / plan.n_splits), hb, split, tile0, min(plan.tiles_per_split, tiles - tile0)};
  }
}

// ---------------------------------------------------------------- producer (warpgroup 0)
// Two independent crews so that neither waits on the other's latency: the gather warps only issue
// cp.async (a proxy fence in a thread with copies in flight waits for them), the transpose warps
// only read the landed K tile and write V^T.

// Gather warps: tile j into K stage j % 3 once the consumers' QK^T and the transposer of tile j-3
// released it (j counts the CTA's tiles over all its items). Lane l of warp w loads slot 32w + l
// of the tile (before waiting for the stage, so the load overlaps the wait), checks it (-1,
// padding past the chunk and slots >= num_slots are skipped) and the warp publishes its 32
// validity bits in the stage's mask for the consumers. Each 8-lane quarter of a warp instruction
// copies one 128-byte column block of one key: 128 contiguous global bytes (4 full sectors; the
// L2 sees no partial-sector requests) into one 128-byte swizzled shared-memory row (all 32 banks).
// Warp w copies keys 32w..32w+31.
template <int kHeadBlocks, bool kSplit>
__device__ __forceinline__ void gather_crew(Fp8Smem& sm, const DsaSparseMlaParams& p, const SplitPlan& plan, int warp,
                                            int lane) {
  const uint8_t* pool = static_cast<const uint8_t*>(p.pool);
  const int cw = lane & 7;  // 16-byte chunk within the 128-byte block
  const int n_items = num_items<kSplit>(p, plan, kHeadBlocks);
  int j = 0;
  for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
    const CtaWork w = cta_work<kHeadBlocks, kSplit>(p, plan, it);
    const int32_t* slots_row = p.slots + w.t * p.topk;
    const int key_end = min(p.topk, (w.tile0 + w.n_tiles) * kTileKeys);  // the chunk: keys [64 tile0, key_end)
    for (int jj = 0; jj < w.n_tiles; ++jj, ++j) {
      const int key = (w.tile0 + jj) * kTileKeys + warp * 32 + lane;
      int32_t slot = key < key_end ? __ldg(slots_row + key) : -1;
      const int st = j % kKStages, round = j / kKStages;
      if (round > 0) mbar_wait(&sm.empty_k[st], (round - 1) & 1);
      const bool ok = slot >= 0 && static_cast<int64_t>(slot) < p.num_slots;
      slot = ok ? slot : -1;
      const uint32_t bits = __ballot_sync(0xffffffffu, ok);
      if (lane == 0) sm.valid_k[st][warp] = bits;
      const uint32_t tile = smem_u32(sm.k_tile[st]);
#pragma unroll 2
      for (int kq = 0; kq < 8; ++kq) {
        const int kw = kq * 4 + (lane >> 3);  // key of the warp's 32
        const int32_t sl = __shfl_sync(0xffffffffu, slot, kw);
        const int key_t = warp * 32 + kw;     // key of the tile
        const uint8_t* src = pool + static_cast<int64_t>(sl < 0 ? 0 : sl) * kDim + cw * 16;
        const uint32_t bytes = sl >= 0 ? 16u : 0u;  // -1: zero-fill, nothing read
        const uint32_t dst = tile + key_t * kSwizzleRow + ((cw ^ (key_t & 7)) << 4);
#pragma unroll
        for (int b = 0; b < kKBlocks; ++b) {
          if (b * kSwizzleRow + cw * 16 < kDim)  // the last block holds 4 chunks
            cp_async_16(dst + b * kKBlockBytes, src + b * kSwizzleRow, bytes);
        }
      }
      mbar_arrive_cp_async(&sm.full_k[st]);
      if (lane == 0) mbar_arrive(&sm.full_k[st]);  // release: the mask is visible once the stage is full
    }
  }
}

// Transpose warps: V^T[dim][key] of the CTA's tile j (of n_tiles over all its items) from its K
// tile. Per 16 keys x 32 dims: one
// ldmatrix.x4.trans (b16 = 2 dims), byte permutes that split even / odd dims, one stmatrix.x4
// (4 V^T core matrices). Warp w does keys 32w..32w+31.
__device__ __forceinline__ void transpose_crew(Fp8Smem& sm, int n_tiles, int warp, int lane) {
  const int m = lane >> 3, rr = lane & 7;  // ldmatrix / stmatrix: lane gives row rr of matrix m
  for (int j = 0; j < n_tiles; ++j) {
    const int kst = j % kKStages, vst = j % kVStages;
    mbar_wait(&sm.full_k[kst], (j / kKStages) & 1);
    if (j >= kVStages) mbar_wait(&sm.empty_v[vst], (j / kVStages - 1) & 1);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = warp * 2 + hh;  // 16-key group
      // matrix m: keys 16h + 8*(m & 1) + rr, chunk 2c + (m >> 1) of the row (block c / 4, swizzled)
      const uint32_t src = smem_u32(sm.k_tile[kst]) + (16 * h + 8 * (m & 1) + rr) * kSwizzleRow;
      // V^T row group 4c + m (dims 32c + 2r, 32c + 2r + 1, 32c + 16 + 2r, 32c + 17 + 2r), key chunk h
      const uint32_t dst = smem_u32(sm.vt_tile[vst]) + m * kVtGroupBytes + h * kCoreBytes + rr * 16;
#pragma unroll 4
      for (int c = 0; c < kVDim / 32; ++c) {
        uint32_t a0, b0, a1, b1;
        const int chunk = 2 * c + (m >> 1);
        ldmatrix_x4_trans(src + (chunk >> 3) * kKBlockBytes + (((chunk & 7) ^ rr) << 4), a0, b0, a1, b1);
        stmatrix_x4(dst + c * 4 * kVtGroupBytes, prmt(a0, b0, 0x6420), prmt(a0, b0, 0x7531), prmt(a1, b1, 0x6420),
                    prmt(a1, b1, 0x7531));
      }
    }
    fence_proxy_async();  // stmatrix (generic proxy) -> wgmma (async proxy)
    mbar_arrive(&sm.full_v[vst]);
    warp_arrive(&sm.empty_k[kst]);  // this warp is done reading the K tile
  }
}

// ---------------------------------------------------------------- consumers (warpgroups 1, 2)
// One work item `it` whose tiles are the CTA's tiles [j0, j0 + n_tiles) (K stage and phase of
// tile j: (j0 + j) % 3 and ((j0 + j) / 3) & 1, V^T likewise with 2).
template <int kRows, int kHeadBlocks, bool kSplit>
__device__ __forceinline__ void consumer(Fp8Smem& sm, const DsaSparseMlaParams& p, const SplitPlan& plan, int it,
                                         int j0, int c) {
  const CtaWork work = cta_work<kHeadBlocks, kSplit>(p, plan, it);
  const int64_t t = work.t;
  const int hb = work.hb, n_tiles = work.n_tiles;
  const int ctid = threadIdx.x - kWarpgroup * (1 + c);
  const int warp = ctid >> 5, lane = ctid & 31;
  const int g = lane >> 2, qd = lane & 3;
  const int row0 = warp * 16 + g;  // this thread's rows: row0 and row0 + 8 of the head block
  const bool row_ok[2] = {kRows == kHeadsPerCta || row0 < kRows, kRows == kHeadsPerCta || row0 + 8 < kRows};
  const int64_t head[2] = {static_cast<int64_t>(hb) * kHeadsPerCta + row0,
                           static_cast<int64_t>(hb) * kHeadsPerCta + row0 + 8};

  // ---- q -> e4m3 per head, scale amax / 448 with the amax over all 576 dims. Each consumer loads
  // only its half of the dims, all loads in flight at once (one memory latency); the halves' amax
  // meet in shared memory.
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q) + t * p.q_stride_token;
  uint2 raw[kQkStepsPerWg][2][2];  // [step][row][dims 4qd.. / 16 + 4qd..] as 4 bf16
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // one base per row, the 18 loads at immediate offsets (the straight-line prologue is fetched
    // from L2 at every CTA start: its length is latency)
    const uint2* qrow = reinterpret_cast<const uint2*>(q + head[r] * p.q_stride_head + 4 * qd + 32 * kQkStepsPerWg * c);
#pragma unroll
    for (int sl = 0; sl < kQkStepsPerWg; ++sl) {
      raw[sl][r][0] = row_ok[r] ? __ldg(qrow + 8 * sl) : make_uint2(0u, 0u);
      raw[sl][r][1] = row_ok[r] ? __ldg(qrow + 8 * sl + 4) : make_uint2(0u, 0u);
    }
  }
  float amax[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    __nv_bfloat162 m2 = __float2bfloat162_rn(0.f);  // max |q| is exact in bf16
#pragma unroll
    for (int sl = 0; sl < kQkStepsPerWg; ++sl) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m2 = __hmax2(m2, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&raw[sl][r][h].x)));
        m2 = __hmax2(m2, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&raw[sl][r][h].y)));
      }
    }
    amax[r] = fmaxf(__low2float(m2), __high2float(m2));
  }
  {  // this half's amax: over the quad, then with the partner consumer (same ctid = same rows)
    float2* qmax = reinterpret_cast<float2*>(&sm.xchg[0][0][0]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 1));
      amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 2));
    }
    qmax[c * kWarpgroup + ctid] = make_float2(amax[0], amax[1]);
    named_bar_sync(kBarConsumers, 2 * kWarpgroup);
    const float2 other = qmax[(c ^ 1) * kWarpgroup + ctid];
    named_bar_sync(kBarConsumers, 2 * kWarpgroup);  // read before the buffer carries partial S
    amax[0] = fmaxf(amax[0], other.x);  // max is commutative: both consumers get the same scale
    amax[1] = fmaxf(amax[1], other.y);
  }
  float inv[2], f[2];  // q8 = q * inv; score (log2 units) = acc * f
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float a = fmaxf(amax[r], kQAmaxFloor);
    inv[r] = kFp8Max / a;
    f[r] = (a / kFp8Max) * p.sm_scale * p.kv_scale * kLog2e;
  }
  uint32_t qa[kQkStepsPerWg][4];  // wgmma A fragments: {row0 k[4qd..], row0+8 k[4qd..], row0 k[16+4qd..], row0+8 ...}
#pragma unroll
  for (int sl = 0; sl < kQkStepsPerWg; ++sl) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[sl][r][h].x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[sl][r][h].y));
        qa[sl][2 * h + r] = pack_e4m3x4(lo.x * inv[r], lo.y * inv[r], hi.x * inv[r], hi.y * inv[r]);
      }
    }
  }

  float o[kVHalf / 2];  // O[64 x 256] accumulators: o[j*4 + rh*2 + e] = row row0 + 8rh, column 8j + 2qd + e
  float s_acc[32];      // S[64 x 64]: s_acc[j*4 + rh*2 + e] = row row0 + 8rh, key 8j + 2qd + e
#pragma unroll
  for (int i = 0; i < kVHalf / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) s_acc[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of the log2-domain scores
  float l_run[2] = {0.f, 0.f};              // this thread's partial of sum 2^(z - m + 8)
  uint32_t pa[2][4];                        // P of the tile, e4m3, wgmma A fragments per 32 keys

  // The B operands' shared addresses and this consumer's index, broadcast from lane 0 so that
  // ptxas keeps the wgmma descriptors in uniform registers (built from a generic pointer or
  // threadIdx, every wgmma's descriptor went through R2UR; tests/test_kernel_sass.py).
  const uint32_t k_tile_u = dsa_ptx::warp_uniform(smem_u32(sm.k_tile[0]));
  const uint32_t vt_tile_u = dsa_ptx::warp_uniform(smem_u32(sm.vt_tile[0]) + c * (kVHalf / 8) * kVtGroupBytes);
  const int c_u = dsa_ptx::warp_uniform(c);
  auto issue_qk = [&](int st) {
    const uint32_t base = k_tile_u + st * kKTileBytes;
#pragma unroll
    for (int sl = 0; sl < kQkStepsPerWg; ++sl) {
      const int s = c_u * kQkStepsPerWg + sl;  // dims [32s, 32s + 32): block s / 4, byte 32 * (s % 4) of the row
      dsa_wgmma::rs<64>(s_acc, qa[sl], make_smem_desc_sw128(base + (s >> 2) * kKBlockBytes + (s & 3) * 32),
                              sl > 0 ? 1 : 0);
    }
  };
  auto issue_pv = [&](int st) {
    const uint32_t base = vt_tile_u + st * kVtTileBytes;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      dsa_wgmma::rs<256>(o, pa[kk], make_smem_desc(base + kk * 2 * kCoreBytes, kCoreBytes, kVtGroupBytes), 1);
  };
  auto stage_valid = [&](int st) {  // the 64 slot-validity bits of K stage st's tile (read before releasing it)
    const uint2 w = *reinterpret_cast<const uint2*>(&sm.valid_k[st][0]);
    return (static_cast<uint64_t>(w.y) << 32) | w.x;
  };
  // Part 1 (runs while PV of the previous tile is still on the tensor cores): sum the two partial
  // S, mask (vm: the tile's slot-validity bits), online-softmax statistics. Each consumer then
  // exponentiates only its half of the keys (consumer c: keys [32c, 32c + 32), the A fragment
  // pa[c] of PV), packs them as e4m3 into `mine_p` and hands them to its partner through the
  // partner's exchange buffer, which it has finished reading. Returns the O rescale factors.
  auto softmax_stats = [&](uint64_t vm, float (&alpha)[2], uint4& mine_p) {
    float4* mine = &sm.xchg[c][0][0];
    float4* other = &sm.xchg[c ^ 1][0][0];
#pragma unroll
    for (int v = 0; v < kXchgVecs; ++v)
      mine[v * kWarpgroup + ctid] = make_float4(s_acc[4 * v], s_acc[4 * v + 1], s_acc[4 * v + 2], s_acc[4 * v + 3]);
    named_bar_sync(kBarConsumers, 2 * kWarpgroup);  // partner's partial written
#pragma unroll
    for (int v = 0; v < kXchgVecs; ++v) {
      const float4 x = other[v * kWarpgroup + ctid];
      s_acc[4 * v] += x.x;  // a + b == b + a: both consumers hold bitwise-equal S
      s_acc[4 * v + 1] += x.y;
      s_acc[4 * v + 2] += x.z;
      s_acc[4 * v + 3] += x.w;
    }
    if (vm != ~0ull) {  // some slot of the tile is -1 (uniform branch: one mask per tile)
#pragma unroll
      for (int i = 0; i < 32; ++i) {  // s_acc[i]: key 8 (i / 4) + 2qd + (i & 1)
        const bool ok = (vm >> (8 * (i >> 2) + 2 * qd + (i & 1))) & 1u;
        s_acc[i] = ok ? s_acc[i] : -INFINITY;
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 32; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s_acc[i]);
    float bias[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      mx[rh] = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 1));
      mx[rh] = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 2));
      // exact max, not rounded: the dominant P stays exactly 2^8 in e4m3 (docs/kernels.md)
      const float m_new = fmaxf(m_run[rh], mx[rh] * f[rh]);  // f > 0: -inf stays -inf
      alpha[rh] = m_run[rh] == -INFINITY ? 0.f : ex2(m_run[rh] - m_new);
      bias[rh] = m_new == -INFINITY ? 0.f : kPOffset - m_new;
      m_run[rh] = m_new;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 16; ++i) {  // my keys s_acc[16c + i] -> P in s_acc[i]
      const int rh = (i >> 1) & 1;
      s_acc[i] = ex2(fmaf(c ? s_acc[16 + i] : s_acc[i], f[rh], bias[rh]));  // masked: 2^-inf = 0
      rs[rh] += s_acc[i];
    }
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) l_run[rh] = l_run[rh] * alpha[rh] + rs[rh];
    mine_p = make_uint4(pack_e4m3x4(s_acc[0], s_acc[1], s_acc[4], s_acc[5]),
                        pack_e4m3x4(s_acc[2], s_acc[3], s_acc[6], s_acc[7]),
                        pack_e4m3x4(s_acc[8], s_acc[9], s_acc[12], s_acc[13]),
                        pack_e4m3x4(s_acc[10], s_acc[11], s_acc[14], s_acc[15]));
    reinterpret_cast<uint4*>(other)[ctid] = mine_p;
    named_bar_sync(kBarConsumers, 2 * kWarpgroup);  // partner's P written into my buffer
  };
  // Part 2 (after the previous PV completed): rescale O, take both halves of P as A fragments.
  auto softmax_apply = [&](const float (&alpha)[2], const uint4& mine_p) {
    if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
      for (int i = 0; i < kVHalf / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
    }
    const uint4 theirs = reinterpret_cast<const uint4*>(&sm.xchg[c][0][0])[ctid];
    const uint4 p0 = c ? theirs : mine_p, p1 = c ? mine_p : theirs;
    pa[0][0] = p0.x, pa[0][1] = p0.y, pa[0][2] = p0.z, pa[0][3] = p0.w;
    pa[1][0] = p1.x, pa[1][1] = p1.y, pa[1][2] = p1.z, pa[1][3] = p1.w;
  };

  float alpha[2];
  uint4 mine_p;
  // ---- tile 0: QK^T
  {
    const int kst = j0 % kKStages;
    mbar_wait(&sm.full_k[kst], (j0 / kKStages) & 1);
    fence_proxy_async();
    wgmma_fence();
    issue_qk(kst);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s_acc);
    const uint64_t vm = stage_valid(kst);
    warp_arrive(&sm.empty_k[kst]);
    softmax_stats(vm, alpha, mine_p);
    softmax_apply(alpha, mine_p);
  }
  // ---- steady state: QK^T(j+1) then PV(j) on the tensor cores; the softmax statistics of
  // tile j+1 overlap PV(j)
  for (int j = j0; j + 1 < j0 + n_tiles; ++j) {
    const int kst1 = (j + 1) % kKStages, vst = j % kVStages;
    mbar_wait(&sm.full_k[kst1], ((j + 1) / kKStages) & 1);
    mbar_wait(&sm.full_v[vst], (j / kVStages) & 1);
    fence_proxy_async();
    wgmma_fence();
    issue_qk(kst1);
    wgmma_commit();
    issue_pv(vst);
    wgmma_commit();
    wgmma_wait<1>();  // QK^T(j+1) done
    fence_regs(s_acc);
    const uint64_t vm = stage_valid(kst1);
    warp_arrive(&sm.empty_k[kst1]);
    softmax_stats(vm, alpha, mine_p);
    wgmma_wait<0>();  // PV(j) done
    fence_regs(o);
    warp_arrive(&sm.empty_v[vst]);
    softmax_apply(alpha, mine_p);
  }
  {  // ---- last PV
    const int j = j0 + n_tiles - 1, vst = j % kVStages;
    mbar_wait(&sm.full_v[vst], (j / kVStages) & 1);
    fence_proxy_async();
    wgmma_fence();
    issue_pv(vst);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
    warp_arrive(&sm.empty_v[vst]);  // the next item's tiles reuse the stage
  }

  // ---- epilogue: out = O * kv_scale / l, lse = ln2 * (m - 8 + log2 l); bf16 out and lse, or
  // (kSplit) the chunk's partials in the workspace (fp16 out in fp8 units, fp32 lse)
  {  // each consumer summed its half of the keys: l = both halves (slot 1 of the buffers is free now)
    reinterpret_cast<float2*>(&sm.xchg[c][1][0])[ctid] = make_float2(l_run[0], l_run[1]);
    named_bar_sync(kBarConsumers, 2 * kWarpgroup);
    const float2 other = reinterpret_cast<const float2*>(&sm.xchg[c ^ 1][1][0])[ctid];
    l_run[0] += other.x;  // a + b == b + a: both consumers get the same l
    l_run[1] += other.y;
  }
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float l = l_run[rh];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (!row_ok[rh]) continue;
    const bool empty = l == 0.f;  // no valid slot (a valid key contributes 2^8)
    const float scale = empty ? 0.f : (kSplit ? 1.f : p.kv_scale) / l;  // kSplit: fp8 units (the combine scales)
    const float lse = empty ? -INFINITY : (m_run[rh] - kPOffset + log2f(l)) * kLn2;
    // re-derived here rather than kept live through the main loop (the consumer is at its register cap)
    const CtaWork w = cta_work<kHeadBlocks, kSplit>(p, plan, it);
    const int64_t row = w.t * p.num_heads + static_cast<int64_t>(w.hb) * kHeadsPerCta + row0 + 8 * rh;
    if constexpr (kSplit) {
      const int64_t part_row = w.split * (p.num_tokens * p.num_heads) + row;
      __half* orow = plan.part_out + part_row * kVDim + c * kVHalf + 4 * qd;
#pragma unroll
      for (int jj = 0; jj < kVHalf / 16; ++jj) {
        const float* a = o + 8 * jj + 2 * rh;  // dims 4qd..4qd+3 of 16jj.. are a[0], a[4], a[1], a[5] (below)
        const __half2 lo = __floats2half2_rn(a[0] * scale, a[4] * scale);
        const __half2 hi = __floats2half2_rn(a[1] * scale, a[5] * scale);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&lo);
        packed.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(orow + 16 * jj) = packed;
      }
      if (c == 0 && qd == 0) plan.part_lse[part_row] = lse;
    } else {
      __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.out) + row * kVDim + c * kVHalf + 4 * qd;
#pragma unroll
      for (int jj = 0; jj < kVHalf / 16; ++jj) {
        // V^T row order: accumulator column block 2jj holds even dims, 2jj+1 odd dims of 16jj..16jj+15
        const float* a = o + 8 * jj + 2 * rh;
        const __nv_bfloat162 lo = __floats2bfloat162_rn(a[0] * scale, a[4] * scale);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(a[1] * scale, a[5] * scale);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&lo);
        packed.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(orow + 16 * jj) = packed;
      }
      if (c == 0 && qd == 0 && p.lse != nullptr) p.lse[row] = lse;
    }
  }
}

// kRows: real heads in the 64-row block (16, 32, 64); kHeadBlocks: 64-head blocks per token (1, 2);
// kSplit: one chunk of plan.tiles_per_split tiles per CTA, partials to the workspace.
template <int kRows, int kHeadBlocks, bool kSplit>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_fp8_kernel(const DsaSparseMlaParams p, const SplitPlan plan) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // the swizzle pattern is a function of the shared-memory address: align the K tiles to 1024
  Fp8Smem& sm = *reinterpret_cast<Fp8Smem*>(smem_raw + ((kSmemAlign - (smem_u32(smem_raw) & (kSmemAlign - 1))) &
                                                         (kSmemAlign - 1)));
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kKStages; ++s) {
      mbar_init(&sm.full_k[s], kGatherWarps * 33);          // one cp.async arrival per gather thread + its warp's mask
      mbar_init(&sm.empty_k[s], 8 + kTransposeWarps);      // 8 consumer warps + the transpose warps
    }
#pragma unroll
    for (int s = 0; s < kVStages; ++s) {
      mbar_init(&sm.full_v[s], kTransposeWarps * 32);
      mbar_init(&sm.empty_v[s], 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  dsa_pdl_wait();
  __syncthreads();  // barriers initialised
  const int n_items = num_items<kSplit>(p, plan, kHeadBlocks);
  if (threadIdx.x < kWarpgroup) {
    setmaxnreg_dec<kProducerRegs>();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < kGatherWarps) {
      gather_crew<kHeadBlocks, kSplit>(sm, p, plan, warp, lane);
    } else {
      int n_tiles = 0;
      for (int it = blockIdx.x; it < n_items; it += gridDim.x)
        n_tiles += cta_work<kHeadBlocks, kSplit>(p, plan, it).n_tiles;
      transpose_crew(sm, n_tiles, warp - kGatherWarps, lane);
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int c = threadIdx.x / kWarpgroup - 1;
    int j0 = 0;
    for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
      consumer<kRows, kHeadBlocks, kSplit>(sm, p, plan, it, j0, c);
      j0 += cta_work<kHeadBlocks, kSplit>(p, plan, it).n_tiles;
    }
  }
}

// ---------------------------------------------------------------- host: one launch of the kernel
constexpr size_t kSmemBytes = sizeof(Fp8Smem) + kSmemAlign;  // + room to align the base to 1024

// Work items: one per (token, head block[, chunk]), items = num_tokens * kHeadBlocks * n_splits;
// one persistent CTA per SM (at most) runs every gridDim.x-th item.
template <int kRows, int kHeadBlocks, bool kSplit>
int launch_kernel(const DsaSparseMlaParams& p, const SplitPlan& plan, cudaStream_t stream) {
  int status = dsa_kernel_attributes("sparse_mla", (const void*)sparse_mla_fp8_kernel<kRows, kHeadBlocks, kSplit>,
                                     kSmemBytes);
  if (status != DSA_OK) return status;
  int sms = 0;
  if ((status = current_sm_count(&sms)) != DSA_OK) return status;
  const int64_t items = p.num_tokens * kHeadBlocks * (kSplit ? plan.n_splits : 1);
  DSA_CHECK_ARG(items <= INT32_MAX - static_cast<int64_t>(sms),
                "sparse_mla: num_tokens=%lld gives %lld work items (> 2^31 - 1 - SMs)",
                static_cast<long long>(p.num_tokens), static_cast<long long>(items));
  const int64_t blocks = std::min<int64_t>(items, sms);
  DSA_CUDA_CHECK(dsa_launch_pdl(sparse_mla_fp8_kernel<kRows, kHeadBlocks, kSplit>, dim3(static_cast<unsigned>(blocks)),
                                dim3(kThreads), kSmemBytes, stream, p, plan));
  return DSA_OK;
}

}  // namespace dsa_sparse_mla
