// DSA-TRT kernels: the warp-specialised, TMA-fed fp8 block GEMM of the linear (fp8_linear.cu).
//
// out[t, n] = sum_kb s_x[t, kb] * s_w[n / 128, kb] * sum_{k in kb} q[t, k] * w[n, k], the fp32 inner
// sums per 128-wide K block from e4m3 wgmma (dsa_moe_kernels.h gives the numerics).
//
// A CTA is 384 threads: warpgroup 0 is the producer (one thread issues every TMA load, three in the
// grouped GEMM; the others idle), warpgroups 1 and 2 are the consumers. Each computes a 64-row half
// of the CTA's 128-row wgmma M. Two tilings of the same kernel, kSwap:
//   false (prefill, T > 64): M = 128 tokens, N = 128 weight rows; a consumer runs m64n128k32.
//   true  (decode, T <= 64): "swap AB", M = 128 weight rows, N = BT tokens (8..64), m64nBTk32:
//          decode is bound by the weight read, and 128 tokens of M would be mostly padding.
// Either way a tile is 128 weight rows (one weight-scale row block: s_w is one scalar per K block)
// against BT tokens (128 or 8..64), over K blocks [kb_begin, kb_end) of its split.
//
// Multicast (kMc = 2, prefill): CTAs run in clusters of two on adjacent token tiles of one weight
// tile; each loads its own token tile and half the weight tile into both CTAs (TMA multicast), so
// a CTA pulls 24 KB instead of 32 KB from L2 per K block (L2 bandwidth, not the MMAs, would
// bound the 128 x 128 tile otherwise). The grouped GEMM pairs the other way (a token tile holds one
// expert's rows, so two token tiles rarely share a weight tile): two adjacent weight tiles of one
// token tile, each CTA loading its own weight tile and half the token tile into both.
//
// Work: units = (weight tile, token tile, K split), ordered split-fastest, then in groups of
// kGroupW weight tiles with the token tiles inner (a wave of CTAs shares a few weight tiles and
// a few token tiles in L2). The grid is persistent: CTA b runs units b, b + gridDim.x, ...; the
// producer runs ahead into the next unit while the consumers finish the last, so the ring never
// drains between units.
//
// Ring: kStages stages of [weight tile 128 x 128 B | token tile BT x 128 B | s_box token scales],
// both tiles K-major with the 128-byte swizzle that the wgmma descriptors read (TMA writes that
// pattern: SWIZZLE_128B, 1024-aligned), scales fp32 from the transposed scale matrix
// s_x^T [nkb, T]. TMA zero-fills everything outside the tensors: weight rows past N, tokens past
// T, K past the end of a partial block (the weight's K; the quantised activations are zero there
// already), so edge tiles need no predication until the stores.
//
// mbarriers per stage s: full[s] (1 arrival: the producer's arrive.expect_tx of the stage's bytes,
// then the TMA transactions, the peer's multicast half included, which may land before the
// expect_tx: the tx-count may go negative within a phase) and empty[s] (8 kMc arrivals: lane 0 of
// each consumer warp of every CTA in the cluster, once its warpgroup's wgmmas of that stage
// completed and it read the stage's scales). Both CTAs of a cluster run the same iteration
// sequence (same weight tile and K blocks per unit), so their stages and rounds agree; a peer
// refills stage s of round r + 1 only after this CTA's consumers released round r, which they do
// after this CTA's full[s] completed round r: its multicast bytes always count to the right phase. Iteration i (over
// every K block of every unit of this CTA, in order) uses stage i % kStages in round
// r = i / kStages: consumers wait full[s] with parity r & 1 (the r-th completion), the producer
// waits empty[s] with parity (r & 1) ^ 1, i.e. the (r-1)-th release; in round 0 that is the phase
// "before" the first, which try_wait.parity reports complete, so the first kStages loads start at
// once. A stage is reused only after both warpgroups released it, and full[s] cannot complete
// twice ahead of a consumer because its producer waits on the release first.
//
// Per K block a consumer issues 4 x wgmma k32 into a zeroed fp32 accumulator, waits for them, and
// promotes: total += acc * (s_x * s_w) (the official fp8_gemm's per-block fp32 scaling), while the
// other warpgroup's wgmmas keep the tensor cores busy. kPipe (the linear's prefill plans tma-store
// and tma-pipe, the MoE's tma-pipe) double-buffers the accumulator instead: block b + 1's wgmmas
// are in flight while block b is promoted (wgmma_wait<1>); block b's token scales are read when
// its wgmmas are issued, its stage released as soon as they completed.
//
// Programmatic dependent launch: launched after the activation quantiser, the producer first loads
// the weight tiles of its first kStages stages (which do not depend on it), then waits
// (griddepcontrol.wait) and loads the activations; decode's weight stream starts while the
// quantiser runs.
//
// Epilogue: bf16 through shared memory (16-byte row-segment stores, or with kTmaStore TMA stores
// through map_o, the bf16 output [T, N]; unused otherwise), or fp32 partials of a K split
// straight from registers (the reduce kernel sums them in split order: deterministic).
//
// Grouped (the MoE's expert GEMMs, moe_experts.cu; prefill tile, no pairs, one split): the weight
// map is every local expert's [N, K] stacked ([E N, K]), the token map the expert-sorted rows.
// Unit u is weight tile u % w_tiles of the expert of token tile u / w_tiles of the tile table
// (moe_prep: rows [tile_start[t], min(+128, expert_offsets[e + 1])) of expert e = tile_expert[t]);
// *num_tiles tiles exist, a count on the device, read by every CTA at its start. A token tile may
// load rows of the next expert (or unwritten rows past the routed ones): each output row depends
// only on its own token row, and the epilogue stores rows < the tile's end only.
//
// kSwiGLU (the grouped gate/up GEMM, I % 128 == 0): weight tile w is h's 128-column group w, run
// as two sub-tiles one after the other (2 nkb K iterations per unit). Sub-tile b's 128 weight
// rows are gate rows [128 w + 64 b, +64) and the same up rows (two 64-row TMA boxes), each half
// promoted by its own weight scale; its epilogue turns gate and up into h = swiglu_bf16 of the
// bf16-rounded values (sub-tile 0's h waits in shared memory), quantises each row's 128 h values
// as one 1x128 group (the scale's amax across the quad) and stores e4m3 h and its scales, the
// down GEMM's operands: bitwise what the bf16 gate|up store + moe_swiglu_kernel give, without
// the P x 2I bf16 round trip.
#pragma once

