// DSA-TRT kernels: DsaFp8BlockLinear (dsa_moe_kernels.h), out = bf16(x @ dequant(W)^T) with the
// official W8A8 numerics.
//
// Two or three kernels on the stream, all sizes static (CUDA-graph safe, no host synchronisation):
//   1. act_quant: one warp per (token, 128-group) -> e4m3 rows + fp32 scales in the workspace.
//   2. the GEMM, one of
//      - "tma-store" (T > 64, prefill): fp8_gemm_ws.cuh, 128 tokens x 128 weight rows per tile,
//        CTAs in pairs (clusters of 2) on adjacent token tiles sharing the weight tile by
//        multicast, the pipelined mainloop (kPipe), bf16 tiles out by TMA stores (kTmaStore);
//      - "tma-swap" (T <= 64, decode, bound by the weight read): fp8_gemm_ws.cuh swapped, 128
//        weight rows x BT tokens (BT = 8..64);
//      - "legacy" (only when forced, below): fp8_gemm.cuh's cp.async swap-AB tile, the MoE's core.
//      Weight tiles alone may not cover the GPU (q_a: 12 tiles, decode's q_b: 192 tiles = 1.45
//      waves), so the K blocks are split when that shortens the busiest SM's queue, each split
//      writing fp32 partials;
//   3. splitk_reduce sums the partials in split order (deterministic) -> bf16.
// The TMA kernels are programmatic dependent launches (fp8_gemm_ws.cuh): their weight loads start
// while act_quant runs; the reduce follows the GEMM the same way.
// The plan (path, tile, splits) depends only on (T, N, K) and DSA_FP8_LINEAR_PATH, and the
// workspace covers every path's plan, so its size is known without a device.
//
// DSA_FP8_LINEAR_PATH (tests, benchmarks): unset or "auto" picks by T as above; "tma", "tma-nomc"
// (the prefill tile without pairs), "tma-pipe" (the prefill tile, pairs, its consumers keeping
// the next K block's wgmmas in flight while promoting: fp8_gemm_ws.cuh kPipe), "tma-store"
// (tma-pipe whose bf16 tiles leave by TMA stores: kTmaStore; unsplit, 16-byte rows, else
// tma-pipe's epilogue), "tma-swap" or
// "legacy" forces that GEMM at every T. DSA_FP8_LINEAR_SPLITS=N caps the K splits at N (the
// deterministic mode sets 1: runtime/knobs.py deterministic_kernels). Both read at every launch.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>

#include "fp8_gemm_ws_launch.cuh"

