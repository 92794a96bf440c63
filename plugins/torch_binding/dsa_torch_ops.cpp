// DSA-TRT torch binding: the CUDA kernels of torch.ops.dsa.* registered from C++ (build/libdsa_torch_ops.so).
//
// The schemas are defined elsewhere, once per process: by plugins/ops.py in a Python process, by
// dsa_schemas.cpp (linked only into runtime/cpp/dsa_step) in a process without Python. This file
// only registers implementations (TORCH_LIBRARY_IMPL(dsa, CUDA, m)), so it loads into both.
// A compiled engine's op calls go dispatcher -> these functions -> the launchers of
// plugins/csrc/dsa_kernels.h on the current CUDA stream of torch: no Python in the loop.
//
// Validation happens here once, for what only the binding knows (dtype, device, rank, shapes of
// tensors against each other, contiguity, int32 narrowing); the launchers check sizes and ranges
// (DSA_CHECK_ARG / DSA_CHECK_SUPPORTED) and their dsa_last_error_message() is raised as is:
// DSA_ERR_INVALID_ARG -> ValueError, DSA_ERR_UNSUPPORTED -> NotImplementedError (a RuntimeError),
// DSA_ERR_CUDA -> RuntimeError. Combinations no kernel implements (fp32 pools, non-bf16
// activations) raise NotImplementedError naming DSA_KERNELS=reference.
//
// The lab namespace dsa_lab holds the entry points tests and benchmarks need beyond the engine's
// ops (caller-owned outputs, forced kernel paths, workspace sizes, the raw launcher);
// plugins/cuda_ops.py wraps them with its Python signatures. Its schemas live here: no engine
// calls them.
//
// Adding an operator dsa::foo: (1) plugins/ops.py (or a sibling module) define_op(OpDef("foo",
// "(...) -> ...", reference, fake)); (2) the same schema line in dsa_schemas.cpp; (3) a C++ function
// below with the schema's C++ types (Tensor -> const at::Tensor&, Tensor(a!) -> at::Tensor&,
// Tensor? -> const std::optional<at::Tensor>&, int/SymInt -> int64_t, float -> double, str ->
// std::string) and its m.impl("foo", &foo) in TORCH_LIBRARY_IMPL(dsa, CUDA, m); bump kAbiVersion and
// plugins/cuda_ops.py ABI_VERSION when a schema or the lab namespace changes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "message.h"
#include "../csrc/dsa_kernels.h"

