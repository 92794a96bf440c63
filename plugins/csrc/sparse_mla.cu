// DSA-TRT sparse MLA: dsa_launch_sparse_mla (dsa_kernels.h), the one validated entry point.
//
//   out[t,h] = sum_j softmax_j(sm_scale * q[t,h] . kv[slot_j]) * kv[slot_j][0:512]   (slot_j valid)
//
// fp8 pool  -> sparse_mla_fp8.cu: fp8 wgmma kernel (q quantised per head to e4m3, P in e4m3),
//              or, when T is small, sparse_mla_fp8_split.cu: the same kernel over chunks of the
//              top-k list + a combine kernel (split-KV; the rule is choose_splits below).
// bf16 pool -> sparse_mla_bf16.cu: fp32 CUDA-core kernel (exact-comparison mode), never split.
// Slots < 0 and slots >= num_slots are skipped (the pool is never read out of bounds); a row
// with no valid slot gives out = 0 and lse = -inf.
// Head counts: the kernels are instantiated for 16, 32, 64 and 128 heads. Any other count <= 128
// (the tiny test model has 4; a tensor-parallel rank may get 128 / tp) runs here, once, for every
// consumer (torch binding, TensorRT plugin): q is copied into a zero-padded buffer carved from the
// workspace, the kernel writes padded out / lse there, and the real heads are copied back. Heads
// are independent, so the real ones are exact; the copies are async memcpy/memset (graph-safe).
#include <cuda_bf16.h>
#include <math.h>

#include <algorithm>
#include <atomic>

#include "common.cuh"
#include "sparse_mla.cuh"

namespace {

using dsa_sparse_mla::kMaxTopk;
constexpr int kTileKeys = 64;      // the fp8 kernel's key tile: chunks are whole tiles
static_assert(dsa_sparse_mla::kMaxSplits * kTileKeys >= kMaxTopk, "a split launch has at most kMaxSplits chunks");
constexpr int kHeadsPerCta = 64;   // the fp8 kernel's head block (wgmma M)
constexpr int kMaxHeads = 128;     // the largest instantiated head count (padding goes up to it)
constexpr size_t kPartBytesPerRow = DSA_MLA_V_DIM * sizeof(__half) + sizeof(float);  // per (chunk, token, head): out + lse
// One wave of the largest sm_90 part (H100 SXM / H200: 132 SMs, one persistent CTA each). A split
// grid holds at most two waves' items (kMaxSplitCtas): a constant, not the device's count, so that
// the workspace bound (and a TensorRT engine's workspace) does not depend on the device.
constexpr int64_t kWaveCtas = 132;
constexpr int64_t kMaxSplitCtas = 2 * kWaveCtas;
// The auto rule's cost of an item, in 64-key tiles (~2.1 us each at 40 tokens x 128 heads on the
// H200): its fixed part (slots, q, pipeline fill: ~6.3 us) and the combine kernel (~4.6 us at 20
// tokens x 128 heads x 3 chunks).
constexpr int kItemFixedTiles = 3;
constexpr int kCombineTiles = 2;

bool aligned(const void* ptr, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; }

int64_t head_blocks(int num_heads) { return (num_heads + kHeadsPerCta - 1) / kHeadsPerCta; }
int tiles_of(int topk) { return (topk + kTileKeys - 1) / kTileKeys; }

// About `want` chunks of whole tiles, none empty: ceil(tiles / ceil(tiles / want)) <= want.
int whole_tile_chunks(int tiles, int64_t want) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(want, tiles));
  const int64_t per = (tiles + n - 1) / n;
  return static_cast<int>((tiles + per - 1) / per);
}

// The most chunks a launch of num_tokens tokens gets with `ctas_budget` CTAs: all chunks of all
// tokens in one wave, at least two chunks per token, else 1 (unsplit).
int max_splits(int64_t num_tokens, int num_heads, int topk, int64_t ctas_budget) {
  const int64_t ctas = num_tokens * head_blocks(num_heads);
  if (ctas * 2 > ctas_budget) return 1;
  return whole_tile_chunks(tiles_of(topk), ctas_budget / ctas);
}