namespace dsa_fp8 {

// ---------------------------------------------------------------- kernels
// One warp per (token t, G consecutive 1x128 K blocks), their loads issued together (one 8-byte
// load per lane and block); lane i stores block i's scale. Scales go to scale[t * st_t + kb * st_kb]:
// [T, nkb] for the legacy GEMM, transposed [nkb, T_pad] for the TMA GEMMs (a tile's token scales of
// one K block are one contiguous box). G: aq_groups.
template <int G>
__global__ void __launch_bounds__(256) act_quant_kernel(const uint16_t* __restrict__ x, int64_t x_stride,
                                                         int64_t num_tokens, int k, int nkb, uint8_t* __restrict__ q,
                                                         float* __restrict__ scale, int64_t st_t, int64_t st_kb,
                                                         int pow2, int vec) {
  // The GEMM after this kernel waits (griddepcontrol.wait) for all of it before reading what it
  // writes; letting it launch now overlaps its prologue and weight loads with this kernel.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int groups = (nkb + G - 1) / G;
  if (gw >= num_tokens * groups) return;  // warp-uniform
  const int64_t t = gw / groups;
  const int kb0 = static_cast<int>(gw % groups) * G;
  float v[G][4];
#pragma unroll
  for (int i = 0; i < G; ++i) {
    const int k0 = (kb0 + i) * kBlock + 4 * lane;
    load_bf16x4(x + t * x_stride + k0, kb0 + i < nkb ? k - k0 : 0, vec != 0, v[i]);
  }
  float my_s = 0.f;
#pragma unroll
  for (int i = 0; i < G; ++i) {
    const int kb = kb0 + i;
    if (kb >= nkb) break;  // warp-uniform
    float s;
    reinterpret_cast<uint32_t*>(q + (t * nkb + kb) * kBlock)[lane] = quant_group(v[i], pow2 != 0, &s);
    if (lane == i) my_s = s;
  }
  if (lane < G && kb0 + lane < nkb) scale[t * st_t + (kb0 + lane) * st_kb] = my_s;
}

// Tiles in groups of kGroupM weight tiles, token tiles inner: a wave of CTAs reads a few weight
// tiles and a few token tiles, which stay in L2, instead of the whole weight once per token tile.
constexpr int kGroupM = 8;

template <int BN, bool kF32Out>
__global__ void __launch_bounds__(kThreads, kCtasPerSm<BN>) linear_kernel(const GemmArgs g) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  const int m_tiles = (g.n + kTileM - 1) / kTileM;
  const int64_t t_tiles = (g.rows + BN - 1) / BN;
  const int64_t bid = blockIdx.x, per_group = kGroupM * t_tiles;
  const int first_m = static_cast<int>(bid / per_group) * kGroupM;
  const int gsize = min(m_tiles - first_m, kGroupM);
  const int64_t in_group = bid % per_group;
  const int m_tile = first_m + static_cast<int>(in_group % gsize);
  const int64_t row_begin = (in_group / gsize) * BN;
  const int split = blockIdx.y;
  const int kb_begin = split * g.kb_per_split, kb_end = min(g.nkb, kb_begin + g.kb_per_split);
  const int64_t row_end = g.rows < row_begin + BN ? g.rows : row_begin + BN;
  gemm_tile<BN, kF32Out>(g, smem, 0, m_tile, row_begin, row_end, kb_begin, kb_end, split);
}

// part: [splits][T, part_stride] fp32 -> out [T, out_stride] bf16, summed in split order.
__global__ void __launch_bounds__(256) splitk_reduce_kernel(const float* __restrict__ part, int splits,
                                                             int64_t split_stride, int64_t part_stride,
                                                             int64_t num_tokens, int n, uint16_t* __restrict__ out,
                                                             int64_t out_stride) {
  dsa_pdl_wait();  // the GEMM's partials are written (returns at once after a plain launch)
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_tokens * n) return;
  const int64_t t = i / n;
  const int col = static_cast<int>(i % n);
  const float* p = part + t * part_stride + col;
  float s = p[0];
  for (int sp = 1; sp < splits; ++sp) s += p[sp * split_stride];
  out[t * out_stride + col] = float_to_bf16_bits(s);
}

// ---------------------------------------------------------------- plan
enum class Path { kAuto, kTma, kTmaNoMc, kTmaPipe, kTmaStore, kTmaSwap, kLegacy };

constexpr int kSwapMaxTokens = 64;  // the widest swapped token tile
constexpr int kPlanSms = 132;       // H200 SMs: the plan must not depend on the device (workspace size)
// act_quant's blocks per warp. Four loads in flight per lane took T=8192 x K=7168 from ~170 to ~163
// µs of op time on an H100 (kv_a), but cost 0.6-1.6 µs at T=1, where the grid is a few CTAs and
// the four blocks' reductions run one after another: four only once one block per warp would be
// more warps than the GPU holds at once (kPlanSms x 64).
inline int aq_groups(int64_t num_tokens, int nkb) { return num_tokens * nkb > 64LL * kPlanSms ? 4 : 1; }
constexpr int kLegacyTargetCtas = 264;  // legacy: two waves of 132 SMs at two CTAs per SM
constexpr int kMinBlocksPerSplit = 2;
constexpr int kMaxSplits = 32;
// A split's fixed cost in K-block steps of one SM (a step: one 16 KB weight tile read or one
// 128 x 128 x 128 tile of MMAs, both ~0.4-0.5 us): the reduce kernel's launch and tail.
constexpr double kSplitFixedSteps = 4.0;
constexpr double kStepBytes = kPlanSms * 16384.0;  // bytes the GPU moves per step
// Bytes a split's fp32 partials cost per output element: 4 written by the GEMM and 4 read by the
// reduce, twice that for the prefill tile once the partials (4 x splits x T x N bytes) outgrow
// kPartialL2Bytes (the decode tile's, T <= 64, were not measured against unsplit): on an
// H100 (2026-12-06) at T=2048, q_a split 2 / kv_a split 3 (25 / 14 MB of partials) took 64.6 /
// 31.2 µs of GEMM and reduce against 49.6 / 25.7 unsplit, which the plan chose counting 8; at
// T=512 q_a split 2 / kv_a split 6 (6 / 7 MB) beat unsplit, 22.0 / 14.1 against 25.9 / 24.9.
constexpr double kPartialBytes = 8.0;
constexpr double kPartialL2Bytes = 12.0 * (1 << 20);

