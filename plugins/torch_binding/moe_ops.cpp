// DSA-TRT torch binding: the CUDA kernels of dsa::fp8_block_linear and dsa::moe_experts (schemas
// defined in Python with the reference implementations, plugins/fp8_ops.py) over the launchers of
// plugins/csrc/dsa_moe_kernels.h, and dsa::f32_linear over cuBLAS (torch's bf16 GEMM with fp32
// output, in fixed row chunks under DSA_F32_LINEAR_ROWS). Validation happens here, once, with the reference op's rules
// (check_fp8_block_linear / check_moe_experts with check_values=False) and messages naming the
// argument: bad arguments raise ValueError; a launcher's DSA_ERR_INVALID_ARG -> ValueError,
// DSA_ERR_UNSUPPORTED -> NotImplementedError, DSA_ERR_CUDA -> RuntimeError, each carrying
// dsa_last_error_message(). Outputs and the workspace come from torch's allocator on x's device,
// the launch goes on the current stream (no host synchronisation: CUDA-graph safe, so expert-id
// values are not read here; the kernel skips ids outside [0, num_experts)).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "message.h"
#include "../csrc/dsa_kernels.h"

namespace {

constexpr int64_t kBlock = DSA_FP8_BLOCK;
constexpr int64_t kInt32Max = 2147483647;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_on(const at::Tensor& t, const char* op, const char* name, const at::Device& device) {
  DSA_CHECK_VALUE(t.is_cuda(), op, ": ", name, " must be a CUDA tensor (got ", t.device(), ")");
  DSA_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but x is on ", device);
}

void check_dtype(const at::Tensor& t, const char* op, const char* name, at::ScalarType want) {
  DSA_CHECK_VALUE(t.scalar_type() == want, op, ": ", name, " must be ", want, " (got ", t.scalar_type(), ")");
}

void check_shape(const at::Tensor& t, const char* op, const char* name, at::IntArrayRef want) {
  DSA_CHECK_VALUE(t.sizes() == want, op, ": ", name, " must have shape ", want, " (got ", t.sizes(), ")");
}

void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  DSA_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous (got strides ", t.strides(),
                    "; pass .contiguous())");
}

void check_status(int status, const char* op) {
  if (status == DSA_OK) return;
  DSA_CHECK_VALUE(status != DSA_ERR_INVALID_ARG, op, ": ", dsa_last_error_message());
  DSA_CHECK_NOT_IMPLEMENTED(status != DSA_ERR_UNSUPPORTED, op, ": ", dsa_last_error_message());
  DSA_CHECK(false, op, ": ", dsa_last_error_message());
}

at::Tensor workspace(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 16))}, like.options().dtype(at::kByte));
}