namespace {

// Kept equal to plugins/cuda_ops.py ABI_VERSION: load() refuses a library of another version (stale build).
constexpr int64_t kAbiVersion = 3;
constexpr int64_t kAny = -1;  // a dimension check_tensor does not constrain
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// torch's Python names, so that a message reads as the user's code does ("torch.int64").
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string dims(at::IntArrayRef d) { return dsa_msg::cat(d); }

enum class Layout { kInnerContiguous, kContiguous };

// dtype / device / rank / shape / layout of one tensor argument; messages name the argument.
void check_tensor(const char* op, const char* name, const at::Tensor& t, std::initializer_list<at::ScalarType> dtypes,
                  const at::Device& device, std::initializer_list<int64_t> shape,
                  Layout layout = Layout::kInnerContiguous) {
  DSA_CHECK_VALUE(t.defined(), "dsa::", op, ": ", name, " is an undefined tensor");
  DSA_CHECK_VALUE(t.device() == device, "dsa::", op, ": ", name, " on ", t.device(), ", expected ", device);
  bool dtype_ok = false;
  std::string allowed;
  for (at::ScalarType d : dtypes) {
    dtype_ok = dtype_ok || t.scalar_type() == d;
    allowed += (allowed.empty() ? "" : ", ") + dtype_name(d);
  }
  DSA_CHECK_VALUE(dtype_ok, "dsa::", op, ": ", name, " dtype ", dtype_name(t.scalar_type()), " not in (", allowed,
                    dtypes.size() == 1 ? ",)" : ")");
  DSA_CHECK_VALUE(t.dim() == static_cast<int64_t>(shape.size()), "dsa::", op, ": ", name, " must be ",
                    shape.size(), "-D, got shape ", dims(t.sizes()));
  int64_t i = 0;
  for (int64_t want : shape) {
    DSA_CHECK_VALUE(want == kAny || t.size(i) == want, "dsa::", op, ": ", name, " shape ", dims(t.sizes()),
                      ": dim ", i, " must be ", want);
    ++i;
  }
  if (layout == Layout::kContiguous) {
    DSA_CHECK_VALUE(t.is_contiguous(), "dsa::", op, ": ", name, " must be contiguous (shape ", dims(t.sizes()),
                      ", strides ", dims(t.strides()), ")");
  } else {
    DSA_CHECK_VALUE(t.numel() == 0 || t.stride(-1) == 1, "dsa::", op, ": ", name, " innermost stride ",
                      t.stride(-1), " must be 1");
  }
}

void check_optional(const char* op, const char* name, const std::optional<at::Tensor>& t,
                    std::initializer_list<at::ScalarType> dtypes, const at::Device& device,
                    std::initializer_list<int64_t> shape) {
  if (t.has_value()) check_tensor(op, name, *t, dtypes, device, shape, Layout::kContiguous);
}

int to_int(const char* op, const char* name, int64_t v) {
  DSA_CHECK_VALUE(v >= 0 && v <= kInt32Max, "dsa::", op, ": ", name, "=", v, " out of the int32 range");
  return static_cast<int>(v);
}

// Row stride in elements; a single row's stride is meaningless to torch (any value), so use its width.
int64_t row_stride(const at::Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(-1); }

// A launcher's status as the matching Python exception, carrying dsa_last_error_message().
void check_status(int status) {
  if (status == DSA_OK) return;
  const char* msg = dsa_last_error_message();
  DSA_CHECK_VALUE(status != DSA_ERR_INVALID_ARG, "dsa::", msg);
  DSA_CHECK_NOT_IMPLEMENTED(status != DSA_ERR_UNSUPPORTED, "dsa::", msg);
  DSA_CHECK(false, "dsa::", msg, " (kernel library status ", status, ")");
}

[[noreturn]] void no_kernel(const char* op, const std::string& what) {
  DSA_CHECK_NOT_IMPLEMENTED(false, "dsa::", op, ": ", what,
                              " has no CUDA kernel (fp8 uint8 or bf16 pools with bf16 activations are served). "
                              "Run this mode on the CPU, or set DSA_KERNELS=reference for the plain-torch "
                              "reference on the GPU");
}

// DsaCacheFormat of an MLA / indexer pool; other dtypes have no kernel.
int pool_format(const char* op, const at::Tensor& pool) {
  if (pool.scalar_type() == at::kByte) return DSA_CACHE_FP8;
  if (pool.scalar_type() == at::kBFloat16) return DSA_CACHE_BF16;
  no_kernel(op, "pool dtype " + dtype_name(pool.scalar_type()));
}

// at::cuda::getCurrentCUDAStream is this function; c10's header spares the cuBLAS headers of ATen/cuda.
cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

at::Tensor workspace(const at::Tensor& like, size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

void* ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// ---------------------------------------------------------------- cache writes
void mla_cache_write(const at::Tensor& kv_latent, const at::Tensor& k_pe, const at::Tensor& slot_mapping,
                     at::Tensor& pool, double kv_scale) {
  const char* op = "mla_cache_write";
  const int fmt = pool_format(op, pool);
  const at::Device dev = pool.device();
  check_tensor(op, "pool", pool, {pool.scalar_type()}, dev, {kAny, DSA_PAGE_SIZE, DSA_MLA_DIM}, Layout::kContiguous);
  check_tensor(op, "kv_latent", kv_latent, {at::kBFloat16}, dev, {kAny, DSA_MLA_V_DIM});
  const int64_t num_tokens = kv_latent.size(0);
  check_tensor(op, "k_pe", k_pe, {at::kBFloat16}, dev, {num_tokens, DSA_MLA_DIM - DSA_MLA_V_DIM});
  check_tensor(op, "slot_mapping", slot_mapping, {at::kLong}, dev, {num_tokens}, Layout::kContiguous);
  if (num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  const DsaMlaCacheWriteParams p{kv_latent.data_ptr(), k_pe.data_ptr(), slot_mapping.data_ptr<int64_t>(),
                                 pool.data_ptr(),      num_tokens,      row_stride(kv_latent),
                                 row_stride(k_pe),     pool.size(0) * DSA_PAGE_SIZE, static_cast<float>(kv_scale),
                                 fmt};
  check_status(dsa_launch_mla_cache_write(&p, stream_of(pool)));
}

void check_index_pool(const char* op, int fmt, const at::Tensor& pool) {
  if (fmt == DSA_CACHE_FP8) {
    check_tensor(op, "pool", pool, {at::kByte}, pool.device(), {kAny, DSA_INDEX_PAGE_BYTES}, Layout::kContiguous);
    return;
  }
  check_tensor(op, "pool", pool, {at::kBFloat16}, pool.device(), {kAny, DSA_PAGE_SIZE, DSA_INDEX_DIM},
                 Layout::kContiguous);
}

void indexer_k_cache_write(const at::Tensor& index_k, const at::Tensor& slot_mapping, at::Tensor& pool) {
  const char* op = "indexer_k_cache_write";
  const int fmt = pool_format(op, pool);
  const at::Device dev = pool.device();
  check_index_pool(op, fmt, pool);
  check_tensor(op, "index_k", index_k, {at::kBFloat16}, dev, {kAny, DSA_INDEX_DIM});
  const int64_t num_tokens = index_k.size(0);
  check_tensor(op, "slot_mapping", slot_mapping, {at::kLong}, dev, {num_tokens}, Layout::kContiguous);
  if (num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  const DsaIndexerKCacheWriteParams p{index_k.data_ptr(),   slot_mapping.data_ptr<int64_t>(),
                                      pool.data_ptr(),      num_tokens,
                                      row_stride(index_k),  pool.size(0) * DSA_PAGE_SIZE,
                                      fmt};
  check_status(dsa_launch_indexer_k_cache_write(&p, stream_of(pool)));
}

// ---------------------------------------------------------------- indexer
struct IndexerShape {
  int format;
  int64_t num_tokens;
  int num_heads;
  int max_pages;
};

// The paged indexer inputs of indexer_logits.
IndexerShape check_indexer_inputs(const char* op, const at::Tensor& q, const at::Tensor& weights,
                                  const at::Tensor& pool, const at::Tensor& page_table, const at::Tensor& req_idx,
                                  const at::Tensor& seq_lens) {
  const int fmt = pool_format(op, pool);
  const at::Device dev = pool.device();
  check_index_pool(op, fmt, pool);
  const at::ScalarType q_dtype = fmt == DSA_CACHE_FP8 ? at::kFloat8_e4m3fn : at::kBFloat16;
  if (q.defined() && q.device() == dev && q.scalar_type() != q_dtype)
    no_kernel(op, "q dtype " + dtype_name(q.scalar_type()) + " with a " + dtype_name(pool.scalar_type()) +
                      " pool (the kernels take " + dtype_name(q_dtype) + ")");
  check_tensor(op, "q", q, {q_dtype}, dev, {kAny, kAny, DSA_INDEX_DIM}, Layout::kContiguous);
  const int64_t num_tokens = q.size(0);
  check_tensor(op, "weights", weights, {at::kFloat}, dev, {num_tokens, q.size(1)}, Layout::kContiguous);
  check_tensor(op, "page_table", page_table, {at::kInt}, dev, {kAny, kAny}, Layout::kContiguous);
  check_tensor(op, "req_idx", req_idx, {at::kInt}, dev, {num_tokens}, Layout::kContiguous);
  check_tensor(op, "seq_lens", seq_lens, {at::kInt}, dev, {num_tokens}, Layout::kContiguous);
  return {fmt, num_tokens, to_int(op, "num_heads", q.size(1)), to_int(op, "max_pages", page_table.size(1))};
}

void indexer_logits_into(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& pool,
                         const at::Tensor& page_table, const at::Tensor& req_idx, const at::Tensor& seq_lens,
                         at::Tensor& out) {
  const char* op = "indexer_logits";
  const IndexerShape s = check_indexer_inputs(op, q, weights, pool, page_table, req_idx, seq_lens);
  check_tensor(op, "out", out, {at::kFloat}, pool.device(), {s.num_tokens, kAny});
  const int64_t width = static_cast<int64_t>(s.max_pages) * DSA_PAGE_SIZE;
  DSA_CHECK_VALUE(out.size(1) >= width, "dsa::", op, ": out width ", out.size(1), " < max_pages*64=", width);
  if (s.num_tokens == 0 || s.max_pages == 0) return;
  const c10::cuda::CUDAGuard guard(pool.device());
  const DsaIndexerLogitsParams p{q.data_ptr(),
                                 weights.data_ptr<float>(),
                                 pool.data_ptr(),
                                 page_table.data_ptr<int32_t>(),
                                 req_idx.data_ptr<int32_t>(),
                                 seq_lens.data_ptr<int32_t>(),
                                 out.data_ptr<float>(),
                                 s.num_tokens,
                                 s.num_heads,
                                 s.max_pages,
                                 row_stride(out),
                                 s.format,
                                 to_int(op, "num_requests", page_table.size(0))};
  check_status(dsa_launch_indexer_logits(&p, stream_of(pool)));
}

at::Tensor indexer_logits(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& pool,
                          const at::Tensor& page_table, const at::Tensor& req_idx, const at::Tensor& seq_lens) {
  DSA_CHECK_VALUE(q.dim() >= 1 && page_table.dim() == 2, "dsa::indexer_logits: q must be 3-D and page_table 2-D, got ",
                    dims(q.sizes()), " and ", dims(page_table.sizes()));
  at::Tensor out = at::empty({q.size(0), page_table.size(1) * DSA_PAGE_SIZE}, pool.options().dtype(at::kFloat));
  indexer_logits_into(q, weights, pool, page_table, req_idx, seq_lens, out);
  return out;
}

// ---------------------------------------------------------------- top-k + translation
void topk_translate_into(const at::Tensor& logits, const at::Tensor& lengths, const at::Tensor& page_table,
                         const at::Tensor& req_idx, int64_t k, at::Tensor& slots,
                         const std::optional<at::Tensor>& indices) {
  const char* op = "topk_translate";
  const at::Device dev = logits.device();
  DSA_CHECK_VALUE(k >= 1 && k <= kInt32Max, "dsa::", op, ": k=", k, " must be an int in [1, 2^31)");
  check_tensor(op, "logits", logits, {at::kFloat}, dev, {kAny, kAny});
  const int64_t rows = logits.size(0);
  check_tensor(op, "lengths", lengths, {at::kInt}, dev, {rows}, Layout::kContiguous);
  check_tensor(op, "page_table", page_table, {at::kInt}, dev, {kAny, kAny}, Layout::kContiguous);
  check_tensor(op, "req_idx", req_idx, {at::kInt}, dev, {rows}, Layout::kContiguous);
  check_tensor(op, "slots", slots, {at::kInt}, dev, {rows, k}, Layout::kContiguous);
  check_optional(op, "indices", indices, {at::kInt}, dev, {rows, k});
  to_int(op, "logits width", logits.size(1));
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  const size_t ws_bytes = dsa_topk_translate_workspace_size(rows, logits.size(1), static_cast<int>(k));
  const std::optional<at::Tensor> ws = ws_bytes ? std::optional<at::Tensor>(workspace(logits, ws_bytes)) : std::nullopt;
  const DsaTopkTranslateParams p{logits.data_ptr<float>(),
                                 lengths.data_ptr<int32_t>(),
                                 page_table.data_ptr<int32_t>(),
                                 req_idx.data_ptr<int32_t>(),
                                 slots.data_ptr<int32_t>(),
                                 static_cast<int32_t*>(ptr(indices)),
                                 rows,
                                 row_stride(logits),
                                 static_cast<int>(k),
                                 to_int(op, "max_pages", page_table.size(1)),
                                 ptr(ws)};
  check_status(dsa_launch_topk_translate(&p, stream_of(logits)));
}

at::Tensor topk_translate(const at::Tensor& logits, const at::Tensor& lengths, const at::Tensor& page_table,
                          const at::Tensor& req_idx, int64_t k) {
  DSA_CHECK_VALUE(logits.dim() == 2, "dsa::topk_translate: logits must be 2-D, got shape ", dims(logits.sizes()));
  DSA_CHECK_VALUE(k >= 1 && k <= kInt32Max, "dsa::topk_translate: k=", k, " must be an int in [1, 2^31)");
  at::Tensor slots = at::empty({logits.size(0), k}, logits.options().dtype(at::kInt));
  topk_translate_into(logits, lengths, page_table, req_idx, k, slots, std::nullopt);
  return slots;
}

// ---------------------------------------------------------------- sparse MLA
// DSA_MLA_SPLITS: the engine op's split-KV chunk count (0 = auto, 1 = unsplit, n = about n chunks).
int64_t env_mla_splits() {
  const char* raw = std::getenv("DSA_MLA_SPLITS");
  if (raw == nullptr || *raw == '\0') return 0;
  char* end = nullptr;
  const long long v = std::strtoll(raw, &end, 10);
  DSA_CHECK_VALUE(end != raw && *end == '\0' && v >= 0 && v <= kInt32Max, "dsa::sparse_mla: DSA_MLA_SPLITS='", raw,
                    "' is not an integer >= 0 (0 = auto, 1 = unsplit, n = n chunks)");
  return v;
}

std::tuple<at::Tensor, at::Tensor> sparse_mla_splits(const at::Tensor& q, const at::Tensor& pool,
                                                     const at::Tensor& slots, double kv_scale, double sm_scale,
                                                     int64_t num_splits) {
  const char* op = "sparse_mla";
  const int fmt = pool_format(op, pool);
  const at::Device dev = pool.device();
  check_tensor(op, "pool", pool, {pool.scalar_type()}, dev, {kAny, DSA_PAGE_SIZE, DSA_MLA_DIM}, Layout::kContiguous);
  if (q.defined() && q.device() == dev && q.scalar_type() != at::kBFloat16)
    no_kernel(op, "q dtype " + dtype_name(q.scalar_type()) + " (the kernels take torch.bfloat16)");
  check_tensor(op, "q", q, {at::kBFloat16}, dev, {kAny, kAny, DSA_MLA_DIM});
  const int64_t num_tokens = q.size(0);
  check_tensor(op, "slots", slots, {at::kInt}, dev, {num_tokens, kAny}, Layout::kContiguous);
  DSA_CHECK_VALUE(num_splits >= 0 && num_splits <= kInt32Max, "dsa::", op, ": num_splits=", num_splits,
                    " must be an int >= 0 (0 = auto, 1 = unsplit, n = n chunks)");
  const int heads = to_int(op, "num_heads", q.size(1));
  at::Tensor out = at::empty({num_tokens, heads, DSA_MLA_V_DIM}, q.options());
  at::Tensor lse = at::empty({num_tokens, heads}, q.options().dtype(at::kFloat));
  if (num_tokens == 0 || heads == 0) return {out, lse};
  const int topk = to_int(op, "topk", slots.size(1));
  const c10::cuda::CUDAGuard guard(dev);
  const size_t ws_bytes = dsa_sparse_mla_workspace_size(num_tokens, heads, topk, fmt);
  const std::optional<at::Tensor> ws = ws_bytes ? std::optional<at::Tensor>(workspace(pool, ws_bytes)) : std::nullopt;
  const DsaSparseMlaParams p{q.data_ptr(),
                             pool.data_ptr(),
                             slots.data_ptr<int32_t>(),
                             out.data_ptr(),
                             lse.data_ptr<float>(),
                             num_tokens,
                             heads,
                             topk,
                             num_tokens > 1 ? q.stride(0) : static_cast<int64_t>(heads) * DSA_MLA_DIM,
                             heads > 1 ? q.stride(1) : DSA_MLA_DIM,
                             pool.size(0) * DSA_PAGE_SIZE,
                             static_cast<float>(kv_scale),
                             static_cast<float>(sm_scale),
                             fmt,
                             static_cast<int>(num_splits),
                             ptr(ws)};
  check_status(dsa_launch_sparse_mla(&p, stream_of(pool)));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> sparse_mla(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& slots,
                                              double kv_scale, double sm_scale) {
  return sparse_mla_splits(q, pool, slots, kv_scale, sm_scale, env_mla_splits());
}

// The launcher on caller-owned buffers with arbitrary params: its status (DSA_OK or DSA_ERR_*),
// the message in dsa_lab::last_error(). For tests of the launcher's own checks (no validation here
// beyond the device, which the stream needs).
int64_t sparse_mla_launch(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& slots, at::Tensor& out,
                          const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& ws,
                          int64_t num_heads, int64_t topk, int64_t format, int64_t num_splits, double kv_scale,
                          double sm_scale) {
  DSA_CHECK_VALUE(q.is_cuda() && pool.device() == q.device() && slots.device() == q.device() &&
                        out.device() == q.device(),
                    "dsa_lab::sparse_mla_launch: q, pool, slots and out must be on one CUDA device");
  const c10::cuda::CUDAGuard guard(q.device());
  const DsaSparseMlaParams p{q.data_ptr(),
                             pool.data_ptr(),
                             slots.data_ptr<int32_t>(),
                             out.data_ptr(),
                             static_cast<float*>(ptr(lse)),
                             q.size(0),
                             static_cast<int>(num_heads),
                             static_cast<int>(topk),
                             q.stride(0),
                             q.stride(1),
                             pool.size(0) * DSA_PAGE_SIZE,
                             static_cast<float>(kv_scale),
                             static_cast<float>(sm_scale),
                             static_cast<int>(format),
                             static_cast<int>(num_splits),
                             ptr(ws)};
  return dsa_launch_sparse_mla(&p, stream_of(q));
}

// ---------------------------------------------------------------- sizes, errors, version
int64_t abi_version() { return kAbiVersion; }
std::string last_error() { return dsa_last_error_message(); }

int64_t sparse_mla_workspace_size(int64_t num_tokens, int64_t num_heads, int64_t topk, int64_t format) {
  return static_cast<int64_t>(dsa_sparse_mla_workspace_size(num_tokens, static_cast<int>(num_heads),
                                                            static_cast<int>(topk), static_cast<int>(format)));
}

int64_t topk_translate_workspace_size(int64_t rows, int64_t max_len, int64_t k) {
  return static_cast<int64_t>(dsa_topk_translate_workspace_size(rows, max_len, static_cast<int>(k)));
}

}  // namespace

TORCH_LIBRARY_IMPL(dsa, CUDA, m) {
  m.impl("mla_cache_write", &mla_cache_write);
  m.impl("indexer_k_cache_write", &indexer_k_cache_write);
  m.impl("indexer_logits", &indexer_logits);
  m.impl("topk_translate", &topk_translate);
  m.impl("sparse_mla", &sparse_mla);
}

TORCH_LIBRARY(dsa_lab, m) {
  // No tensors: catch-all kernels.
  m.def("abi_version() -> int", &abi_version);
  m.def("last_error() -> str", &last_error);
  m.def("sparse_mla_workspace_size(int num_tokens, int num_heads, int topk, int format) -> int",
        &sparse_mla_workspace_size);
  m.def("topk_translate_workspace_size(int rows, int max_len, int k) -> int", &topk_translate_workspace_size);
  m.def("indexer_logits_into(Tensor q, Tensor weights, Tensor pool, Tensor page_table, Tensor req_idx, "
        "Tensor seq_lens, Tensor(a!) out) -> ()");
  m.def("topk_translate_into(Tensor logits, Tensor lengths, Tensor page_table, Tensor req_idx, int k, "
        "Tensor(a!) slots, Tensor(b!)? indices) -> ()");
  m.def("sparse_mla(Tensor q, Tensor pool, Tensor slots, float kv_scale, float sm_scale, int num_splits) "
        "-> (Tensor, Tensor)");
  m.def("sparse_mla_launch(Tensor q, Tensor pool, Tensor slots, Tensor(a!) out, Tensor(b!)? lse, "
        "Tensor(c!)? workspace, int num_heads, int topk, int format, int num_splits, float kv_scale, "
        "float sm_scale) -> int");
}

TORCH_LIBRARY_IMPL(dsa_lab, CUDA, m) {
  m.impl("indexer_logits_into", &indexer_logits_into);
  m.impl("topk_translate_into", &topk_translate_into);
  m.impl("sparse_mla", &sparse_mla_splits);
  m.impl("sparse_mla_launch", &sparse_mla_launch);
}