struct LinearPlan {
  Path path;
  int bt, splits, kb_per_split, nkb, w_tiles, t_tiles;
  int mc, t_groups;   // CTAs per cluster sharing a weight tile (multicast), token tiles per cluster unit
  int64_t t_pad;      // scale rows of the transposed layout (T rounded up to 4: 16-byte rows)
  int64_t part_stride;  // fp32 partial row (N rounded up to 4)
  size_t q_bytes, s_bytes, part_bytes;
};

static size_t align256(size_t b) { return (b + 255) & ~static_cast<size_t>(255); }

static int pick_bn(int64_t rows) {
  if (rows <= 8) return 8;
  if (rows <= 16) return 16;
  if (rows <= 32) return 32;
  if (rows <= 64) return 64;
  return 128;
}

// The split count minimising the busiest SM's steps plus the splits' cost: the reduce and the fp32
// partials written and read. The persistent grid runs one unit (a weight tile x a cluster's mc token
// tiles x a split of kb_per_split steps) per cluster at a time, kPlanSms / mc clusters at once, so
// waves are counted in cluster units: at T=384 (3 token tiles, paired as 2 + 1) on the H100
// (2026-12-07) o_proj split 2 / dense down split 3, chosen counting CTA tiles, took 140.6 / 176.5 µs
// of GEMM and reduce against 119.8 / 135.5 unsplit.
static int pick_splits_tma(int64_t cluster_units, int mc, int nkb, int64_t t, int n, bool prefill) {
  const int slots = kPlanSms / std::max(mc, 1);
  int best = 1;
  double best_cost = static_cast<double>(dsa_ceil_div(cluster_units, slots)) * nkb;
  for (int s = 2; s <= std::min(kMaxSplits, nkb / kMinBlocksPerSplit); ++s) {
    const int kbps = static_cast<int>(dsa_ceil_div(nkb, s));
    const int s_eff = static_cast<int>(dsa_ceil_div(nkb, kbps));
    const double elements = static_cast<double>(s_eff) * t * n;
    const double per_element = (prefill && 4.0 * elements > kPartialL2Bytes ? 2.0 : 1.0) * kPartialBytes;
    const double partial_steps = per_element * elements / kStepBytes;
    const double cost = static_cast<double>(dsa_ceil_div(cluster_units * s_eff, slots)) * kbps + kSplitFixedSteps +
                        partial_steps;
    if (cost < best_cost) {
      best_cost = cost;
      best = s_eff;
    }
  }
  return best;
}

static int pick_splits_legacy(int64_t tiles, int nkb) {
  constexpr int kLegacyMinBlocksPerSplit = 4;
  int splits = 1;
  if (tiles < kLegacyTargetCtas)
    splits = static_cast<int>(
        std::min<int64_t>(dsa_ceil_div(kLegacyTargetCtas, tiles), nkb / kLegacyMinBlocksPerSplit));
  return std::max(splits, 1);
}

// The fp32 partials' budget for T tokens: kMaxSplits slabs of [T, N], at most 32 MiB (a shape whose
// slab alone exceeds it does not split). It grows with T, so a workspace sized for the largest T
// (a TensorRT profile's max) holds the partials of every smaller T too, although a smaller T may
// split K more.
constexpr size_t kPartialBudgetCap = 32u << 20;
static size_t partial_budget(int64_t t, int64_t part_row) {
  const size_t slab = static_cast<size_t>(t) * part_row * sizeof(float);
  return std::min(kPartialBudgetCap, static_cast<size_t>(kMaxSplits) * slab);
}