#include <cuda.h>  // CUtensorMap (a by-value kernel parameter; the driver is reached via the runtime)
#include "fp8_gemm.cuh"
#include "fp8_gemm_ws_ptx.cuh"

namespace dsa_fp8_ws {

using dsa_fp8::float_to_bf16_bits;
using dsa_fp8::kBlock;
using dsa_fp8::kTileM;
using dsa_ptx::fence_proxy_async;
using dsa_ptx::named_bar_sync;
using dsa_ptx::setmaxnreg_dec;
using dsa_ptx::setmaxnreg_inc;
using dsa_ptx::smem_u32;

constexpr int kThreads = 384;      // producer warpgroup + two consumer warpgroups
constexpr int kGroupW = 8;         // weight tiles per raster group
constexpr uint32_t kProducerRegs = 40, kConsumerRegs = 232;  // 128 * 40 + 256 * 232 <= 65536
constexpr int kEmptyArrivals = 8;  // one per consumer warp
constexpr int kEpiPad = 8;         // bf16 staging rows of 128 + 8 elements: conflict-free, 16-byte rows

struct WsArgs {
  const float* w_scale;      // [ceil(N/128), nkb] fp32
  void* out;                 // bf16 [rows, out_stride], or fp32 partials [splits][rows, part_stride]
  int64_t out_stride;        // elements (bf16 out) or part_stride (fp32 partials, a multiple of 4)
  int64_t out_split_stride;  // elements between two splits' partial slabs
  int64_t rows;              // T
  int n, nkb;                // N, ceil(K / 128)
  int w_tiles, t_tiles, splits, kb_per_split;
  int t_groups;              // ceil(t_tiles / kMc): token tiles of a cluster's unit
  int vec_store;             // 1: bf16 out rows are 16-byte aligned (out 16-aligned, out_stride % 8 == 0)
  // grouped (NULL tile_expert: the linear): the tile table of moe_prep, the weight rows of one
  // expert in the weight map (N) and the floats of one expert's weight scales
  const int32_t* tile_expert;
  const int32_t* tile_start;
  const int32_t* expert_offsets;
  const int32_t* num_tiles;
  int w_expert_rows;
  int64_t ws_expert_stride;
  // floats in the scale box: BT, or BT + 4 where token tiles start anywhere (grouped): a TMA box's
  // innermost start must be 16-byte aligned (else the copy faults with an illegal instruction),
  // so the box starts at t_load rounded down to 4 and the consumers read it from t_load % 4 on
  int s_box;
  // kSwiGLU (the MoE's gate/up GEMM with h = swiglu_bf16 and its 1x128 quantiser in the epilogue):
  // I (an expert's w13 rows [0, I) are the gate, [I, 2I) the up; I % 128 == 0), h's e4m3 rows
  // [P, qh_stride] and their scales transposed [I / 128, sh_stride], ue8m0 (pow2) or fp32 scales
  int inter;
  uint8_t* qh;
  int64_t qh_stride;
  float* sh;
  int64_t sh_stride;
  int pow2;
  int x_rows;  // grouped, kMc = 2: the positions P in the token map (a half's box starts below it)
};

// kTmaStore (the linear's prefill tile, bf16 out, DSA_FP8_LINEAR_PATH=tma-store): the staging
// tile is [2 column halves][64 rows][64 columns] per consumer warpgroup, 128-byte swizzled, and
// one thread stores it with two TMA stores instead of 128 threads' row segments.
template <bool kSwap, int BT, bool kTmaStore = false>
struct WsTile {
  static_assert(kSwap ? (BT == 8 || BT == 16 || BT == 32 || BT == 64) : BT == 128, "token tile width");
  static_assert(!(kSwap && kTmaStore), "the TMA-store epilogue is the prefill tile's");
  static constexpr int kW = kTileM * kBlock;  // weight tile bytes (16 KB)
  static constexpr int kX = BT * kBlock;      // token tile bytes (a multiple of 1024)
  static constexpr int kS = 1024;             // BT scales, padded so stages stay 1024-aligned
  static constexpr int kStage = kW + kX + kS;
  static constexpr uint32_t kTxBytes = kW + kX;  // what TMA writes per stage (boxes, OOB included) + the scale box
  static constexpr int kAcc = (kSwap ? BT : kTileM) / 2;  // fp32 accumulators per consumer thread
  // bf16 staging: kSwap, [BT tokens][128 weight rows + pad] (transposed); else per consumer
  // warpgroup [64 tokens][128 weight rows + pad]
  static constexpr int kEpiRows = kSwap ? BT : 2 * 64;
  static constexpr int kEpi = kTmaStore ? 2 * 64 * kTileM * 2 : kEpiRows * (kTileM + kEpiPad) * 2;
  // Decode streams the weight: as many stages as fit (8..12, 128-192 KB of loads in flight per
  // SM, and as much weight prefetched while the quantiser runs); prefill needs fewer.
  static constexpr int kStages = kSwap ? (220 * 1024 - kEpi) / kStage : 5;
  static constexpr int kBars = 2 * kStages * 8;
  static constexpr int kSmem = kStages * kStage + kEpi + kBars + 1024;  // + alignment slack
  static_assert((BT + 4) * 4 <= kS, "scales must fit their slot");
  static_assert(kSmem <= 227 * 1024, "shared memory budget of an sm_90 CTA");
};

// ---------------------------------------------------------------- work units
// A cluster's unit: weight tile w_tile (its first row w_row in the weight map, its scales ws),
// token rows [t_row, t_end) of the output (t_load: the first row this CTA loads), K blocks
// [kb_begin, kb_end). The linear: token tiles [kMc t_group, +kMc) (CTA rank r takes
// kMc t_group + r; one past the last token tile loads the last again and stores nothing).
struct Unit {
  int w_tile, w_row, t_load, kb_begin, kb_end;
  int64_t t_row, t_end;
  const float* ws;
};
// Units of the grid: the linear's static count, or the grouped GEMM's from the device.
template <int kMc>
__device__ __forceinline__ int units_of(const WsArgs& g) {
  return g.tile_expert != nullptr ? *g.num_tiles * ((g.w_tiles + kMc - 1) / kMc) : g.w_tiles * g.t_groups * g.splits;
}
template <int BT, int kMc>
__device__ __forceinline__ Unit unit_of(const WsArgs& g, int u, int rank) {
  Unit r;
  if (g.tile_expert != nullptr) {  // grouped: one split (the host's launch checks)
    // kMc = 2: the pair takes weight tiles 2 v and 2 v + 1 of one token tile (one expert); a rank
    // past the last weight tile repeats the last and stores nothing
    const int w_units = (g.w_tiles + kMc - 1) / kMc;
    const int tile = u / w_units, e = g.tile_expert[tile], w_tile = (u % w_units) * kMc + rank;
    r.w_tile = min(w_tile, g.w_tiles - 1);
    r.w_row = e * g.w_expert_rows + r.w_tile * kTileM;
    r.t_row = r.t_load = g.tile_start[tile];
    r.t_end = w_tile < g.w_tiles ? min(r.t_row + BT, static_cast<int64_t>(g.expert_offsets[e + 1])) : r.t_row;
    r.kb_begin = 0;
    r.kb_end = g.nkb;
    r.ws = g.w_scale + e * g.ws_expert_stride + static_cast<int64_t>(r.w_tile) * g.nkb;
    return r;
  }
  const int split = u % g.splits, v = u / g.splits;
  const int per_group = kGroupW * g.t_groups;
  const int first_w = (v / per_group) * kGroupW;
  const int gsize = min(g.w_tiles - first_w, kGroupW);
  const int in_group = v % per_group;
  r.w_tile = first_w + in_group % gsize;
  r.w_row = r.w_tile * kTileM;
  const int t_tile = (in_group / gsize) * kMc + rank;
  r.t_row = static_cast<int64_t>(t_tile) * BT;  // >= rows for a CTA past the last tile
  r.t_load = min(t_tile, g.t_tiles - 1) * BT;
  r.t_end = g.rows;
  r.kb_begin = split * g.kb_per_split;
  r.kb_end = min(g.nkb, r.kb_begin + g.kb_per_split);
  r.ws = g.w_scale + static_cast<int64_t>(r.w_tile) * g.nkb;
  return r;
}

// ---------------------------------------------------------------- roles
// kMc = 2: this CTA (rank) loads its token tile, its scales and weight rows [64 rank, +64) of the
// shared weight tile, the latter multicast into both CTAs (grouped: its own weight tile, its scales
// and token rows [64 rank, +64) of the shared token tile, multicast); a stage is refilled once the
// consumers of both CTAs released it (each consumer warp arrives on both CTAs' empty barriers).
//
// The grouped GEMM (kXPairs) splits the producer into three threads (lane 0 of the producer
// warpgroup's warps 0, 1, 2) that run the same iteration sequence, each issuing one operand of every
// stage: kProdW the stage's arrive.expect_tx (all its bytes) and its weight rows, kProdX the token
// rows, kProdS the token scales; each waits for the stage's release itself, sleeping in the wait
// (mbar_wait<true>). kProdX's or kProdS's bytes may land before kProdW's expect_tx (the tx-count
// goes negative within the phase, as with a peer's multicast), and none can run a round ahead of
// kProdW: the release of round r needs full[s] of round r, which needs kProdW's arrival. The
// linear keeps one thread for all three (kProdAll): the split made its short-K shapes slower
// (docs/history/2026-12-07-fp8-gemm-producer.md).
enum ProducerRole { kProdAll, kProdW, kProdX, kProdS };
template <int role, bool kSwap, int BT, int kMc, bool kTmaStore, bool kSwiGLU, bool kXPairs>
__device__ __forceinline__ void producer(const WsArgs& g, const CUtensorMap* map_w, const CUtensorMap* map_x,
                                         const CUtensorMap* map_s, uint8_t* smem, uint32_t full0, uint32_t empty0,
                                         int units, int cluster, int clusters, int rank) {
  using L = WsTile<kSwap, BT, kTmaStore>;
  constexpr int S = L::kStages;
  constexpr bool kLoadW = role == kProdAll || role == kProdW, kLoadX = role == kProdAll || role == kProdX,
                 kLoadS = role == kProdAll || role == kProdS;
  const uint32_t base = smem_u32(smem);
  if constexpr (kLoadW) tma_prefetch_desc(map_w);
  if constexpr (kLoadX) tma_prefetch_desc(map_x);
  if constexpr (kLoadS) tma_prefetch_desc(map_s);
  constexpr int kWRows = kTileM / kMc;  // the linear's weight rows this CTA loads per stage
  constexpr int kSubs = kSwiGLU ? 2 : 1;  // K passes per unit
  const uint32_t w_off = rank * kWRows * kBlock;
  constexpr bool x_pairs = kMc > 1 && kXPairs;  // the grouped pairs share the token tile
  // kSwiGLU: sub-tile `sub` of a group is its gate rows [64 sub, +64) and the same up rows (64-row boxes)
  auto load_w = [&](uint32_t st, uint32_t full, int kb, int w_row, int sub) {
    if constexpr (kSwiGLU) {
      tma_load_2d(st, map_w, full, kb * kBlock, w_row + 64 * sub);
      tma_load_2d(st + 64 * kBlock, map_w, full, kb * kBlock, w_row + g.inter + 64 * sub);
    } else if constexpr (kMc == 1 || x_pairs)
      tma_load_2d(st, map_w, full, kb * kBlock, w_row);
    else  // a half past N (N <= 64 in the last tile) reads row N - 1 instead: no box starts out of
          // bounds; the rows it fills belong to outputs past N, which are never stored
      tma_load_2d_multicast(st + w_off, map_w, full, kb * kBlock, min(w_row + rank * kWRows, g.n - 1),
                            static_cast<uint16_t>((1u << kMc) - 1));
  };
  // Weight tiles of the first S iterations (every stage starts empty), before the activations exist.
  // (The expect_tx covers the whole stage: a peer's multicast may land before or after it.)
  int pre = 0;
  if constexpr (kLoadW) {
    for (int u = cluster; u < units && pre < S; u += clusters) {
      const Unit w = unit_of<BT, kMc>(g, u, rank);
      for (int sub = 0; sub < kSubs && pre < S; ++sub)
        for (int kb = w.kb_begin; kb < w.kb_end && pre < S; ++kb, ++pre) {
          mbar_arrive_expect_tx(full0 + 8 * pre, L::kTxBytes + 4 * g.s_box);
          load_w(base + pre * L::kStage, full0 + 8 * pre, kb, w.w_row, sub);
        }
    }
  }
  // kProdW reads nothing the previous kernel writes: it lets the dependents launch without waiting
  if constexpr (role == kProdW)
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  else
    dsa_pdl_wait();  // the quantised activations and their scales are written
  int i = 0, s = 0;
  uint32_t phase = 0;
  for (int u = cluster; u < units; u += clusters) {
    const Unit w = unit_of<BT, kMc>(g, u, rank);
    for (int sub = 0; sub < kSubs; ++sub)
      for (int kb = w.kb_begin; kb < w.kb_end; ++kb, ++i) {
        const uint32_t full = full0 + 8 * s, st = base + s * L::kStage;
        // kProdX / kProdS wait in round 0 too: the phase "before" the first reports complete
        if constexpr (role == kProdAll) {
          if (i >= pre) mbar_wait(empty0 + 8 * s, phase ^ 1);
        } else if (role != kProdW || i >= pre) {
          mbar_wait<true>(empty0 + 8 * s, phase ^ 1);
        }
        if constexpr (kLoadW) {
          if (i >= pre) {
            mbar_arrive_expect_tx(full, L::kTxBytes + 4 * g.s_box);
            load_w(st, full, kb, w.w_row, sub);
          }
        }
        if constexpr (kLoadX) {
          if constexpr (x_pairs)  // rows [64 rank, +64) of the token tile (64-row boxes; rows past P are never stored)
            tma_load_2d_multicast(st + L::kW + rank * 64 * kBlock, map_x, full, kb * kBlock,
                                  min(w.t_load + 64 * rank, g.x_rows - 1),
                                  static_cast<uint16_t>((1u << kMc) - 1));
          else
            tma_load_2d(st + L::kW, map_x, full, kb * kBlock, w.t_load);
        }
        if constexpr (kLoadS) tma_load_2d(st + L::kW + L::kX, map_s, full, w.t_load & ~3, kb);
        if (++s == S) {
          s = 0;
          phase ^= 1;
        }
      }
  }
}

// ---------------------------------------------------------------- kSwiGLU epilogue
// A consumer thread's m64n128 accumulator: total[4j + 2h + e] is row r_lo + 8h, tile column
// 8j + 2 quad + e. The fused tile's columns [0, 64) are gate rows and [64, 128) the same up rows,
// so gate total[4j + ..] pairs with up total[4 (j + 8) + ..], j < 8. -> h of the pair (j, h),
// two packed bf16 (the gate and up rounded to bf16 first, as the unfused GEMM stores them).
constexpr int kStashBytes = 16 * 256 * 4;  // sub-tile 0's h: 16 packed pairs per consumer thread
constexpr int kQPitch = kBlock + 16;       // e4m3 staging rows of h (16-byte aligned, conflict-free)
template <int R>
__device__ __forceinline__ uint32_t swiglu_pair(const float (&total)[R], int j, int h) {
  auto bf = [](float v) { return dsa_fp8::bf16_bits_to_float(float_to_bf16_bits(v)); };
  const float h0 = dsa_fp8::swiglu_bf16(bf(total[4 * j + 2 * h]), bf(total[4 * (j + 8) + 2 * h]));
  const float h1 = dsa_fp8::swiglu_bf16(bf(total[4 * j + 2 * h + 1]), bf(total[4 * (j + 8) + 2 * h + 1]));
  return static_cast<uint32_t>(float_to_bf16_bits(h0)) | (static_cast<uint32_t>(float_to_bf16_bits(h1)) << 16);
}
// Sub-tile 0's h into this thread's stash slots (thread-private: no barrier).
template <int R>
__device__ __forceinline__ void swiglu_stash(const float (&total)[R], uint32_t* stash, int tid256) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) stash[(2 * j + h) * 256 + tid256] = swiglu_pair(total, j, h);
}

