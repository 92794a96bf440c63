// DSA-TRT kernels: the QGMMA scoring of one 64-key page of the fp8 indexer pool against one or
// a few query tokens (indexer_logits.cu), and the shared-memory / wgmma helpers the fp8 GEMMs
// reuse (fp8_gemm.cuh).
//
// One warpgroup (128 threads) scores a page with 4 x wgmma m64nHk32 e4m3 (QGMMA):
//   A = the page's 64 keys in registers (PageFrag: each thread holds 2 x 32 bytes of its rows
//       r0 = 16 * warp + g and r0 + 8, copied as four 16-byte chunks through a shared-memory
//       ring of kStages pages per warpgroup: PageRing, ring_issue / ring_read), and
//   B = the token's q [H, 128], staged once in shared memory (128-byte swizzle, stage_q),
// so the accumulator holds [64 keys x H heads]: the head reduction is 16 in-thread FMAs per key
// row plus two shuffles. The K dimension is permuted (the dot product does not care): a thread's
// 16-byte loads land in the A-fragment slots directly, and q is written to shared memory under the
// same permutation. relu(x) * w = (x + |x|) * (w / 2): FADD with an |x| operand instead of the
// half-rate FMNMX (DeepGEMM PR #452). indexer_logits.cu also scores a page against two tokens at
// once (mma_page_group / reduce_page_group: B = both tokens' q, N = 2H), with the same per-token
// arithmetic.
//
// The K permutation. wgmma's A fragment (e4m3, k32) gives lane (g = lane/4, c = lane%4) the
// logical k bytes [32s + 16h + 4c, +4) of rows g and g+8 in register a{2h} / a{2h+1} of k-step s.
// A thread instead loads physical bytes [16c, 16c+16) and [16(c+4), 16(c+4)+16) of its rows, so
// logical word (s, h, c) sits at physical byte 16*(c + 4*(s/2)) + 8*(s%2) + 4*h.
#pragma once

#include <stdint.h>

#include "common.cuh"
#include "wgmma.cuh"

