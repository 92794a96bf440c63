// DSA-TRT kernel library: the plain C launch API of the DSA operators (docs/architecture.md §4).
//
// Device code knows nothing of torch or TensorRT. Each operator has one params struct of raw
// pointers, sizes and strides, and one launcher `dsa_launch_<op>(const Params*, cudaStream_t)`.
// The torch ops (plugins/cuda_ops.py, through ctypes), the TensorRT IPluginV3 wrappers
// (plugins/tensorrt/) and the benchmarks all call these launchers.
//
// Conventions:
//   * Every launcher returns 0 on success or a negative DSA_ERR_* code; dsa_last_error_message()
//     then names the bad value (e.g. "indexer_logits: num_heads=48 unsupported (64, 32)").
//   * Launchers only enqueue work on `stream` (no allocation, no sync): CUDA-graph safe.
//   * Pools: page size 64 tokens; a slot is page * 64 + offset; slot -1 means "skip".
//   * fp8 is OCP e4m3fn (max 448).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DSA_PAGE_SIZE 64
#define DSA_MLA_DIM 576        // kv_lora_rank 512 + rope 64
#define DSA_MLA_V_DIM 512
#define DSA_INDEX_DIM 128
#define DSA_INDEX_ROW_BYTES 132  // 128 fp8 + 1 fp32 scale per token
#define DSA_INDEX_PAGE_BYTES (DSA_PAGE_SIZE * DSA_INDEX_ROW_BYTES)  // 64x128 keys, then 64 scales

enum DsaStatus {
  DSA_OK = 0,
  DSA_ERR_INVALID_ARG = -1,
  DSA_ERR_UNSUPPORTED = -2,
  DSA_ERR_CUDA = -3,
};

// Cache element formats of the pools.
enum DsaCacheFormat {
  DSA_CACHE_FP8 = 0,   // MLA: 576 B/token e4m3 with a per-layer scale; indexer: 132 B/token
  DSA_CACHE_BF16 = 1,  // MLA: 1152 B/token bf16; indexer: 256 B/token bf16 keys (exact mode)
};

// ---------------------------------------------------------------- DsaMlaCacheWrite
typedef struct {
  const void* kv_latent;       // [T, 512] bf16, row stride kv_latent_stride (elements)
  const void* k_pe;            // [T, 64] bf16, row stride k_pe_stride (elements)
  const int64_t* slot_mapping; // [T]; -1 = skip
  void* pool;                  // [num_pages, 64, 576] uint8 (fp8) or bf16
  int64_t num_tokens;          // T
  int64_t kv_latent_stride;
  int64_t k_pe_stride;
  int64_t num_slots;           // num_pages * 64 (bounds check of slot ids)
  float kv_scale;              // fp8 only: stored = e4m3(x / kv_scale)
  int format;                  // DsaCacheFormat
} DsaMlaCacheWriteParams;

int dsa_launch_mla_cache_write(const DsaMlaCacheWriteParams* p, cudaStream_t stream);

// ---------------------------------------------------------------- DsaIndexerKCacheWrite
typedef struct {
  const void* index_k;          // [T, 128] bf16 (normed, roped, Hadamard-rotated), row stride
  const int64_t* slot_mapping;  // [T]; -1 = skip
  void* pool;                   // fp8: [num_pages, 64*132] uint8; bf16: [num_pages, 64, 128] bf16
  int64_t num_tokens;
  int64_t index_k_stride;
  int64_t num_slots;
  int format;                   // DsaCacheFormat; fp8 scale = 2^ceil(log2(amax/448)), amax >= 1e-4
} DsaIndexerKCacheWriteParams;

int dsa_launch_indexer_k_cache_write(const DsaIndexerKCacheWriteParams* p, cudaStream_t stream);

// ---------------------------------------------------------------- DsaIndexerLogits (paged)
// logits[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]) * k_scale[s]   for s in [0, seq_len[t])
//              = -inf                                                for s >= seq_len[t]
// k[s] lives at slot page_table[req_idx[t], s / 64] * 64 + s % 64 of the indexer pool.
typedef struct {
  const void* q;              // fp8: [T, heads, 128] e4m3 (scales folded into w); bf16 mode: bf16
  const float* weights;       // [T, heads] fp32
  const void* pool;           // indexer pool (format as above)
  const int32_t* page_table;  // [batch, max_pages]
  const int32_t* req_idx;     // [T] row of page_table for each query token
  const int32_t* seq_lens;    // [T] number of visible keys of each query token
  float* logits;              // [T, logits_stride] fp32, columns [0, max_pages*64) written
  int64_t num_tokens;         // T
  int num_heads;              // 64 (V3.2) or 32 (GLM-5)
  int max_pages;
  int64_t logits_stride;
  int format;
  int num_requests;           // rows of page_table (0 = unknown). Only a hint: with more tokens
                              // than requests (prefill, multi-token decode) the fp8 kernel scores
                              // two consecutive tokens per CTA, sharing their pages.
} DsaIndexerLogitsParams;

