// The schemas of torch.ops.dsa.* for a process without Python (runtime/cpp/dsa_step.cpp).
//
// In a Python process plugins/ops.py defines them (its OPS table); this file is linked ONLY into
// the standalone runner, never into libdsa_torch_ops.so (which registers implementations only, so
// it loads into both). tests/test_op_schemas.py keeps every line below equal to plugins/ops.py:
// one m.def per op, the schema string on one line, exactly as in its OpDef.
#include <torch/library.h>

TORCH_LIBRARY(dsa, m) {
  m.def("mla_cache_write(Tensor kv_latent, Tensor k_pe, Tensor slot_mapping, Tensor(a!) pool, float kv_scale) -> ()");
  m.def("indexer_k_cache_write(Tensor index_k, Tensor slot_mapping, Tensor(a!) pool) -> ()");
  m.def("indexer_logits(Tensor q, Tensor weights, Tensor pool, Tensor page_table, Tensor req_idx, Tensor seq_lens) -> Tensor");
  m.def("topk_translate(Tensor logits, Tensor lengths, Tensor page_table, Tensor req_idx, SymInt k) -> Tensor");
  m.def("sparse_mla(Tensor q, Tensor pool, Tensor slots, float kv_scale, float sm_scale) -> (Tensor, Tensor)");
  m.def("fp8_block_linear(Tensor x, Tensor weight, Tensor weight_scale, bool pow2_scales) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor? w13_scale, Tensor w2, Tensor? w2_scale, int num_experts, int expert_offset, bool pow2_scales) -> Tensor");
}