namespace dsa_indexer {

constexpr int kWgThreads = 128;                                // one warpgroup
constexpr int kIndexKeyBytes = DSA_PAGE_SIZE * DSA_INDEX_DIM;  // 8192: the page's keys, then 64 scales
constexpr int kQRowBytes = DSA_INDEX_DIM;                      // one head of q: 128 e4m3

using dsa_wgmma::wgmma_commit;
using dsa_wgmma::wgmma_fence;
using dsa_wgmma::wgmma_wait;
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// The first 1024-byte aligned address of a dynamic shared-memory buffer (with 1023 bytes of slack).
// Offsetting the __shared__ pointer itself (not a round trip through uintptr_t) keeps the shared
// address space visible to the compiler: LDS / STS / ATOMS instead of generic accesses.
__device__ __forceinline__ uint8_t* align_smem_1024(uint8_t* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return smem + ((1024u - (addr & 1023u)) & 1023u);
}

// Shared-memory matrix descriptor, K-major operand with the 128-byte swizzle (8 rows x 128 B
// atoms, stride 1024 B between 8-row groups). Base must be 1024-byte aligned.
__device__ __forceinline__ uint64_t make_desc_sw128_u32(uint32_t addr) {
  uint64_t desc = (uint64_t)((addr & 0x3FFFF) >> 4);
  desc |= (uint64_t)(16 >> 4) << 16;    // leading byte offset (unused for swizzled K-major)
  desc |= (uint64_t)(1024 >> 4) << 32;  // stride byte offset: next 8-row group
  desc |= (uint64_t)1 << 62;            // SWIZZLE_128B
  return desc;
}
__device__ __forceinline__ uint64_t make_desc_sw128(const void* smem) {
  return make_desc_sw128_u32(static_cast<uint32_t>(__cvta_generic_to_shared(smem)));
}

// A page's keys for one thread: rows r0 and r0+8, 32 bytes each, plus the scale this lane stores.
struct PageFrag {
  uint4 lo0, hi0, lo1, hi1;  // row r0: bytes [16c,+16), [16c+64,+16); row r0+8: the same
  float scale;
};

// The key row (0..63) whose score score_page() returns in lanes c < 2 and score_page_pair() in
// every lane: r0 for even c, r0 + 8 for odd c.
__device__ __forceinline__ int score_row(int wtid) {
  const int lane = wtid & 31;
  return 16 * (wtid >> 5) + (lane >> 2) + ((lane & 1) ? 8 : 0);
}
__device__ __forceinline__ bool stores_score(int wtid) { return (wtid & 3) < 2; }

// The page ring: each thread cp.async-copies its own 16-byte chunks of a page into one stage and
// later reads back only those (ring_read), so stages need no block barrier; [chunk][thread] keeps
// the LDS conflict-free. A warpgroup keeps kStages - 1 pages in flight. (Loading straight into
// registers instead makes ptxas move each 16-byte vector into the A-operand register tuples, rows
// r0 / r0 + 8 interleaved, right after the load, which waits for it: no prefetch is left.)
// Thread (warp w, lane g * 4 + c) copies bytes [16c, +16) and [16c + 64, +16) of key rows
// r0 = 16w + g and r0 + 8, and the scale of the row it stores (score_row: r0 for even c, r0 + 8
// for odd c).
struct Stage {
  uint4 keys[4][kWgThreads];
  float scale[kWgThreads];
};
constexpr int kStages = 4;
constexpr uint32_t kStageBytes = sizeof(Stage);

// This thread's slots as addresses: its chunk 0 and scale in stage 0 of its warpgroup's ring
// (shared), and its first key chunk and scale in page 0 of the pool (global). A page's copies then
// cost one multiply-add for the page address; the other chunks are immediate offsets.
// policy: the L2 policy of ring_issue<true>'s copies.
struct PageRing {
  uint32_t key_smem, scale_smem;
  const uint8_t* key_g;
  const uint8_t* scale_g;
  uint64_t policy;
};
__device__ __forceinline__ PageRing make_page_ring(Stage* ring, const void* pool, int wtid, uint64_t policy) {
  const int lane = wtid & 31, c = lane & 3, r0 = 16 * (wtid >> 5) + (lane >> 2);
  const uint8_t* g = static_cast<const uint8_t*>(pool);
  return PageRing{static_cast<uint32_t>(__cvta_generic_to_shared(&ring[0].keys[0][wtid])),
                  static_cast<uint32_t>(__cvta_generic_to_shared(&ring[0].scale[wtid])),
                  g + r0 * DSA_INDEX_DIM + 16 * c, g + kIndexKeyBytes + 4 * ((c & 1) ? r0 + 8 : r0), policy};
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The five copies of ring_issue; H: a cache-hint qualifier, P: its policy operand (%10).
#define DSA_RING_COPIES(H, P)                                        \
  "cp.async.cg.shared.global" H ".L2::128B [%0], [%1], 16" P ";\n"   \
  "cp.async.cg.shared.global" H ".L2::128B [%2], [%3], 16" P ";\n"   \
  "cp.async.cg.shared.global" H ".L2::128B [%4], [%5], 16" P ";\n"   \
  "cp.async.cg.shared.global" H ".L2::128B [%6], [%7], 16" P ";\n"   \
  "cp.async.ca.shared.global" H ".L2::128B [%8], [%9], 4" P ";\n"
// This thread's chunks of pool page `page` -> ring stage `stage` (not committed). The .L2::128B
// prefetch-size hint makes each L2 miss fetch the whole 128-byte line, not only the sectors of the
// request (the lanes of a copy cover 64 bytes of each of 8 rows); measured faster on the decode
// shapes than no hint or .L2::256B.
// kPolicy: the copies carry r.policy (decode: kL2EvictFirst, each page is read once); without it
// they take the default priority (token pairs re-read a request's pages for its other pairs).
template <bool kPolicy>
__device__ __forceinline__ void ring_issue(const PageRing& r, int stage, int page) {
  const int64_t off = (int64_t)page * DSA_INDEX_PAGE_BYTES;
  const uint8_t* k = r.key_g + off;
  const uint32_t s = r.key_smem + stage * kStageBytes;
  constexpr uint32_t kChunk = kWgThreads * 16;  // bytes between a thread's chunks in a stage
#define DSA_RING_OPERANDS                                                                              \
  "r"(s), "l"(k), "r"(s + kChunk), "l"(k + 64), "r"(s + 2 * kChunk), "l"(k + 8 * DSA_INDEX_DIM),       \
      "r"(s + 3 * kChunk), "l"(k + 8 * DSA_INDEX_DIM + 64), "r"(r.scale_smem + stage * kStageBytes), \
      "l"(r.scale_g + off), "l"(r.policy)
  if constexpr (kPolicy)
    asm volatile(DSA_RING_COPIES(".L2::cache_hint", ", %10")::DSA_RING_OPERANDS);
  else
    asm volatile(DSA_RING_COPIES("", "")::DSA_RING_OPERANDS);
#undef DSA_RING_OPERANDS
}
#undef DSA_RING_COPIES

// This thread's fragment of the page in ring stage `stage` (after its cp.async group completed).
__device__ __forceinline__ PageFrag ring_read(const PageRing& r, int stage) {
  constexpr uint32_t kChunk = kWgThreads * 16;
  const uint32_t s = r.key_smem + stage * kStageBytes;
  PageFrag f;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(f.lo0.x), "=r"(f.lo0.y), "=r"(f.lo0.z), "=r"(f.lo0.w) : "r"(s));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(f.hi0.x), "=r"(f.hi0.y), "=r"(f.hi0.z), "=r"(f.hi0.w) : "r"(s + kChunk));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(f.lo1.x), "=r"(f.lo1.y), "=r"(f.lo1.z), "=r"(f.lo1.w) : "r"(s + 2 * kChunk));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(f.hi1.x), "=r"(f.hi1.y), "=r"(f.hi1.z), "=r"(f.hi1.w) : "r"(s + 3 * kChunk));
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(f.scale) : "r"(r.scale_smem + stage * kStageBytes));
  return f;
}