// x [T, K] bf16 (unit inner stride), weight [N, K] e4m3, weight_scale [ceil(N/128), ceil(K/128)]
// fp32 -> [T, N] bf16
at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                            bool pow2_scales) {
  constexpr const char* op = "dsa::fp8_block_linear";
  DSA_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [T, K] with unit inner stride (got shape ",
                    x.sizes(), ", strides ", x.strides(), ")");
  check_on(weight, op, "weight", x.device());
  check_on(weight_scale, op, "weight_scale", x.device());
  check_dtype(x, op, "x", at::kBFloat16);
  check_dtype(weight, op, "weight", at::kFloat8_e4m3fn);
  check_dtype(weight_scale, op, "weight_scale", at::kFloat);
  DSA_CHECK_VALUE(weight.dim() == 2, op, ": weight must be [N, K] (got ", weight.sizes(), ")");
  const int64_t n = weight.size(0), k = weight.size(1);
  DSA_CHECK_VALUE(n > 0 && k > 0 && n <= kInt32Max && k <= kInt32Max, op, ": weight shape ", weight.sizes(),
                    " must have 0 < N, K < 2^31");
  DSA_CHECK_VALUE(x.size(1) == k, op, ": x has K=", x.size(1), " columns but weight [N, K] is ", weight.sizes());
  DSA_CHECK_NOT_IMPLEMENTED(k % 16 == 0, op, ": K = ", k,
                              " must be a multiple of 16 (the kernels copy 16-byte weight chunks)");
  check_contiguous(weight, op, "weight");
  check_shape(weight_scale, op, "weight_scale", {ceil_div(n, kBlock), ceil_div(k, kBlock)});
  check_contiguous(weight_scale, op, "weight_scale");

  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0);
  at::Tensor out = at::empty({t, n}, x.options());
  if (t == 0) return out;
  const at::Tensor x2 = t > 1 && x.stride(0) < k ? x.contiguous() : x;  // overlapping rows
  at::Tensor ws = workspace(dsa_fp8_block_linear_workspace_size(t, static_cast<int>(n), static_cast<int>(k)), x);

  DsaFp8BlockLinearParams p{};
  p.x = x2.data_ptr();
  p.weight = weight.data_ptr();
  p.weight_scale = weight_scale.data_ptr<float>();
  p.out = out.data_ptr();
  p.num_tokens = t;
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.x_stride = t > 1 ? x2.stride(0) : k;
  p.out_stride = n;
  p.pow2_act_scales = pow2_scales ? 1 : 0;
  p.workspace = ws.data_ptr();
  check_status(dsa_launch_fp8_block_linear(&p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return out;
}

// x [T, D] bf16, topk_ids [T, k] int32, topk_weights [T, k] fp32 (all contiguous), w13 [E, 2I, D] and
// w2 [E, D, I] e4m3 (with fp32 scales) or bf16 (scales None) -> [T, D] fp32
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13, const std::optional<at::Tensor>& w13_scale, const at::Tensor& w2,
                       const std::optional<at::Tensor>& w2_scale, int64_t num_experts, int64_t expert_offset,
                       bool pow2_scales) {
  constexpr const char* op = "dsa::moe_experts";
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{topk_ids, "topk_ids"},
                                {topk_weights, "topk_weights"}, {w13, "w13"}, {w2, "w2"}})
    check_on(t, op, name, x.device());
  check_dtype(x, op, "x", at::kBFloat16);
  DSA_CHECK_VALUE(x.dim() == 2, op, ": x must be [T, D] (got ", x.sizes(), ")");
  check_dtype(topk_ids, op, "topk_ids", at::kInt);
  check_dtype(topk_weights, op, "topk_weights", at::kFloat);
  check_contiguous(x, op, "x");
  check_contiguous(topk_ids, op, "topk_ids");
  check_contiguous(topk_weights, op, "topk_weights");
  const int64_t t = x.size(0), d = x.size(1);
  DSA_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == t && topk_ids.size(1) >= 1, op,
                    ": topk_ids must be [T=", t, ", top_k >= 1] (got ", topk_ids.sizes(), ")");
  const int64_t top_k = topk_ids.size(1);
  check_shape(topk_weights, op, "topk_weights", {t, top_k});

  const bool fp8 = w13.scalar_type() == at::kFloat8_e4m3fn;
  DSA_CHECK_VALUE(fp8 || w13.scalar_type() == at::kBFloat16, op, ": w13 must be float8_e4m3fn or bfloat16 (got ",
                    w13.scalar_type(), ")");
  check_dtype(w2, op, "w2", w13.scalar_type());
  DSA_CHECK_VALUE(w13.dim() == 3 && w13.size(2) == d && w13.size(1) % 2 == 0 && w13.size(1) > 0, op,
                    ": w13 must be [E_local, 2I, D=", d, "] with 2I even and > 0 (got ", w13.sizes(), ")");
  const int64_t e = w13.size(0), inter = w13.size(1) / 2;
  check_shape(w2, op, "w2", {e, d, inter});
  check_contiguous(w13, op, "w13");
  check_contiguous(w2, op, "w2");
  if (fp8) {
    DSA_CHECK_VALUE(w13_scale.has_value() && w2_scale.has_value(), op,
                      ": float8_e4m3fn experts need w13_scale and w2_scale (got None)");
    for (const auto& [s, name] : {std::pair<const at::Tensor&, const char*>{*w13_scale, "w13_scale"},
                                  {*w2_scale, "w2_scale"}}) {
      check_on(s, op, name, x.device());
      check_dtype(s, op, name, at::kFloat);
      check_contiguous(s, op, name);
    }
    check_shape(*w13_scale, op, "w13_scale", {e, ceil_div(2 * inter, kBlock), ceil_div(d, kBlock)});
    check_shape(*w2_scale, op, "w2_scale", {e, ceil_div(d, kBlock), ceil_div(inter, kBlock)});
    DSA_CHECK_NOT_IMPLEMENTED(d % 16 == 0 && inter % 16 == 0, op, ": D = ", d, " and I = ", inter,
                                " must be multiples of 16 for float8_e4m3fn experts");
  } else {
    DSA_CHECK_VALUE(!w13_scale.has_value() && !w2_scale.has_value(), op,
                      ": bfloat16 experts take no scales (w13_scale / w2_scale must be None)");
  }
  DSA_CHECK_VALUE(num_experts >= 1 && expert_offset >= 0 && expert_offset + e <= num_experts, op,
                    ": the local experts [expert_offset=", expert_offset, ", +E_local=", e,
                    ") must lie in [0, num_experts=", num_experts, ")");
  DSA_CHECK_NOT_IMPLEMENTED(
      d <= kInt32Max && 2 * inter <= kInt32Max && num_experts <= kInt32Max && t * top_k <= kInt32Max, op,
      ": sizes exceed int32 (T*top_k=", t * top_k, ", D=", d, ", I=", inter, ")");

  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({t, d}, x.options().dtype(at::kFloat));
  if (t == 0) return out;
  const int fmt = fp8 ? DSA_MOE_FP8_BLOCK : DSA_MOE_BF16;
  at::Tensor ws = workspace(dsa_moe_experts_workspace_size(t, static_cast<int>(top_k), static_cast<int>(e),
                                                           static_cast<int>(d), static_cast<int>(inter), fmt),
                            x);
  DsaMoeExpertsParams p{};
  p.x = x.data_ptr();
  p.topk_ids = topk_ids.data_ptr<int32_t>();
  p.topk_weights = topk_weights.data_ptr<float>();
  p.w13 = w13.data_ptr();
  p.w13_scale = fp8 ? w13_scale->data_ptr<float>() : nullptr;
  p.w2 = w2.data_ptr();
  p.w2_scale = fp8 ? w2_scale->data_ptr<float>() : nullptr;
  p.out = out.data_ptr<float>();
  p.num_tokens = t;
  p.top_k = static_cast<int>(top_k);
  p.num_experts = static_cast<int>(num_experts);
  p.num_local_experts = static_cast<int>(e);
  p.expert_offset = static_cast<int>(expert_offset);
  p.hidden = static_cast<int>(d);
  p.inter = static_cast<int>(inter);
  p.weight_format = fmt;
  p.pow2_act_scales = pow2_scales ? 1 : 0;
  p.workspace = ws.data_ptr();
  check_status(dsa_launch_moe_experts(&p, c10::cuda::getCurrentCUDAStream().stream()), op);
  return out;
}