// max_splits (DSA_FP8_LINEAR_SPLITS; 0: no cap) caps the K splits: 1 makes a row's sum order (K
// blocks in order, one fp32 accumulator) the same at every T, as the deterministic mode needs.
static LinearPlan plan_linear(int64_t t, int n, int k, Path forced, int max_splits = 0) {
  LinearPlan p{};
  t = std::max<int64_t>(t, 0);
  n = std::max(n, 1);
  p.nkb = static_cast<int>(dsa_ceil_div(std::max(k, 1), kBlock));
  p.path = forced != Path::kAuto ? forced : (t <= kSwapMaxTokens ? Path::kTmaSwap : Path::kTmaStore);
  const bool square = p.path != Path::kTmaSwap && p.path != Path::kLegacy;  // the 128 x 128 prefill tile
  p.bt = square ? kTileM : std::min(pick_bn(t), p.path == Path::kTmaSwap ? kSwapMaxTokens : kTileM);
  p.w_tiles = static_cast<int>(dsa_ceil_div(n, kTileM));
  p.t_tiles = static_cast<int>(dsa_ceil_div(std::max<int64_t>(t, 1), p.bt));
  // prefill pairs CTAs on adjacent token tiles: each loads half the weight tile for both
  p.mc = square && p.path != Path::kTmaNoMc && p.t_tiles >= 2 ? 2 : 1;
  p.t_groups = static_cast<int>(dsa_ceil_div(p.t_tiles, p.mc));
  const int64_t tiles = static_cast<int64_t>(p.w_tiles) * p.t_tiles;
  int splits = p.path == Path::kLegacy
                   ? pick_splits_legacy(tiles, p.nkb)
                   : pick_splits_tma(static_cast<int64_t>(p.w_tiles) * p.t_groups, p.mc, p.nkb, t, n, square);
  p.part_stride = p.path == Path::kLegacy ? n : (n + 3) / 4 * 4;
  const size_t slab = std::max<size_t>(static_cast<size_t>(t) * p.part_stride * sizeof(float), 1);
  splits = static_cast<int>(std::min<size_t>(splits, partial_budget(t, (n + 3) / 4 * 4) / slab));
  if (max_splits > 0) splits = std::min(splits, max_splits);
  p.kb_per_split = static_cast<int>(dsa_ceil_div(p.nkb, std::max(splits, 1)));
  p.splits = static_cast<int>(dsa_ceil_div(p.nkb, p.kb_per_split));  // no empty split, never more than asked
  p.t_pad = (t + 3) / 4 * 4;
  p.q_bytes = align256(static_cast<size_t>(t) * p.nkb * kBlock);
  // scales: [T, nkb] (legacy) or [nkb, t_pad] (TMA); the workspace reserves the larger
  p.s_bytes = align256(static_cast<size_t>(p.t_pad) * p.nkb * sizeof(float));
  p.part_bytes = p.splits > 1 ? align256(static_cast<size_t>(p.splits) * t * p.part_stride * sizeof(float)) : 0;
  return p;
}

// DSA_FP8_LINEAR_PATH -> the forced path; DSA_ERR_INVALID_ARG for a value it does not know.
static int forced_path(Path* out) {
  const char* e = getenv("DSA_FP8_LINEAR_PATH");
  *out = Path::kAuto;
  if (e == nullptr || *e == '\0' || strcmp(e, "auto") == 0) return DSA_OK;
  if (strcmp(e, "tma") == 0) *out = Path::kTma;
  else if (strcmp(e, "tma-nomc") == 0) *out = Path::kTmaNoMc;
  else if (strcmp(e, "tma-pipe") == 0) *out = Path::kTmaPipe;
  else if (strcmp(e, "tma-store") == 0) *out = Path::kTmaStore;
  else if (strcmp(e, "tma-swap") == 0) *out = Path::kTmaSwap;
  else if (strcmp(e, "legacy") == 0) *out = Path::kLegacy;
  else
    return dsa_set_error(DSA_ERR_INVALID_ARG,
                         "fp8_block_linear: DSA_FP8_LINEAR_PATH=%s unknown (auto, tma, tma-nomc, tma-pipe, tma-store, "
                         "tma-swap, legacy)",
                         e);
  return DSA_OK;
}