// The auto chunk count on `sms` SMs: all chunks in one wave, as many as fit (max_splits); where one
// wave cannot hold two chunks per token (T x head blocks > sms / 2: the verify step of one draft,
// 34..44 tokens x 128 heads), the count of at most kMaxSplitCtas items that minimises the busiest
// SM's tiles, ceil(items / sms) x (chunk tiles + kItemFixedTiles), plus kCombineTiles when split.
// At 40 tokens x 128 heads: 3 chunks, 240 items on 132 SMs, 2 x (11 + 3) + 2 = 30 against 35.
int auto_splits(int64_t num_tokens, int num_heads, int topk, int sms) {
  const int64_t wave = std::min<int64_t>(std::max(sms, 1), kWaveCtas);
  const int one_wave = max_splits(num_tokens, num_heads, topk, wave);
  if (one_wave > 1) return one_wave;
  const int64_t ctas = num_tokens * head_blocks(num_heads);
  const int tiles = tiles_of(topk);
  int best = 1;
  int64_t best_cost = (ctas + wave - 1) / wave * (tiles + kItemFixedTiles);
  for (int want = 2; want <= std::min(tiles, dsa_sparse_mla::kMaxSplits); ++want) {
    const int n = whole_tile_chunks(tiles, want);
    if (n != want) continue;  // the same chunks as a smaller count
    if (ctas * n > kMaxSplitCtas) break;
    const int64_t per = (tiles + n - 1) / n;
    const int64_t cost = (ctas * n + wave - 1) / wave * (per + kItemFixedTiles) + kCombineTiles;
    if (cost < best_cost) {
      best_cost = cost;
      best = n;
    }
  }
  return best;
}

bool instantiated_heads(int num_heads) {
  return num_heads == 16 || num_heads == 32 || num_heads == 64 || num_heads == 128;
}

// The head count a launch of num_heads (1..128) runs the kernels with.
int padded_heads(int num_heads) {
  for (int h : {16, 32, 64, 128})
    if (num_heads <= h) return h;
  return num_heads;
}

constexpr size_t kRegionAlign = 256;
size_t align_up(size_t bytes) { return (bytes + kRegionAlign - 1) / kRegionAlign * kRegionAlign; }

// Workspace bytes of the padded q [T, Hp, 576] bf16, out [T, Hp, 512] bf16 and lse [T, Hp] fp32,
// each region 256-byte aligned; the split-KV partials (if any) follow.
size_t padding_bytes(int64_t num_tokens, int num_heads) {
  if (instantiated_heads(num_heads)) return 0;
  const size_t rows = static_cast<size_t>(num_tokens) * static_cast<size_t>(padded_heads(num_heads));
  return align_up(rows * DSA_MLA_DIM * sizeof(__nv_bfloat16)) + align_up(rows * DSA_MLA_V_DIM * sizeof(__nv_bfloat16)) +
         align_up(rows * sizeof(float));
}

size_t split_bytes(int64_t num_tokens, int num_heads, int n_splits) {
  if (n_splits <= 1) return 0;
  return static_cast<size_t>(n_splits) * static_cast<size_t>(num_tokens) * static_cast<size_t>(num_heads) *
         kPartBytesPerRow;
}

// The chunk count of a validated fp8 launch: 1 (unsplit) or >= 2 with a workspace. num_splits:
// 0 = auto (auto_splits on this device's SMs; unsplit without a workspace),
// n >= 1 = about n chunks (an error if that needs a missing workspace or more than kMaxSplitCtas).
int choose_splits(const DsaSparseMlaParams& p, int* n_splits) {
  *n_splits = 1;
  const int64_t ctas = p.num_tokens * head_blocks(p.num_heads);
  if (p.num_splits == 0) {
    if (p.workspace == nullptr) return DSA_OK;
    int sms = 0;
    const int status = dsa_sparse_mla::current_sm_count(&sms);
    if (status != DSA_OK) return status;
    *n_splits = auto_splits(p.num_tokens, p.num_heads, p.topk, sms);
    return DSA_OK;
  }
  *n_splits = whole_tile_chunks(tiles_of(p.topk), p.num_splits);
  if (*n_splits == 1) return DSA_OK;
  DSA_CHECK_ARG(ctas * *n_splits <= kMaxSplitCtas,
                "sparse_mla: num_splits=%d (%d chunks of whole 64-key tiles) x %lld CTAs (num_tokens=%lld, "
                "num_heads=%d) exceeds the split grid limit of %lld CTAs",
                p.num_splits, *n_splits, static_cast<long long>(ctas), static_cast<long long>(p.num_tokens),
                p.num_heads, static_cast<long long>(kMaxSplitCtas));
  DSA_CHECK_ARG(p.workspace != nullptr,
                "sparse_mla: num_splits=%d needs a workspace of dsa_sparse_mla_workspace_size() bytes, got NULL",
                p.num_splits);
  return DSA_OK;
}