// q of one token [H, 128] e4m3 -> shared (H x 128 bytes, 1024-byte aligned), K-permuted, 128-byte
// swizzled rows (row = head), by kThreads threads. All 16-byte loads are issued before any store
// (a load-store loop serialises their latencies per CTA). Physical word wi of chunk ch of
// row h is logical word 8*s + 4*hh + c with c = ch & 3, s = 2*(ch >> 2) + (wi >> 1), hh = wi & 1.
// The caller fences (fence.proxy.async) and synchronises before the first wgmma.
template <int H, int kThreads>
__device__ __forceinline__ void stage_q(uint8_t* sq, const void* q_token, int tid) {
  constexpr int kChunks = H * kQRowBytes / 16;
  constexpr int kPerThread = (kChunks + kThreads - 1) / kThreads;
  constexpr bool kExact = kChunks % kThreads == 0;
  const uint4* qg = static_cast<const uint4*>(q_token);
  uint4 qv[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int u = tid + j * kThreads;
    if (kExact || u < kChunks) qv[j] = qg[u];
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int u = tid + j * kThreads, h = u >> 3, ch = u & 7;
    if (!kExact && u >= kChunks) continue;
    const uint32_t w4[4] = {qv[j].x, qv[j].y, qv[j].z, qv[j].w};
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
      const int lw = 8 * (2 * (ch >> 2) + (wi >> 1)) + 4 * (wi & 1) + (ch & 3), kb = 4 * lw;
      *reinterpret_cast<uint32_t*>(sq + h * kQRowBytes + (((kb >> 4) ^ (h & 7)) << 4) + (kb & 15)) = w4[wi];
    }
  }
}

// Head weights of this lane's accumulator columns 8j + 2c + {0,1}, halved for (x + |x|).
template <int H>
__device__ __forceinline__ void load_head_weights(float (&wr)[H / 8][2], const float* w_token, int wtid) {
  const int c = wtid & 3;
#pragma unroll
  for (int j = 0; j < H / 8; ++j) {
    wr[j][0] = 0.5f * w_token[8 * j + 2 * c];
    wr[j][1] = 0.5f * w_token[8 * j + 2 * c + 1];
  }
}

// The 4 k32 wgmmas of one page (its 128-element K row in the fragment f) against N = TT*H query
// columns, fenced and committed (no wait); TT = 1: score_page's, TT >= 2: the token groups' below.
template <int H, int TT>
__device__ __forceinline__ void mma_page_group(float (&d)[TT * H / 2], const PageFrag& f, uint64_t desc) {
#pragma unroll
  for (int j = 0; j < TT * H / 2; ++j) fence_operand(d[j]);
  wgmma_fence();
  dsa_wgmma::RS<TT * H>::run(d, f.lo0.x, f.lo1.x, f.lo0.y, f.lo1.y, desc + 0, 0);
  dsa_wgmma::RS<TT * H>::run(d, f.lo0.z, f.lo1.z, f.lo0.w, f.lo1.w, desc + 2, 1);
  dsa_wgmma::RS<TT * H>::run(d, f.hi0.x, f.hi1.x, f.hi0.y, f.hi1.y, desc + 4, 1);
  dsa_wgmma::RS<TT * H>::run(d, f.hi0.z, f.hi1.z, f.hi0.w, f.hi1.w, desc + 6, 1);
  wgmma_commit();
}