// DSA_FP8_LINEAR_SPLITS -> the most K splits a plan may use (0: unset, the plan's own choice);
// DSA_ERR_INVALID_ARG for anything but a positive integer.
static int max_splits_env(int* out) {
  const char* e = getenv("DSA_FP8_LINEAR_SPLITS");
  *out = 0;
  if (e == nullptr || *e == '\0') return DSA_OK;
  char* end = nullptr;
  const long v = strtol(e, &end, 10);
  if (*end != '\0' || v < 1 || v > kMaxSplits)
    return dsa_set_error(DSA_ERR_INVALID_ARG,
                         "fp8_block_linear: DSA_FP8_LINEAR_SPLITS=%s must be an integer in [1, %d] (the most K "
                         "splits; 1: the same sum order at every token count)",
                         e, kMaxSplits);
  *out = static_cast<int>(v);
  return DSA_OK;
}

// ---------------------------------------------------------------- launches
template <int BN, bool kF32Out>
static int launch_legacy(const GemmArgs& g, int m_tiles, int splits, cudaStream_t stream) {
  auto kernel = linear_kernel<BN, kF32Out>;
  constexpr int smem = Tile<BN>::kSmem;
  const int st = dsa_kernel_attributes("fp8_block_linear", reinterpret_cast<const void*>(kernel), smem);
  if (st != DSA_OK) return st;
  const int64_t blocks = m_tiles * dsa_ceil_div(g.rows, BN);
  DSA_CHECK_SUPPORTED(blocks < (1ll << 31), "fp8_block_linear: %lld tiles exceed the grid", (long long)blocks);
  kernel<<<dim3(static_cast<unsigned>(blocks), splits), kThreads, smem, stream>>>(g);
  DSA_CUDA_CHECK_LAUNCH();
  return DSA_OK;
}

static int legacy_gemm(const DsaFp8BlockLinearParams* p, const LinearPlan& plan, const uint8_t* q, const float* sx,
                       float* part, cudaStream_t stream) {
  GemmArgs g{};
  g.w = static_cast<const uint8_t*>(p->weight);
  g.w_scale = p->weight_scale;
  g.n = p->n;
  g.k = p->k;
  g.nkb = plan.nkb;
  g.a = q;
  g.a_scale = sx;
  g.a_stride = static_cast<int64_t>(plan.nkb) * kBlock;
  g.rows = p->num_tokens;
  g.kb_per_split = plan.kb_per_split;
  const bool split = plan.splits > 1;
  if (split) {
    g.out = part;
    g.out_stride = plan.part_stride;
    g.out_split_stride = p->num_tokens * plan.part_stride;
    g.vec_store = plan.part_stride % 4 == 0;
  } else {
    g.out = p->out;
    g.out_stride = p->out_stride;
    g.vec_store = (reinterpret_cast<uintptr_t>(p->out) & 15) == 0 && p->out_stride % 8 == 0;
  }
  const int m_tiles = plan.w_tiles;
#define DSA_LINEAR_BN(BN)                                                    \
  return split ? launch_legacy<BN, true>(g, m_tiles, plan.splits, stream) \
               : launch_legacy<BN, false>(g, m_tiles, 1, stream)
  switch (plan.bt) {
    case 8: DSA_LINEAR_BN(8);
    case 16: DSA_LINEAR_BN(16);
    case 32: DSA_LINEAR_BN(32);
    case 64: DSA_LINEAR_BN(64);
    default: DSA_LINEAR_BN(128);
  }
#undef DSA_LINEAR_BN
}

