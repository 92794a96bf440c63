"""The checkpoint layout: every tensor a DeepSeek-V3.2 / GLM-5 checkpoint holds, with its shape and
dtypes (docs/architecture.md §2), as a pure function of the model config.

Part of the contract layer: the checkpoint reader (export/checkpoint.py), the plan
(dsa_trt/plan.py) and the generators all read the layout from here. fp8 block checkpoints store
the quantizable Linears in e4m3 with an fp32 ``weight_scale_inv`` of [ceil(out/128), ceil(in/128)]
blocks; everything else, and every tensor of an unquantized checkpoint, is bf16 or fp32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dsa_trt.config import ModelConfig

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" -> "<name>.weight_scale_inv"
FP8 = torch.float8_e4m3fn
HIGH_PRECISION = (torch.bfloat16, torch.float32)  # any of these reads back exactly via get()
NORM_DTYPES = (torch.float32, torch.bfloat16)  # fp32 first: the canonical dtype for norms/biases


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]  # accepted dtypes; dtypes[0] is the canonical (written) one


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def is_mtp_tensor(cfg: ModelConfig, name: str) -> bool:
    """True for tensors of the MTP (next-n) layers, stored after the last decoder layer."""
    parts = name.split(".")
    if parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    return int(parts[2]) >= cfg.num_hidden_layers


def mtp_shared_copies(cfg: ModelConfig) -> dict[str, str]:
    """{MTP layer's tensor: the main model's tensor it copies}: each MTP layer stores the main
    embedding and lm_head again (spec §5: shared in the DeepSeek-V3 design). An engine holds them
    once when the copies are equal (builder/weights.py build_draft_rank)."""
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    out = {}
    for layer in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        out[f"model.layers.{layer}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"model.layers.{layer}.shared_head.head.weight"] = head
    return out


# ---------------------------------------------------------------------------------- the layout
def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint for ``cfg`` holds (the release's layout), MTP layers included.

    fp8 checkpoints (``cfg.fp8_weight_block`` set) store the quantizable Linears in e4m3 with a
    fp32 block scale; everything else, and every tensor of a checkpoint without quantization,
    may be bf16 or fp32."""
    specs: dict[str, TensorSpec] = {}
    block = cfg.fp8_weight_block

    def linear(name: str, out_features: int, in_features: int, quantized: bool = True) -> None:
        if block is None or not quantized:
            specs[name] = TensorSpec((out_features, in_features), HIGH_PRECISION)
            return
        specs[name] = TensorSpec((out_features, in_features), (FP8,))
        scale_shape = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
        specs[scale_name(name)] = TensorSpec(scale_shape, (torch.float32,))

    def vector(name: str, size: int) -> None:
        specs[name] = TensorSpec((size,), NORM_DTYPES)

    d, v = cfg.hidden_size, cfg.vocab_size
    linear("model.embed_tokens.weight", v, d, quantized=False)
    vector("model.norm.weight", d)
    if not cfg.tie_word_embeddings:
        linear("lm_head.weight", v, d, quantized=False)

    for layer in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{layer}."
        _attention_layer(cfg, p, linear, vector)
        if layer >= cfg.first_k_dense_replace:
            _moe_mlp(cfg, p + "mlp.", linear, vector)
        else:
            _swiglu(p + "mlp.", d, cfg.intermediate_size, linear)
        if layer >= cfg.num_hidden_layers:  # MTP extras
            vector(p + "enorm.weight", d)
            vector(p + "hnorm.weight", d)
            linear(p + "eh_proj.weight", d, 2 * d, quantized=False)
            linear(p + "embed_tokens.weight", v, d, quantized=False)
            vector(p + "shared_head.norm.weight", d)
            linear(p + "shared_head.head.weight", v, d, quantized=False)
    return specs


def _attention_layer(cfg: ModelConfig, p: str, linear, vector) -> None:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    vector(p + "input_layernorm.weight", d)
    vector(p + "post_attention_layernorm.weight", d)
    a = p + "self_attn."
    linear(a + "q_a_proj.weight", cfg.q_lora_rank, d)
    vector(a + "q_a_layernorm.weight", cfg.q_lora_rank)
    linear(a + "q_b_proj.weight", h * cfg.qk_head_dim, cfg.q_lora_rank)
    linear(a + "kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)  # [576, D]
    vector(a + "kv_a_layernorm.weight", cfg.kv_lora_rank)
    linear(a + "kv_b_proj.weight", h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    linear(a + "o_proj.weight", d, h * cfg.v_head_dim)
    i = a + "indexer."
    linear(i + "wq_b.weight", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
    linear(i + "wk.weight", cfg.index_head_dim, d)
    vector(i + "k_norm.weight", cfg.index_head_dim)
    vector(i + "k_norm.bias", cfg.index_head_dim)
    linear(i + "weights_proj.weight", cfg.index_n_heads, d, quantized=False)


def _swiglu(p: str, d: int, width: int, linear) -> None:
    linear(p + "gate_proj.weight", width, d)
    linear(p + "up_proj.weight", width, d)
    linear(p + "down_proj.weight", d, width)


def _moe_mlp(cfg: ModelConfig, p: str, linear, vector) -> None:
    d = cfg.hidden_size
    linear(p + "gate.weight", cfg.n_routed_experts, d, quantized=False)
    vector(p + "gate.e_score_correction_bias", cfg.n_routed_experts)
    for e in range(cfg.n_routed_experts):
        _swiglu(f"{p}experts.{e}.", d, cfg.moe_intermediate_size, linear)
    if cfg.n_shared_experts:
        _swiglu(p + "shared_experts.", d, cfg.n_shared_experts * cfg.moe_intermediate_size, linear)