// Scores of one page: returns, in lanes c < 2, sum_h w[h] * relu(q[h] . k[row]) * k_scale[row] for
// row = score_row(wtid) (other lanes: a partial sum, unused). All 128 threads of the warpgroup
// call it together (wgmma is warpgroup-wide). `d` is scratch the caller keeps across pages (no
// reinitialisation: the first wgmma overwrites it).
template <int H>
__device__ __forceinline__ float score_page(float (&d)[H / 2], const PageFrag& f, uint64_t desc,
                                            const float (&wr)[H / 8][2], int wtid) {
  mma_page_group<H, 1>(d, f, desc);
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < H / 2; ++j) fence_operand(d[j]);

  float s0 = 0.f, s1 = 0.f;  // rows r0 and r0 + 8, this lane's 2*H/8 heads
#pragma unroll
  for (int j = 0; j < H / 8; ++j) {
    s0 = fmaf(wr[j][0], d[4 * j + 0] + fabsf(d[4 * j + 0]), s0);
    s0 = fmaf(wr[j][1], d[4 * j + 1] + fabsf(d[4 * j + 1]), s0);
    s1 = fmaf(wr[j][0], d[4 * j + 2] + fabsf(d[4 * j + 2]), s1);
    s1 = fmaf(wr[j][1], d[4 * j + 3] + fabsf(d[4 * j + 3]), s1);
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  return ((wtid & 3) == 0 ? s0 : s1) * f.scale;
}

// Scores of one page against TT = 2 (or more, N = TT*H <= 256) query tokens at once (q of token u
// in shared memory rows [u*H, u*H + H); B = TT*H columns), so the page is read once for all of
// them. In two steps:
// mma_page_group issues and commits the 4 wgmmas, and after wgmma_wait<0>, reduce_page_group gives
// lane c of each quad the scores of tokens (c >> 1) * TT/2 + v, v < TT/2, for key row
// r0 + 8 * (c & 1) (score_row). Per token, the in-thread sum and the quad reduction
// ((c0 + c1) + (c2 + c3)) are those of score_page, so a score is bitwise the same as one token's
// score_page when the tensor core's accumulation of an output element does not depend on N (the
// tests check it). The first shuffle round exchanges rows (TT shuffles), the second tokens
// (TT / 2): 3 shuffles for two tokens instead of 4 per token.
template <int H, int TT>
__device__ __forceinline__ void reduce_page_group(float (&d)[TT * H / 2], float scale,
                                                  const float (&wr)[TT][H / 8][2], int wtid,
                                                  float (&out)[TT / 2]) {
#pragma unroll
  for (int j = 0; j < TT * H / 2; ++j) fence_operand(d[j]);
  float s[TT][2];  // [token][row r0, r0 + 8]
#pragma unroll
  for (int u = 0; u < TT; ++u) {
    s[u][0] = 0.f;
    s[u][1] = 0.f;
#pragma unroll
    for (int j = 0; j < H / 8; ++j) {
      const int jj = u * (H / 8) + j;
      s[u][0] = fmaf(wr[u][j][0], d[4 * jj + 0] + fabsf(d[4 * jj + 0]), s[u][0]);
      s[u][0] = fmaf(wr[u][j][1], d[4 * jj + 1] + fabsf(d[4 * jj + 1]), s[u][0]);
      s[u][1] = fmaf(wr[u][j][0], d[4 * jj + 2] + fabsf(d[4 * jj + 2]), s[u][1]);
      s[u][1] = fmaf(wr[u][j][1], d[4 * jj + 3] + fabsf(d[4 * jj + 3]), s[u][1]);
    }
  }
  const bool odd_row = wtid & 1, upper = wtid & 2;
  float k[TT];
#pragma unroll
  for (int u = 0; u < TT; ++u) {  // keep this lane's row, send the other
    k[u] = odd_row ? s[u][1] : s[u][0];
    k[u] += __shfl_xor_sync(0xffffffffu, odd_row ? s[u][0] : s[u][1], 1);
  }
#pragma unroll
  for (int v = 0; v < TT / 2; ++v) {  // keep this lane's half of the tokens, send the other
    const float keep = upper ? k[TT / 2 + v] : k[v], send = upper ? k[v] : k[TT / 2 + v];
    out[v] = (keep + __shfl_xor_sync(0xffffffffu, send, 2)) * scale;
  }
}

}  // namespace dsa_indexer