template <bool kSwap, int BT, bool kF32Out, int kMc, bool kPipe = false, bool kTmaStore = false>
static int launch_ws(const dsa_fp8_ws::WsArgs& g, const CUtensorMap& mw, const CUtensorMap& mx,
                     const CUtensorMap& ms, const CUtensorMap& mo, cudaStream_t stream) {
  auto kernel = dsa_fp8_ws::fp8_gemm_ws_kernel<kSwap, BT, kF32Out, kMc, kPipe, kTmaStore>;
  constexpr int smem = dsa_fp8_ws::WsTile<kSwap, BT, kTmaStore>::kSmem;
  const int64_t units = static_cast<int64_t>(g.w_tiles) * g.t_groups * g.splits;  // one per cluster
  DSA_CHECK_SUPPORTED(units < (1ll << 31), "fp8_block_linear: %lld work units exceed int32", (long long)units);
  static std::atomic<int> cache[64];
  return dsa_fp8_ws::launch_persistent("fp8_block_linear", kernel, kMc, smem, units, true, cache, stream, g, mw, mx,
                                       ms, mo);
}

static int tma_gemm(const DsaFp8BlockLinearParams* p, const LinearPlan& plan, const uint8_t* q, const float* sx,
                    float* part, cudaStream_t stream) {
  using namespace dsa_fp8_ws;
  DSA_CHECK_ARG((reinterpret_cast<uintptr_t>(p->weight_scale) & 3) == 0,
                "fp8_block_linear: weight_scale=%p not 4-byte aligned", p->weight_scale);
  const int64_t t = p->num_tokens;
  const int bt = plan.bt;
  CUtensorMap mw, mx, ms;
  int st = encode_tensor_map_2d(&mw, p->weight, CU_TENSOR_MAP_DATA_TYPE_UINT8, p->k, p->n, p->k, kBlock,
                                kTileM / plan.mc, CU_TENSOR_MAP_SWIZZLE_128B, "fp8_block_linear: weight");
  if (st != DSA_OK) return st;
  st = encode_tensor_map_2d(&mx, q, CU_TENSOR_MAP_DATA_TYPE_UINT8, static_cast<uint64_t>(plan.nkb) * kBlock, t,
                            static_cast<uint64_t>(plan.nkb) * kBlock, kBlock, bt, CU_TENSOR_MAP_SWIZZLE_128B,
                            "fp8_block_linear: quantised x");
  if (st != DSA_OK) return st;
  st = encode_tensor_map_2d(&ms, sx, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, t, plan.nkb, plan.t_pad * 4, bt, 1,
                            CU_TENSOR_MAP_SWIZZLE_NONE, "fp8_block_linear: x scales");
  if (st != DSA_OK) return st;

  WsArgs g{};
  g.w_scale = p->weight_scale;
  g.rows = t;
  g.n = p->n;
  g.nkb = plan.nkb;
  g.w_tiles = plan.w_tiles;
  g.t_tiles = plan.t_tiles;
  g.t_groups = plan.t_groups;
  g.splits = plan.splits;
  g.kb_per_split = plan.kb_per_split;
  g.s_box = bt;  // token tiles start at multiples of bt (>= 8): the scale box is aligned
  const bool split = plan.splits > 1;
  if (split) {
    g.out = part;
    g.out_stride = plan.part_stride;
    g.out_split_stride = t * plan.part_stride;
  } else {
    g.out = p->out;
    g.out_stride = p->out_stride;
    g.vec_store = (reinterpret_cast<uintptr_t>(p->out) & 15) == 0 && p->out_stride % 8 == 0;
  }
  // the bf16 output as TMA stores see it (tma-store, unsplit, 16-byte rows); else unused
  CUtensorMap mo = mw;
  const bool tma_store = plan.path == Path::kTmaStore && !split && g.vec_store;
  if (tma_store) {
    st = encode_tensor_map_2d(&mo, p->out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p->n, t, p->out_stride * 2, 64, 64,
                              CU_TENSOR_MAP_SWIZZLE_128B, "fp8_block_linear: out");
    if (st != DSA_OK) return st;
  }
#define DSA_WS(SWAP, BT, MC, PIPE)                                                      \
  return split ? launch_ws<SWAP, BT, true, MC, PIPE>(g, mw, mx, ms, mo, stream) \
               : launch_ws<SWAP, BT, false, MC, PIPE>(g, mw, mx, ms, mo, stream)
  if (tma_store) {
    return plan.mc == 2 ? launch_ws<false, 128, false, 2, true, true>(g, mw, mx, ms, mo, stream)
                        : launch_ws<false, 128, false, 1, true, true>(g, mw, mx, ms, mo, stream);
  }
  if (plan.path != Path::kTmaSwap) {
    const bool pipe = plan.path == Path::kTmaPipe || plan.path == Path::kTmaStore;
    if (plan.mc == 2) {
      if (pipe) DSA_WS(false, 128, 2, true);
      DSA_WS(false, 128, 2, false);
    }
    if (pipe) DSA_WS(false, 128, 1, true);
    DSA_WS(false, 128, 1, false);
  }
  switch (bt) {
    case 8: DSA_WS(true, 8, 1, false);
    case 16: DSA_WS(true, 16, 1, false);
    case 32: DSA_WS(true, 32, 1, false);
    default: DSA_WS(true, 64, 1, false);
  }
#undef DSA_WS
}

}  // namespace dsa_fp8

