"""The model config: one typed dataclass filled from a checkpoint's config.json.

Every layer of the project (export, kernels' shape checks, builder, runtime) reads model
dimensions from here; derived values (head dims, softmax scale, RoPE frequencies, cache bytes
per token) are computed once in ``__post_init__``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

# the cache layout is defined in cache_layout.py; these names stay importable from here
from dsa_trt.cache_layout import (  # noqa: F401
    FP8_E4M3_MAX,
    INDEX_DIM,
    INDEX_K_ROW_BYTES,
    MLA_LATENT_DIM,
    MLA_NOPE_DIM,
    MLA_ROPE_DIM,
    PAGE_SIZE,
    index_bytes_per_token,
    mla_bytes_per_token,
)

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# config.json fields with no default: ModelConfig.from_hf_dict names the first one missing
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
    "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
    "max_position_embeddings",
)


class ConfigError(ValueError):
    """A checkpoint's config.json cannot be served: the message names the field and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    first_k_dense_replace: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_type: str  # "yarn" or "default"
    rope_factor: float = 1.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    indexer_rope_interleave: bool = False  # V3.2: False (half-split); GLM: True
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    fp8_weight_block: tuple[int, int] | None = None  # [128, 128] for fp8 block checkpoints
    fp8_scale_fmt: str | None = None  # "ue8m0" or None
    # derived (filled in __post_init__)
    qk_head_dim: int = field(init=False)
    softmax_scale: float = field(init=False)

    def __post_init__(self) -> None:
        problems = []
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            problems.append(
                f"model_type {self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if self.kv_lora_rank + self.qk_rope_head_dim != MLA_LATENT_DIM:
            problems.append(
                f"kv_lora_rank + qk_rope_head_dim = {self.kv_lora_rank}+{self.qk_rope_head_dim}; "
                f"the {MLA_LATENT_DIM}-byte latent cache needs {MLA_NOPE_DIM}+{MLA_ROPE_DIM}"
            )
        if self.index_head_dim != INDEX_DIM:
            problems.append(f"index_head_dim = {self.index_head_dim}; the indexer cache layout needs {INDEX_DIM}")
        if self.index_topk <= 0:
            problems.append(f"index_topk = {self.index_topk} must be positive")
        if self.n_routed_experts % max(self.n_group, 1):
            problems.append(f"n_routed_experts {self.n_routed_experts} not divisible by n_group {self.n_group}")
        if self.rope_type not in ("yarn", "default"):
            problems.append(f"rope type {self.rope_type!r} not supported (yarn, default)")
        if problems:
            raise ConfigError("config.json: " + "; ".join(problems))
        object.__setattr__(self, "qk_head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        scale = self.qk_head_dim**-0.5
        if self.rope_type == "yarn" and self.rope_mscale_all_dim:
            m = _yarn_get_mscale(self.rope_factor, self.rope_mscale_all_dim)
            scale = scale * m * m
        object.__setattr__(self, "softmax_scale", scale)

    # ---------------------------------------------------------------- derived helpers
    @property
    def is_moe_layer(self) -> list[bool]:
        return [i >= self.first_k_dense_replace for i in range(self.num_hidden_layers)]

    def mla_cache_bytes_per_token(self, cache_mode: str) -> int:
        """Bytes per token per layer of the MLA pool: 576 (fp8 raw layout) or 1152 (bf16)."""
        return mla_bytes_per_token(cache_mode)

    def indexer_cache_bytes_per_token(self, cache_mode: str) -> int:
        """Bytes per token per layer of the indexer pool: 132 (fp8 key + scale) or 256 (bf16)."""
        return index_bytes_per_token(cache_mode)

    def cache_bytes_per_token(self, cache_mode: str) -> int:
        """Both pools, all layers."""
        per_layer = self.mla_cache_bytes_per_token(cache_mode) + self.indexer_cache_bytes_per_token(cache_mode)
        return per_layer * self.num_hidden_layers

    def rope_inv_freq(self) -> torch.Tensor:
        """[qk_rope_head_dim // 2] fp32 frequencies, YaRN-corrected when rope_type == 'yarn'."""
        dim = self.qk_rope_head_dim
        base = self.rope_theta
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if self.rope_type != "yarn":
            return inv_freq.float()

        def correction_dim(rot: float) -> float:
            return (dim * math.log(self.rope_original_max_position / (rot * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.rope_beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.rope_beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / self.rope_factor * (1 - extrapolation) + inv_freq * extrapolation
        return inv_freq.float()

    def rope_attention_scaling(self) -> float:
        """cos/sin amplitude factor (1.0 for V3.2: mscale == mscale_all_dim)."""
        if self.rope_type != "yarn":
            return 1.0
        return _yarn_get_mscale(self.rope_factor, self.rope_mscale) / _yarn_get_mscale(
            self.rope_factor, self.rope_mscale_all_dim
        )

    # ---------------------------------------------------------------- (de)serialisation
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        def need(key: str):
            if key not in d:
                raise ConfigError(f"config.json: missing field {key!r}")
            return d[key]

        model_type = need("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id", 1)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        check_dtype_fields(d)
        q = check_quantization_config(d.get("quantization_config"))
        block = tuple(q["weight_block_size"]) if q else None
        kwargs = dict(
            model_type=model_type,
            **{key: need(key) for key in REQUIRED_FIELDS},
            first_k_dense_replace=d.get("first_k_dense_replace", 0),
            n_shared_experts=d.get("n_shared_experts", 0) or 0,
            n_group=d.get("n_group", 1) or 1,
            topk_group=d.get("topk_group", 1) or 1,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_original_max_position=int(rope.get("original_max_position_embeddings", 4096)),
            rope_beta_fast=float(rope.get("beta_fast", 32.0)),
            rope_beta_slow=float(rope.get("beta_slow", 1.0)),
            rope_mscale=float(rope.get("mscale", 1.0)),
            rope_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
            # HF hard-codes the indexer RoPE layout per class: V3.2 half-split, GLM interleaved.
            indexer_rope_interleave=bool(d.get("indexer_rope_interleave", model_type == "glm_moe_dsa")),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers", 0) or 0,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            fp8_weight_block=block,
            fp8_scale_fmt=q.get("scale_fmt") if block else None,
        )
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json; point at a Hugging Face checkpoint directory")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: holds a JSON {type(d).__name__}, not an object of fields; "
                              "point at the checkpoint's own config.json")
        try:
            return cls.from_hf_dict(d)
        except (TypeError, ValueError) as e:  # a field of the wrong JSON type
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{path}: a field has the wrong type ({e}); compare with the original config.json") from e

    def to_dict(self) -> dict:
        d = asdict(self)
        for f in fields(self):
            if not f.init:
                d.pop(f.name)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        for key in ("eos_token_id", "fp8_weight_block"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)


# What the loader can read: the fp8 block format of DeepSeek-V3.x / GLM-5 (MODEL.md §2), or none.
QUANT_METHODS = ("fp8",)
QUANT_FMTS = ("e4m3",)
QUANT_SCALE_FMTS = (None, "ue8m0")
QUANT_ACTIVATION_SCHEMES = (None, "dynamic")
CONFIG_DTYPES = ("bfloat16", "float16", "float32")  # config.json torch_dtype / dtype


def check_dtype_fields(d: dict) -> None:
    for key in ("torch_dtype", "dtype"):
        v = d.get(key)
        if v is not None and v not in CONFIG_DTYPES:
            raise ConfigError(f"config.json: {key}={v!r} is not a dtype this loader knows ({', '.join(CONFIG_DTYPES)})")


def check_quantization_config(q) -> dict | None:
    """The fp8 block quantization_config, validated (every field named); None when absent."""
    if q is None or q == {}:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {type(q).__name__}")
    problems = []
    if q.get("quant_method") not in QUANT_METHODS:
        problems.append(f"quant_method={q.get('quant_method')!r} is not supported (supported: {QUANT_METHODS}; "
                        "remove quantization_config for a bf16/fp32 checkpoint)")
    if "fmt" in q and q["fmt"] not in QUANT_FMTS:
        problems.append(f"fmt={q['fmt']!r} is not supported (supported: {QUANT_FMTS})")
    if q.get("scale_fmt") not in QUANT_SCALE_FMTS:
        problems.append(f"scale_fmt={q.get('scale_fmt')!r} is not supported (supported: {QUANT_SCALE_FMTS})")
    if q.get("activation_scheme") not in QUANT_ACTIVATION_SCHEMES:
        problems.append(f"activation_scheme={q.get('activation_scheme')!r} is not supported "
                        f"(supported: {QUANT_ACTIVATION_SCHEMES})")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        problems.append(f"weight_block_size={block!r} must be a list of two positive ints, e.g. [128, 128]")
    if problems:
        raise ConfigError("config.json: quantization_config." + "; quantization_config.".join(problems))
    return q


def _yarn_get_mscale(scale: float, mscale: float) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
