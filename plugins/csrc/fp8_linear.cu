// DSA-TRT kernels: DsaFp8BlockLinear (dsa_moe_kernels.h), out = bf16(x @ dequant(W)^T) with the
// official W8A8 numerics.
//
// Two or three kernels on the stream, all sizes static (CUDA-graph safe):
//   1. act_quant: one warp per (token, 128-group) -> e4m3 rows + fp32 scales in the workspace.
//   2. the GEMM (fp8_gemm.cuh) over (128-row weight tiles) x (BN-token tiles) x (K splits).
//      Decode (few tokens) is bound by the weight read, and N / 128 tiles alone do not cover the
//      GPU (q_a: 12 tiles), so when the tiles fall short of kTargetCtas the K blocks are split and
//      each split writes fp32 partials;
//   3. splitk_reduce sums the partials in split order (deterministic) -> bf16.
// The plan (BN, splits) depends only on (T, N, K), so the workspace size is known without a device.
#include <algorithm>

#include "fp8_gemm.cuh"

namespace dsa_fp8 {

// ---------------------------------------------------------------- kernels
__global__ void __launch_bounds__(256) act_quant_kernel(const uint16_t* __restrict__ x, int64_t x_stride,
                                                         int64_t num_tokens, int k, int nkb, uint8_t* __restrict__ q,
                                                         float* __restrict__ scale, int pow2, int vec) {
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= num_tokens * nkb) return;  // warp-uniform
  const int64_t t = gw / nkb;
  const int kb = static_cast<int>(gw % nkb);
  const int k0 = kb * kBlock + 4 * lane;
  float v[4];
  load_bf16x4(x + t * x_stride + k0, k - k0, vec != 0, v);
  quant_group_store(v, pow2 != 0, q + t * nkb * kBlock + kb * kBlock, scale + t * nkb + kb, lane);
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

__global__ void __launch_bounds__(256) splitk_reduce_kernel(const float* __restrict__ part, int splits,
                                                             int64_t split_stride, int64_t num_tokens, int n,
                                                             uint16_t* __restrict__ out, int64_t out_stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_tokens * n) return;
  const int64_t t = i / n;
  const int col = static_cast<int>(i % n);
  float s = part[i];
  for (int sp = 1; sp < splits; ++sp) s += part[sp * split_stride + i];
  out[t * out_stride + col] = float_to_bf16_bits(s);
}

// ---------------------------------------------------------------- plan
constexpr int kTargetCtas = 264;  // two waves of 132 SMs at two CTAs per SM
constexpr int kMinBlocksPerSplit = 4;

struct LinearPlan {
  int bn, splits, kb_per_split, nkb;
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

static LinearPlan plan_linear(int64_t t, int n, int k) {
  LinearPlan p{};
  p.nkb = static_cast<int>(dsa_ceil_div(std::max(k, 1), kBlock));
  p.bn = pick_bn(t);
  const int64_t tiles = dsa_ceil_div(std::max(n, 1), kTileM) * dsa_ceil_div(std::max<int64_t>(t, 1), p.bn);
  int splits = 1;
  if (tiles < kTargetCtas)
    splits = static_cast<int>(std::min<int64_t>(dsa_ceil_div(kTargetCtas, tiles), p.nkb / kMinBlocksPerSplit));
  splits = std::max(splits, 1);
  p.kb_per_split = static_cast<int>(dsa_ceil_div(p.nkb, splits));
  p.splits = static_cast<int>(dsa_ceil_div(p.nkb, p.kb_per_split));  // no empty split
  const int64_t tt = std::max<int64_t>(t, 0);
  p.q_bytes = align256(static_cast<size_t>(tt) * p.nkb * kBlock);
  p.s_bytes = align256(static_cast<size_t>(tt) * p.nkb * sizeof(float));
  p.part_bytes = p.splits > 1 ? align256(static_cast<size_t>(p.splits) * tt * std::max(n, 0) * sizeof(float)) : 0;
  return p;
}

template <int BN, bool kF32Out>
static int launch_gemm(const GemmArgs& g, int m_tiles, int splits, cudaStream_t stream) {
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

}  // namespace dsa_fp8

using namespace dsa_fp8;

extern "C" size_t dsa_fp8_block_linear_workspace_size(int64_t num_tokens, int n, int k) {
  const LinearPlan p = plan_linear(num_tokens, n, k);
  return p.q_bytes + p.s_bytes + p.part_bytes;
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

  const LinearPlan plan = plan_linear(p->num_tokens, p->n, p->k);
  uint8_t* ws = static_cast<uint8_t*>(p->workspace);
  uint8_t* q = ws;
  float* sx = reinterpret_cast<float*>(ws + plan.q_bytes);
  float* part = reinterpret_cast<float*>(ws + plan.q_bytes + plan.s_bytes);

  const int64_t warps = p->num_tokens * plan.nkb;
  act_quant_kernel<<<static_cast<unsigned>(dsa_ceil_div(warps * 32, 256)), 256, 0, stream>>>(
      static_cast<const uint16_t*>(p->x), p->x_stride, p->num_tokens, p->k, plan.nkb, q, sx, p->pow2_act_scales,
      (reinterpret_cast<uintptr_t>(p->x) & 7) == 0 && p->x_stride % 4 == 0);
  DSA_CUDA_CHECK_LAUNCH();

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
    g.out_stride = p->n;
    g.out_split_stride = p->num_tokens * p->n;
    g.vec_store = p->n % 4 == 0;
  } else {
    g.out = p->out;
    g.out_stride = p->out_stride;
    g.vec_store = (reinterpret_cast<uintptr_t>(p->out) & 15) == 0 && p->out_stride % 8 == 0;
  }
  const int m_tiles = static_cast<int>(dsa_ceil_div(p->n, kTileM));
  int st = DSA_OK;
#define DSA_LINEAR_BN(BN) \
  st = split ? launch_gemm<BN, true>(g, m_tiles, plan.splits, stream) : launch_gemm<BN, false>(g, m_tiles, 1, stream)
  switch (plan.bn) {
    case 8: DSA_LINEAR_BN(8); break;
    case 16: DSA_LINEAR_BN(16); break;
    case 32: DSA_LINEAR_BN(32); break;
    case 64: DSA_LINEAR_BN(64); break;
    default: DSA_LINEAR_BN(128); break;
  }
#undef DSA_LINEAR_BN
  if (st != DSA_OK) return st;
  if (split) {
    const int64_t total = p->num_tokens * p->n;
    splitk_reduce_kernel<<<static_cast<unsigned>(dsa_ceil_div(total, 256)), 256, 0, stream>>>(
        part, plan.splits, total, p->num_tokens, p->n, static_cast<uint16_t*>(p->out), p->out_stride);
    DSA_CUDA_CHECK_LAUNCH();
  }
  return DSA_OK;
}