using namespace dsa_fp8;

// Any path's plan (DSA_FP8_LINEAR_PATH may force one at launch) for any T' <= num_tokens: the
// quantised rows and scales grow with T, every plan's partials fit partial_budget(T'), which does.
extern "C" size_t dsa_fp8_block_linear_workspace_size(int64_t num_tokens, int n, int k) {
  const LinearPlan p = plan_linear(num_tokens, n, k, Path::kAuto);
  const int64_t t = std::max<int64_t>(num_tokens, 0);
  const size_t budget = t > 0 ? align256(partial_budget(t, (std::max(n, 1) + 3) / 4 * 4)) : 0;
  return p.q_bytes + p.s_bytes + budget;
}

extern "C" const char* dsa_fp8_block_linear_path(int64_t num_tokens, int n, int k) {
  static thread_local char text[64];
  Path forced = Path::kAuto;
  int max_splits = 0;
  if (forced_path(&forced) != DSA_OK) return "invalid DSA_FP8_LINEAR_PATH";
  if (max_splits_env(&max_splits) != DSA_OK) return "invalid DSA_FP8_LINEAR_SPLITS";
  const LinearPlan p = plan_linear(num_tokens, n, k, forced, max_splits);
  const char* name = p.path == Path::kTma        ? "tma"
                     : p.path == Path::kTmaNoMc ? "tma-nomc"
                     : p.path == Path::kTmaPipe ? "tma-pipe"
                     : p.path == Path::kTmaStore ? "tma-store"
                     : p.path == Path::kTmaSwap ? "tma-swap"
                                                : "legacy";
  // tile: weight rows x tokens; "x2": pairs of CTAs share (multicast) the weight tile
  snprintf(text, sizeof(text), "%s 128x%d%s split %d", name, p.bt, p.mc > 1 ? " x2" : "", p.splits);
  return text;
}