// Consumer warpgroup c (0, 1) of the CTA; ct = its thread index (0..127).
// kPipe (prefill only): two accumulator sets; K block b + 1's wgmmas are issued before block b is
// waited for (wgmma_wait<1>) and promoted, so this warpgroup's tensor-core queue never drains
// while it promotes, releases and waits for the next stage. Without it both warpgroups wait on
// the same full barrier, issue, drain (wait<0>) and promote in lock-step, and the tensor cores
// idle for every promotion. Costs 64 more registers per thread (3 x 64 fp32 of 232).
template <bool kSwap, int BT, bool kF32Out, int kMc, bool kPipe, bool kTmaStore, bool kSwiGLU>
__device__ __forceinline__ void consumer(const WsArgs& g, const CUtensorMap* map_o, uint8_t* smem, uint32_t full0,
                                         uint32_t empty0, int units, int c, int cluster, int clusters, int rank) {
  using L = WsTile<kSwap, BT, kTmaStore>;
  constexpr int S = L::kStages, R = L::kAcc;
  constexpr int kOutRow = kTileM + kEpiPad;
  const int ct = threadIdx.x - 128 * (c + 1), warp = ct >> 5, lane = ct & 31;
  const int quad = lane & 3, grp = lane >> 2;
  const int r_lo = 64 * c + 16 * warp + grp;  // this thread's wgmma rows r_lo and r_lo + 8 (of 128)
  uint16_t* epi = reinterpret_cast<uint16_t*>(smem + S * L::kStage);
  // kSwiGLU: the staging area holds sub-tile 0's h, then h's e4m3 rows per warpgroup
  static_assert(!kSwiGLU || (kPipe && !kSwap && !kF32Out && !kTmaStore &&
                             kStashBytes + 2 * 64 * kQPitch <= L::kEpi),
                "the fused SwiGLU epilogue is the grouped prefill tile's");
  const int tid256 = ct + 128 * c;
  uint32_t* stash = reinterpret_cast<uint32_t*>(epi);
  int s = 0;
  uint32_t phase = 0;
  // lane 0 of each warp releases a stage on every CTA of the cluster (all of them refill it)
  auto release = [&](int stage) {
    __syncwarp();
    if (lane == 0) {
      if constexpr (kMc == 1) {
        mbar_arrive(empty0 + 8 * stage);
      } else {
#pragma unroll
        for (int q = 0; q < kMc; ++q) mbar_arrive_cluster(empty0 + 8 * stage, q);
      }
    }
  };
  // the operands' shared addresses, warp-uniform to ptxas: the wgmma descriptors stay in uniform
  // registers (from threadIdx or a generic pointer, every k32 step's went through R2UR)
  const uint32_t ring_u = dsa_ptx::warp_uniform(smem_u32(smem));
  if constexpr (kSwiGLU) {
    // with three producer threads beside it, ptxas kept the fused kernel's ring addresses in
    // per-thread registers (tests/test_kernel_sass.py); the broadcast makes them uniform again
    full0 = dsa_ptx::warp_uniform(full0);
    empty0 = dsa_ptx::warp_uniform(empty0);
  }
  const uint32_t a_off = dsa_ptx::warp_uniform(static_cast<uint32_t>(c * 64 * kBlock));
  // Prefill: warpgroup 1 issues a K block's wgmmas only after warpgroup 0 issued its own (named
  // barrier 4 of both, once per K block: point 0 before warpgroup 1's issue, point 1 after
  // warpgroup 0's), so the tensor pipe gets the two groups in a fixed order instead of both
  // warpgroups' k32 steps interleaved (cuBLASLt's kernel of the same tile does the same; the A/B:
  // docs/history/2026-12-07-fp8-gemm-stages-raster-order.md). Both warpgroups run the same units
  // and K blocks, so the barrier always completes.
  auto issue_order = [&](int point) {
    if constexpr (!kSwap) {
      if (c == 1 - point) named_bar_sync(4, 256);
    }
  };
  auto advance = [&] {
    if (++s == S) {
      s = 0;
      phase ^= 1;
    }
  };
  for (int u = cluster; u < units; u += clusters) {
    const Unit w = unit_of<BT, kMc>(g, u, rank);
    const float* ws = w.ws;
    const int s_off = w.t_load & 3;  // where this tile's scales start in the stage's scale box
    float total[R], acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) total[j] = 0.f;
    if constexpr (kPipe) {
      static_assert(!kSwap, "the pipelined mainloop is the prefill tile's");
      float acc2[R];
      // kPipe: issue K block kb (the next stage) into `a`; returns the block's scales s_w * s_x of
      // rows r_lo, r_lo + 8 (x, y; kSwiGLU: the gate columns, and z, w the up columns' with their
      // own s_w), read while its wgmmas run, off the promotion's path
      auto issue = [&](float(&a)[R], const float* wsg, const float* wsu, int kb) {
        const float sw = __ldg(wsg + kb), su = kSwiGLU ? __ldg(wsu + kb) : sw;
        uint8_t* st = smem + s * L::kStage;
        mbar_wait(full0 + 8 * s, phase);
        const float* sx = reinterpret_cast<const float*>(st + L::kW + L::kX) + (w.t_load & 3);
        const float x0 = sx[r_lo], x1 = sx[r_lo + 8];
        const uint32_t st_u = ring_u + s * L::kStage;
        const uint64_t da = dsa_fp8::make_desc_sw128_u32(st_u + L::kW + a_off);
        const uint64_t db = dsa_fp8::make_desc_sw128_u32(st_u);
    #pragma unroll
        for (int j = 0; j < R; ++j) dsa_fp8::fence_operand(a[j]);
        issue_order(0);
        dsa_wgmma::wgmma_fence();
        dsa_wgmma::ss_k128<kTileM>(a, da, db);
        dsa_wgmma::wgmma_commit();
        issue_order(1);
        advance();
        return make_float4(sw * x0, sw * x1, su * x0, su * x1);
      };
      // promote `a` (its group completed) by its block's scales, then release its stage
      auto promote = [&](float(&a)[R], float4 sc, int stage) {
#pragma unroll
        for (int j = 0; j < R; ++j) dsa_fp8::fence_operand(a[j]);
        release(stage);
        if constexpr (kSwiGLU) {
          dsa_fp8::promote_by_row<R, 0, R / 8>(total, a, sc.x, sc.y);
          dsa_fp8::promote_by_row<R, R / 8, R / 4>(total, a, sc.z, sc.w);
        } else {
          dsa_fp8::promote_by_row(total, a, sc.x, sc.y);
        }
      };
      // the unit's K blocks, the loop unrolled by two so each accumulator set stays in fixed
      // registers; first() runs while the first block's wgmmas do (before total is touched)
      auto k_loop = [&](const float* wsg, const float* wsu, auto first) {
        int kb = w.kb_begin, prev = s;
        float4 sc_prev = issue(acc, wsg, wsu, kb);
        first();
        for (++kb;; kb += 2) {
          if (kb >= w.kb_end) {
            dsa_wgmma::wgmma_wait<0>();
            promote(acc, sc_prev, prev);
            break;
          }
          int cur = s;
          float4 sc_cur = issue(acc2, wsg, wsu, kb);
          dsa_wgmma::wgmma_wait<1>();  // acc's group completed, acc2's in flight
          promote(acc, sc_prev, prev);
          prev = cur;
          sc_prev = sc_cur;
          if (kb + 1 >= w.kb_end) {
            dsa_wgmma::wgmma_wait<0>();
            promote(acc2, sc_prev, prev);
            break;
          }
          cur = s;
          sc_cur = issue(acc, wsg, wsu, kb + 1);
          dsa_wgmma::wgmma_wait<1>();
          promote(acc2, sc_prev, prev);
          prev = cur;
          sc_prev = sc_cur;
        }
      };
      if constexpr (kSwiGLU) {
        // sub-tile 0: h columns [0, 64) of the group, kept in shared memory until sub-tile 1's;
        // its h is made while sub-tile 1's first wgmmas run
        const float* wsu = ws + (g.inter / kBlock) * g.nkb;
        k_loop(ws, wsu, [] {});
        k_loop(ws, wsu, [&] {
          swiglu_stash(total, stash, tid256);
#pragma unroll
          for (int j = 0; j < R; ++j) total[j] = 0.f;
        });
      } else {
        k_loop(ws, ws, [] {});
      }
    }
    for (int kb = w.kb_begin; !kPipe && kb < w.kb_end; ++kb) {
      const float sw = __ldg(ws + kb);
      uint8_t* st = smem + s * L::kStage;
      mbar_wait(full0 + 8 * s, phase);
      // wgmma A: this warpgroup's 64 rows of the M operand; B: the whole N operand
      const uint32_t st_u = ring_u + s * L::kStage;
      const uint64_t da = dsa_fp8::make_desc_sw128_u32(st_u + (kSwap ? 0 : L::kW) + a_off);
      const uint64_t db = dsa_fp8::make_desc_sw128_u32(st_u + (kSwap ? L::kW : 0));
#pragma unroll
      for (int j = 0; j < R; ++j) dsa_fp8::fence_operand(acc[j]);
      dsa_wgmma::wgmma_fence();
      constexpr int kN = kSwap ? BT : kTileM;
      issue_order(0);
      dsa_wgmma::ss_k128<kN>(acc, da, db);
      dsa_wgmma::wgmma_commit();
      issue_order(1);
      dsa_wgmma::wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < R; ++j) dsa_fp8::fence_operand(acc[j]);
      const float* sx = reinterpret_cast<const float*>(st + L::kW + L::kX) + s_off;
      // acc[4j + {0,1}]: row r_lo, columns 8j + 2 quad + {0,1}; acc[4j + {2,3}]: row r_lo + 8
      if constexpr (kSwap) {
        float2 s2[BT / 8];
#pragma unroll
        for (int j = 0; j < BT / 8; ++j) s2[j] = *reinterpret_cast<const float2*>(sx + 8 * j + 2 * quad);
        release(s);
#pragma unroll
        for (int j = 0; j < BT / 8; ++j) dsa_fp8::promote_by_column(total, acc, j, sw * s2[j].x, sw * s2[j].y);
      } else {
        const float s0 = sw * sx[r_lo], s1 = sw * sx[r_lo + 8];
        release(s);
        dsa_fp8::promote_by_row(total, acc, s0, s1);
      }
      advance();
    }

    // ------------------------------------------------ epilogue
    [[maybe_unused]] const int n0 = w.w_tile * kTileM;  // output columns of the tile (of its expert)
    const int64_t t0 = w.t_row, t_end = w.t_end;
    if constexpr (kSwiGLU) {
      // h of both sub-tiles (128 columns: one 1x128 group per row across the quad's 4 lanes), its
      // quantiser (quant_group_store's numerics), e4m3 rows through shared memory, scales transposed
      uint32_t hp[2][16];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          hp[0][2 * j + h] = stash[(2 * j + h) * 256 + tid256];
          hp[1][2 * j + h] = swiglu_pair(total, j, h);
        }
      float amax[2] = {0.f, 0.f};