// The format dispatch of a launch validated by dsa_launch_sparse_mla, with an instantiated head count.
int launch_validated(const DsaSparseMlaParams& p, cudaStream_t stream) {
  if (p.format == DSA_CACHE_BF16) return dsa_sparse_mla::launch_bf16(p, stream);  // never split

  DSA_CHECK_ARG(isfinite(p.kv_scale) && p.kv_scale > 0.f, "sparse_mla: kv_scale=%g must be finite and > 0",
                p.kv_scale);
  // The fp8 kernel reads q as 8-byte (4 x bf16) vectors, the pool as 16-byte chunks, writes 8-byte out vectors.
  DSA_CHECK_ARG(aligned(p.q, 8) && p.q_stride_token % 4 == 0 && p.q_stride_head % 4 == 0,
                "sparse_mla: q=%p with strides (%lld, %lld) elements must be 8-byte aligned with strides "
                "multiple of 4",
                p.q, static_cast<long long>(p.q_stride_token), static_cast<long long>(p.q_stride_head));
  DSA_CHECK_ARG(aligned(p.pool, 16), "sparse_mla: pool=%p must be 16-byte aligned", p.pool);
  DSA_CHECK_ARG(aligned(p.out, 8), "sparse_mla: out=%p must be 8-byte aligned", p.out);
  DSA_CHECK_ARG(p.num_slots <= INT32_MAX + 1LL, "sparse_mla: num_slots=%lld exceeds the int32 slot range",
                static_cast<long long>(p.num_slots));
  int n_splits = 1;
  const int status = choose_splits(p, &n_splits);
  if (status != DSA_OK) return status;
  if (n_splits == 1) return dsa_sparse_mla::launch_fp8(p, stream);
  // The split kernel writes the fp16 partials as 8-byte vectors (16-byte alignment, what every
  // allocator gives, is the documented contract).
  DSA_CHECK_ARG(aligned(p.workspace, 16), "sparse_mla: workspace=%p must be 16-byte aligned", p.workspace);
  const int tiles = tiles_of(p.topk);
  __half* part_out = static_cast<__half*>(p.workspace);
  const int64_t part_rows = static_cast<int64_t>(n_splits) * p.num_tokens * p.num_heads;
  const dsa_sparse_mla::SplitPlan plan{n_splits, (tiles + n_splits - 1) / n_splits, part_out,
                                       reinterpret_cast<float*>(part_out + part_rows * DSA_MLA_V_DIM)};
  return dsa_sparse_mla::launch_fp8_split(p, plan, stream);
}

// num_heads not instantiated: the kernels run on zero-padded heads in the workspace (file header).
int launch_padded(const DsaSparseMlaParams& p, cudaStream_t stream) {
  const int heads = p.num_heads, padded = padded_heads(p.num_heads);
  DSA_CHECK_ARG(p.workspace != nullptr,
                "sparse_mla: num_heads=%d runs zero-padded to %d heads in the workspace: pass "
                "dsa_sparse_mla_workspace_size() bytes, got NULL",
                heads, padded);
  DSA_CHECK_ARG(aligned(p.workspace, 16), "sparse_mla: workspace=%p must be 16-byte aligned", p.workspace);
  const size_t rows = static_cast<size_t>(p.num_tokens) * static_cast<size_t>(padded);
  const size_t q_row = DSA_MLA_DIM * sizeof(__nv_bfloat16), o_row = DSA_MLA_V_DIM * sizeof(__nv_bfloat16);
  char* q_pad = static_cast<char*>(p.workspace);
  char* out_pad = q_pad + align_up(rows * q_row);
  char* lse_pad = out_pad + align_up(rows * o_row);
  char* rest = lse_pad + align_up(rows * sizeof(float));  // the split-KV partials of the padded launch

  // q: zero the padded buffer, then copy the real heads of every token (2-D copies: tokens are rows;
  // one copy when a token's heads are adjacent, else one per head).
  const size_t src_pitch =
      static_cast<size_t>(p.num_tokens > 1 ? p.q_stride_token : static_cast<int64_t>(heads) * DSA_MLA_DIM) *
      sizeof(__nv_bfloat16);
  const bool heads_adjacent = heads == 1 || p.q_stride_head == DSA_MLA_DIM;
  const size_t width = heads_adjacent ? static_cast<size_t>(heads) * q_row : q_row;
  DSA_CHECK_ARG(src_pitch >= width,
                "sparse_mla: q strides (%lld, %lld) elements overlap tokens; num_heads=%d needs "
                "q_stride_token >= %zu",
                static_cast<long long>(p.q_stride_token), static_cast<long long>(p.q_stride_head), heads,
                width / sizeof(__nv_bfloat16));
  DSA_CUDA_CHECK(cudaMemsetAsync(q_pad, 0, rows * q_row, stream));
  const char* q = static_cast<const char*>(p.q);
  for (int h = 0; h < (heads_adjacent ? 1 : heads); ++h)
    DSA_CUDA_CHECK(cudaMemcpy2DAsync(q_pad + h * q_row, padded * q_row,
                                     q + static_cast<size_t>(h) * p.q_stride_head * sizeof(__nv_bfloat16),
                                     src_pitch, width, static_cast<size_t>(p.num_tokens), cudaMemcpyDeviceToDevice,
                                     stream));

  DsaSparseMlaParams pp = p;
  pp.q = q_pad;
  pp.q_stride_token = static_cast<int64_t>(padded) * DSA_MLA_DIM;
  pp.q_stride_head = DSA_MLA_DIM;
  pp.num_heads = padded;
  pp.out = out_pad;
  pp.lse = reinterpret_cast<float*>(lse_pad);
  pp.workspace = rest;
  const int status = launch_validated(pp, stream);
  if (status != DSA_OK) return status;
  DSA_CUDA_CHECK(cudaMemcpy2DAsync(p.out, heads * o_row, out_pad, padded * o_row, heads * o_row,
                                   static_cast<size_t>(p.num_tokens), cudaMemcpyDeviceToDevice, stream));
  if (p.lse != nullptr)
    DSA_CUDA_CHECK(cudaMemcpy2DAsync(p.lse, heads * sizeof(float), lse_pad, padded * sizeof(float),
                                     heads * sizeof(float), static_cast<size_t>(p.num_tokens),
                                     cudaMemcpyDeviceToDevice, stream));
  return DSA_OK;
}

}  // namespace