extern "C" int dsa_launch_fp8_block_linear(const DsaFp8BlockLinearParams* p, cudaStream_t stream) {
  DSA_CHECK_ARG(p != nullptr, "fp8_block_linear: params is NULL");
  DSA_CHECK_ARG(p->num_tokens >= 0, "fp8_block_linear: num_tokens=%lld must be >= 0", (long long)p->num_tokens);
  DSA_CHECK_ARG(p->n > 0 && p->k > 0, "fp8_block_linear: n=%d and k=%d must be positive", p->n, p->k);
  DSA_CHECK_SUPPORTED(p->k % 16 == 0,
                      "fp8_block_linear: k=%d unsupported: weight rows are copied in 16-byte chunks, so K must be a "
                      "multiple of 16 (pad the weight's K with zero columns)",
                      p->k);
  DSA_CHECK_ARG(p->pow2_act_scales == 0 || p->pow2_act_scales == 1,
                "fp8_block_linear: pow2_act_scales=%d must be 0 or 1", p->pow2_act_scales);
  Path forced = Path::kAuto;
  const int fst = forced_path(&forced);
  if (fst != DSA_OK) return fst;
  int max_splits = 0;
  const int sst = max_splits_env(&max_splits);
  if (sst != DSA_OK) return sst;
  if (p->num_tokens == 0) return DSA_OK;
  DSA_CHECK_ARG(p->x && p->weight && p->weight_scale && p->out && p->workspace,
                "fp8_block_linear: NULL pointer (x=%p weight=%p weight_scale=%p out=%p workspace=%p)", p->x,
                p->weight, p->weight_scale, p->out, p->workspace);
  DSA_CHECK_ARG(p->x_stride >= p->k, "fp8_block_linear: x_stride=%lld < k=%d", (long long)p->x_stride, p->k);
  DSA_CHECK_ARG(p->out_stride >= p->n, "fp8_block_linear: out_stride=%lld < n=%d", (long long)p->out_stride, p->n);
  DSA_CHECK_ARG((reinterpret_cast<uintptr_t>(p->weight) & 15) == 0, "fp8_block_linear: weight=%p not 16-byte aligned",
                p->weight);
  DSA_CHECK_ARG((reinterpret_cast<uintptr_t>(p->workspace) & 15) == 0,
                "fp8_block_linear: workspace=%p not 16-byte aligned", p->workspace);
  DSA_CHECK_ARG((reinterpret_cast<uintptr_t>(p->x) & 1) == 0 && (reinterpret_cast<uintptr_t>(p->out) & 1) == 0,
                "fp8_block_linear: x=%p / out=%p not 2-byte aligned (bf16)", p->x, p->out);

  const LinearPlan plan = plan_linear(p->num_tokens, p->n, p->k, forced, max_splits);
  const bool legacy = plan.path == Path::kLegacy;
  uint8_t* ws = static_cast<uint8_t*>(p->workspace);
  uint8_t* q = ws;
  float* sx = reinterpret_cast<float*>(ws + plan.q_bytes);
  float* part = reinterpret_cast<float*>(ws + plan.q_bytes + plan.s_bytes);

  const int g = aq_groups(p->num_tokens, plan.nkb);
  const int64_t warps = p->num_tokens * dsa_ceil_div(plan.nkb, g);
  (g == 4 ? act_quant_kernel<4> : act_quant_kernel<1>)<<<static_cast<unsigned>(dsa_ceil_div(warps * 32, 256)), 256,
                                                          0, stream>>>(
      static_cast<const uint16_t*>(p->x), p->x_stride, p->num_tokens, p->k, plan.nkb, q, sx,
      legacy ? plan.nkb : 1, legacy ? 1 : plan.t_pad, p->pow2_act_scales,
      (reinterpret_cast<uintptr_t>(p->x) & 7) == 0 && p->x_stride % 4 == 0);
  DSA_CUDA_CHECK_LAUNCH();

  const int st = legacy ? legacy_gemm(p, plan, q, sx, part, stream) : tma_gemm(p, plan, q, sx, part, stream);
  if (st != DSA_OK) return st;
  if (plan.splits > 1) {
    const int64_t total = p->num_tokens * p->n;
    const dim3 grid(static_cast<unsigned>(dsa_ceil_div(total, 256)));
    const float* cpart = part;
    uint16_t* out = static_cast<uint16_t*>(p->out);
    const int64_t split_stride = p->num_tokens * plan.part_stride;
    if (legacy) {
      splitk_reduce_kernel<<<grid, 256, 0, stream>>>(cpart, plan.splits, split_stride, plan.part_stride,
                                                     p->num_tokens, p->n, out, p->out_stride);
      DSA_CUDA_CHECK_LAUNCH();
    } else {
      DSA_CUDA_CHECK(dsa_launch_pdl(splitk_reduce_kernel, grid, dim3(256), 0, stream, cpart, plan.splits,
                                    split_stride, plan.part_stride, p->num_tokens, p->n, out, p->out_stride));
    }
  }
  return DSA_OK;
}