#pragma unroll
      for (int sub = 0; sub < 2; ++sub)
#pragma unroll
        for (int i = 0; i < 16; ++i)
          amax[i & 1] = fmaxf(amax[i & 1], fmaxf(fabsf(__uint_as_float(hp[sub][i] << 16)),
                                                 fabsf(__uint_as_float(hp[sub][i] & 0xFFFF0000u))));
      float sc[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 1));
        amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 2));
        sc[h] = dsa_fp8::act_scale(amax[h], g.pow2 != 0);
      }
      uint8_t* stage_q = reinterpret_cast<uint8_t*>(epi) + kStashBytes + c * 64 * kQPitch;
#pragma unroll
      for (int sub = 0; sub < 2; ++sub)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int j = i >> 1, h = i & 1;
          const uint32_t v = hp[sub][i];
          *reinterpret_cast<uint16_t*>(stage_q + (r_lo - 64 * c + 8 * h) * kQPitch + 64 * sub + 8 * j + 2 * quad) =
              dsa_fp8::quant2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u), sc[h], g.pow2 != 0);
        }
      named_bar_sync(2 + c, 128);
      const int64_t row0 = t0 + 64 * c;
      uint8_t* qh = g.qh + static_cast<int64_t>(w.w_tile) * kBlock;
      for (int v = ct; v < 64 * (kBlock / 16); v += 128) {
        const int r = v / (kBlock / 16), ch = v % (kBlock / 16);
        if (row0 + r < t_end)
          *reinterpret_cast<uint4*>(qh + (row0 + r) * g.qh_stride + 16 * ch) =
              *reinterpret_cast<const uint4*>(stage_q + r * kQPitch + 16 * ch);
      }
      if (quad == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (t0 + r_lo + 8 * h < t_end) g.sh[static_cast<int64_t>(w.w_tile) * g.sh_stride + t0 + r_lo + 8 * h] = sc[h];
      }
      named_bar_sync(2 + c, 128);  // the staging rows are free for the next unit
    } else if constexpr (kF32Out) {
      // partial slab of this split: [rows][part_stride] fp32, columns past N land in the padding
      float* part = static_cast<float*>(g.out) + static_cast<int64_t>(w.kb_begin / g.kb_per_split) *
                                                     g.out_split_stride;
#pragma unroll
      for (int j = 0; j < R / 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r_lo + 8 * h, col = 8 * j + 2 * quad;
          if constexpr (kSwap) {  // row: weight row, col: token
            const int n = n0 + row;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int64_t t = t0 + col + e;
              if (t < t_end && n < g.out_stride) part[t * g.out_stride + n] = total[4 * j + 2 * h + e];
            }
          } else {  // row: token, col: weight row
            const int64_t t = t0 + row;
            const int n = n0 + col;
            if (t < t_end && n < g.out_stride)
              *reinterpret_cast<float2*>(part + t * g.out_stride + n) =
                  make_float2(total[4 * j + 2 * h], total[4 * j + 2 * h + 1]);
          }
        }
      }
    } else if constexpr (kTmaStore) {
      // bf16 pairs into the swizzled staging tile (16-byte chunk q of row r at q ^ (r & 7), as
      // SWIZZLE_128B reads it: a warp's 32 stores hit 32 banks), then two 64 x 64 TMA stores;
      // rows past T and columns past N are clipped by the tensor map
      uint8_t* tile = reinterpret_cast<uint8_t*>(epi) + c * 64 * kTileM * 2;
      const uint32_t bar_id = 2 + c;
      if (ct == 0) tma_store_wait_read();  // the previous unit's stores have read the tile
      named_bar_sync(bar_id, 128);
#pragma unroll
      for (int j = 0; j < R / 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r_lo - 64 * c + 8 * h;
          const uint32_t v = static_cast<uint32_t>(float_to_bf16_bits(total[4 * j + 2 * h])) |
                             (static_cast<uint32_t>(float_to_bf16_bits(total[4 * j + 2 * h + 1])) << 16);
          *reinterpret_cast<uint32_t*>(tile + (j >> 3) * 64 * 128 + r * 128 + (((j & 7) ^ (r & 7)) << 4) + 4 * quad) =
              v;
        }
      }
      fence_proxy_async();  // this thread's tile writes, visible to the TMA unit
      named_bar_sync(bar_id, 128);
      const int64_t row0 = t0 + 64 * c;
      if (row0 + 64 <= t_end || t_end == g.rows) {  // whole rows, or clipped at the tensor's end
        if (ct == 0 && row0 < t_end) {
          tma_store_2d(map_o, smem_u32(tile), n0, static_cast<int>(row0));
          if (n0 + 64 < g.n) tma_store_2d(map_o, smem_u32(tile + 64 * 128), n0 + 64, static_cast<int>(row0));
          tma_store_commit();
        }
      } else {
        // a grouped tile ending inside the tensor (the rows after t_end are the next expert's):
        // rows [row0, t_end) in 16-byte segments read from the swizzled tile
        uint16_t* out = static_cast<uint16_t*>(g.out);
        for (int v = ct; v < 64 * (kTileM / 8); v += 128) {
          const int r = v / (kTileM / 8), q = v % (kTileM / 8), n = n0 + 8 * q;
          if (row0 + r >= t_end || n >= g.n) continue;
          *reinterpret_cast<uint4*>(out + (row0 + r) * g.out_stride + n) = *reinterpret_cast<const uint4*>(
              tile + (q >> 3) * 64 * 128 + r * 128 + (((q & 7) ^ (r & 7)) << 4));
        }
      }
    } else {
      // stage bf16 [token][weight row] in shared memory, then 16-byte row segments to global
      uint16_t* tile = kSwap ? epi : epi + c * 64 * kOutRow;
#pragma unroll
      for (int j = 0; j < R / 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r_lo + 8 * h, col = 8 * j + 2 * quad;
          if constexpr (kSwap) {
            tile[col * kOutRow + row] = float_to_bf16_bits(total[4 * j + 2 * h]);
            tile[(col + 1) * kOutRow + row] = float_to_bf16_bits(total[4 * j + 2 * h + 1]);
          } else {
            const uint32_t v = static_cast<uint32_t>(float_to_bf16_bits(total[4 * j + 2 * h])) |
                               (static_cast<uint32_t>(float_to_bf16_bits(total[4 * j + 2 * h + 1])) << 16);
            *reinterpret_cast<uint32_t*>(tile + (row - 64 * c) * kOutRow + col) = v;
          }
        }
      }
      // kSwap: both warpgroups fill one tile (barrier 1, 256 threads); else each its own (2 + c)
      const uint32_t bar_id = kSwap ? 1 : 2 + c, bar_threads = kSwap ? 256 : 128;
      named_bar_sync(bar_id, bar_threads);
      constexpr int kRows = kSwap ? BT : 64;
      const int first = kSwap ? ct + 128 * c : ct, step = kSwap ? 256 : 128;
      const int64_t row0 = t0 + (kSwap ? 0 : 64 * c);
      uint16_t* out = static_cast<uint16_t*>(g.out);
      for (int v = first; v < kRows * (kTileM / 8); v += step) {
        const int r = v / (kTileM / 8), n = n0 + (v % (kTileM / 8)) * 8;
        const int64_t t = row0 + r;
        if (t >= t_end || n >= g.n) continue;
        const uint16_t* src = tile + r * kOutRow + (n - n0);
        uint16_t* dst = out + t * g.out_stride + n;
        if (g.vec_store && n + 8 <= g.n) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          for (int e = 0; e < 8 && n + e < g.n; ++e) dst[e] = src[e];
        }
      }
      named_bar_sync(bar_id, bar_threads);  // the staging tile is free for the next unit
    }
  }
  if constexpr (kTmaStore) {
    if (ct == 0) tma_store_wait();  // the CTA's shared memory outlives the last stores' reads
  }
}