int dsa_launch_indexer_logits(const DsaIndexerLogitsParams* p, cudaStream_t stream);

// ---------------------------------------------------------------- DsaTopkTranslate
// For each row r: the top-k positions p of logits[r, 0:lengths[r]] (any order), translated to
// slots[r, j] = page_table[req_idx[r], p / 64] * 64 + p % 64; -1 in the j >= lengths[r] tail.
typedef struct {
  const float* logits;        // [rows, logits_stride] fp32
  const int32_t* lengths;     // [rows]
  const int32_t* page_table;  // [batch, max_pages]
  const int32_t* req_idx;     // [rows]
  int32_t* slots;             // [rows, k] out
  int32_t* indices;           // [rows, k] out, raw positions (may be NULL)
  int64_t rows;
  int64_t logits_stride;
  int k;                      // 1..2048
  int max_pages;
  void* workspace;            // dsa_topk_translate_workspace_size() bytes (may be NULL if 0)
} DsaTopkTranslateParams;

size_t dsa_topk_translate_workspace_size(int64_t rows, int64_t max_len, int k);
int dsa_launch_topk_translate(const DsaTopkTranslateParams* p, cudaStream_t stream);

// ---------------------------------------------------------------- DsaSparseMla
// out[t,h] = sum_j softmax_j(sm_scale * q[t,h] . kv[slot_j]) * kv[slot_j][0:512]   (slot_j != -1)
// kv = dequant(pool[slot]) = e4m3 * kv_scale (fp8) or bf16. lse in natural log; rows with no
// valid slot give out = 0 and lse = -inf.
//
// Split-KV (fp8 only, small T): when T * ceil(H / 64) CTAs leave most SMs idle, each token's
// top-k list is cut into chunks of whole 64-key tiles, one CTA per (token, head block, chunk)
// writes a partial out (fp16) + lse into `workspace`, and a combine kernel merges them.
// num_splits = 0 picks the chunk count from T, H and the SM count (at most one wave, 132 CTAs);
// 1 never splits; n > 1 asks for about n chunks (ceil(tiles / ceil(tiles / n)), whole tiles) and
// fails if that needs more than 132 CTAs or workspace is NULL. With num_splits = 0 and workspace
// NULL the launcher runs unsplit. The bf16 pool (exact mode) never splits and ignores both.
//
// Heads: the kernels are instantiated for 16, 32, 64 and 128 heads. Any other num_heads <= 128
// runs zero-padded to the next of them inside the launcher (q copied into the workspace, the real
// heads of out / lse copied back): it then needs the workspace, of either format.
typedef struct {
  const void* q;               // [T, heads, 576] bf16 (absorbed: [q_lat; q_pe])
  const void* pool;            // [num_pages, 64, 576] uint8 (fp8) or bf16
  const int32_t* slots;        // [T, topk]
  void* out;                   // [T, heads, 512] bf16
  float* lse;                  // [T, heads] fp32 (may be NULL)
  int64_t num_tokens;
  int num_heads;               // 1..128 (16, 32, 64, 128 direct; others padded, see above)
  int topk;
  int64_t q_stride_token;      // elements
  int64_t q_stride_head;
  int64_t num_slots;
  float kv_scale;
  float sm_scale;
  int format;
  int num_splits;              // 0 = auto, 1 = unsplit, n = about n chunks (see above)
  void* workspace;             // dsa_sparse_mla_workspace_size() bytes, 16-byte aligned (may be NULL)
} DsaSparseMlaParams;

// Bytes of workspace any launch with at most num_tokens tokens (same heads, topk, format) may
// use: size it for the largest T of a TensorRT profile. Independent of the device; 0 for bf16
// with an instantiated head count.
size_t dsa_sparse_mla_workspace_size(int64_t num_tokens, int num_heads, int topk, int format);
int dsa_launch_sparse_mla(const DsaSparseMlaParams* p, cudaStream_t stream);

// Human-readable description of the last DSA_ERR_* returned on this thread.
const char* dsa_last_error_message(void);

#ifdef __cplusplus
}
#endif

// The real-size linear operators (fp8 block linear, routed MoE experts).
#include "dsa_moe_kernels.h"