// SMs of the current device, queried once per device (launches may happen inside graph capture).
int dsa_sparse_mla::current_sm_count(int* sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];  // 0 = not queried yet
  int dev = 0;
  DSA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kMaxDevices && (*sms = cached[dev].load(std::memory_order_relaxed)) > 0) return DSA_OK;
  DSA_CUDA_CHECK(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev < kMaxDevices) cached[dev].store(*sms, std::memory_order_relaxed);
  return DSA_OK;
}

extern "C" size_t dsa_sparse_mla_workspace_size(int64_t num_tokens, int num_heads, int topk, int format) {
  if (num_tokens <= 0 || num_heads < 1 || num_heads > kMaxHeads || topk < 1 || topk > kMaxTopk) return 0;
  if (format != DSA_CACHE_FP8 && format != DSA_CACHE_BF16) return 0;
  const int heads = padded_heads(num_heads);
  size_t split = 0;
  if (format == DSA_CACHE_FP8) {
    // The bytes needed peak at some T' <= num_tokens (more tokens -> fewer chunks each): take the
    // max over every T' that can split at all (T' * head blocks * 2 <= kMaxSplitCtas) of the most
    // chunks a launch may have (kMaxSplitCtas items: auto_splits and forced counts stay within it).
    const int64_t last = std::min<int64_t>(num_tokens, kMaxSplitCtas);
    for (int64_t t = 1; t <= last; ++t)
      split = std::max(split, split_bytes(t, heads, max_splits(t, heads, topk, kMaxSplitCtas)));
  }
  // A launch of T' <= num_tokens tokens uses padding_bytes(T') + its own split bytes: at most this.
  return padding_bytes(num_tokens, num_heads) + split;
}

extern "C" int dsa_launch_sparse_mla(const DsaSparseMlaParams* p, cudaStream_t stream) {
  DSA_CHECK_ARG(p != nullptr, "sparse_mla: params is NULL");
  DSA_CHECK_ARG(p->num_tokens >= 0, "sparse_mla: num_tokens=%lld < 0", static_cast<long long>(p->num_tokens));
  DSA_CHECK_ARG(p->num_heads >= 1 && p->num_heads <= kMaxHeads,
                "sparse_mla: num_heads=%d unsupported (1..%d; 16, 32, 64, 128 run directly, other counts "
                "zero-padded to the next of them in the workspace)",
                p->num_heads, kMaxHeads);
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
  DSA_CHECK_ARG(p->num_splits >= 0, "sparse_mla: num_splits=%d < 0 (0 = auto, 1 = unsplit)", p->num_splits);
  if (!instantiated_heads(p->num_heads)) return launch_padded(*p, stream);
  return launch_validated(*p, stream);
}