// kXPairs (kMc = 2, the grouped GEMM only): pairs on adjacent weight tiles sharing the token tile.
template <bool kSwap, int BT, bool kF32Out, int kMc, bool kPipe = false, bool kTmaStore = false,
          bool kSwiGLU = false, bool kXPairs = false>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_gemm_ws_kernel(const WsArgs g, const __grid_constant__ CUtensorMap map_w,
                       const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_s,
                       const __grid_constant__ CUtensorMap map_o) {
  static_assert(kMc == 1 || (kMc == 2 && !kSwap), "multicast pairs prefill CTAs only");
  using L = WsTile<kSwap, BT, kTmaStore>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = dsa_fp8::align_smem_1024(smem_raw);
  const uint32_t full0 = smem_u32(smem + L::kStages * L::kStage + L::kEpi);
  const uint32_t empty0 = full0 + 8 * L::kStages;
  const int units = units_of<kMc>(g);
  // clusters of kMc CTAs along x (kMc = 1: every CTA is its own)
  const int rank = kMc == 1 ? 0 : static_cast<int>(cluster_ctarank());
  const int cluster = blockIdx.x / kMc, clusters = gridDim.x / kMc;
  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, kEmptyArrivals * kMc);
    }
    // the initialised barriers, visible to the async proxy (TMA completes on them) and the cluster
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  if constexpr (kMc == 1)
    __syncthreads();
  else
    cluster_sync();  // the peer's barriers exist before any multicast or remote arrival
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kProducerRegs>();
    if constexpr (kXPairs) {
      if (threadIdx.x == 0)
        producer<kProdW, kSwap, BT, kMc, kTmaStore, kSwiGLU, kXPairs>(g, &map_w, &map_x, &map_s, smem, full0, empty0,
                                                                      units, cluster, clusters, rank);
      else if (threadIdx.x == 32)
        producer<kProdX, kSwap, BT, kMc, kTmaStore, kSwiGLU, kXPairs>(g, &map_w, &map_x, &map_s, smem, full0, empty0,
                                                                      units, cluster, clusters, rank);
      else if (threadIdx.x == 64)
        producer<kProdS, kSwap, BT, kMc, kTmaStore, kSwiGLU, kXPairs>(g, &map_w, &map_x, &map_s, smem, full0, empty0,
                                                                      units, cluster, clusters, rank);
      else
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    } else if (threadIdx.x == 0) {
      producer<kProdAll, kSwap, BT, kMc, kTmaStore, kSwiGLU, kXPairs>(g, &map_w, &map_x, &map_s, smem, full0, empty0,
                                                                      units, cluster, clusters, rank);
    } else {
      // the rest of the producer warpgroup has no work (its dependents may launch: no global access)
      asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    // Consumers read only what the producer's TMA loads (ordered by the mbarriers) and w_scale
    // (not written by the quantiser); their output stores follow the producer's wait.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    consumer<kSwap, BT, kF32Out, kMc, kPipe, kTmaStore, kSwiGLU>(g, &map_o, smem, full0, empty0, units, threadIdx.x / 128 - 1, cluster, clusters, rank);
  }
  // No CTA leaves while its peer may still arrive on its barriers (every multicast into this CTA
  // was consumed here already: its consumers waited for the stages).
  if constexpr (kMc > 1) cluster_sync();
}

}  // namespace dsa_fp8_ws