// DSA_F32_LINEAR_ROWS (plugins/fp8_ops.py f32_linear_rows): 0 when unset, else the rows per GEMM.
int64_t f32_linear_rows() {
  constexpr int64_t kMaxRows = 65536;
  const char* e = std::getenv("DSA_F32_LINEAR_ROWS");
  if (e == nullptr || *e == '\0') return 0;
  char* end = nullptr;
  const long long v = std::strtoll(e, &end, 10);
  DSA_CHECK_VALUE(*end == '\0' && v >= 1 && v <= kMaxRows, "DSA_F32_LINEAR_ROWS='", e,
                    "' must be an integer in [1, ", kMaxRows, "] (rows per GEMM of dsa::f32_linear; unset: one GEMM)");
  return v;
}

// x [T, K] bf16, weight [N, K] bf16 -> x @ weight^T [T, N] fp32: one bf16 GEMM with fp32 output, or
// with DSA_F32_LINEAR_ROWS = R the same GEMM on chunks of exactly R rows of a zero-padded copy of x
// (cuBLAS picks its kernel by the shape: one shape, one kernel, the same sums for a row at every T;
// the chunks' operands and outputs all start R rows apart in fresh buffers, so their alignment
// agrees too). The result is a view of the first T rows of the padded output (contiguous).
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight) {
  constexpr const char* op = "dsa::f32_linear";
  DSA_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2, op, ": x must be [T, K] and weight [N, K] (got ", x.sizes(),
                    " and ", weight.sizes(), ")");
  check_on(weight, op, "weight", x.device());
  DSA_CHECK_VALUE(x.size(1) == weight.size(1), op, ": x has K=", x.size(1), " columns but weight [N, K] is ",
                    weight.sizes());
  DSA_CHECK_VALUE(x.scalar_type() == weight.scalar_type() &&
                      (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                  op, ": x and weight must both be bfloat16 or both float32 (got ", x.scalar_type(), " and ",
                  weight.scalar_type(), ")");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = f32_linear_rows(), t = x.size(0);
  const at::Tensor wt = weight.t();
  auto gemm = [&](const at::Tensor& a) {
    return a.scalar_type() == at::kBFloat16 ? at::mm(a, wt, at::kFloat) : at::mm(a, wt);
  };
  if (rows == 0 || t == 0) return gemm(x);
  const int64_t chunks = (t + rows - 1) / rows;
  at::Tensor padded = at::zeros({chunks * rows, x.size(1)}, x.options());
  padded.narrow(0, 0, t).copy_(x);
  std::vector<at::Tensor> parts;
  parts.reserve(static_cast<size_t>(chunks));
  for (int64_t c = 0; c < chunks; ++c) parts.push_back(gemm(padded.narrow(0, c * rows, rows)));
  return at::cat(parts).narrow(0, 0, t);
}

}  // namespace

TORCH_LIBRARY_IMPL(dsa, CUDA, m) {
  m.impl("fp8_block_linear", &fp8_block_linear);
  m.impl("moe_experts", &moe_experts);
  m.impl("f32_linear", &f32_linear);
}
