"""A random DeepSeek-V3.2 checkpoint with the real per-layer dims, written as a stream.

Preset ``v32-real-dims`` of ``python -m dsa_trt.export.tiny_checkpoint``: hidden 7168, 128 heads,
q_lora 1536, kv_lora 512, dense width 18432, expert width 2048, top-8, index_topk 2048, 64
indexer heads (spec/MODEL.md §1.1), in the real storage format of §2 (e4m3 Linears with ue8m0
fp32 128x128 block scales, bf16 embeddings / router / ``weights_proj``, fp32 norms, per-expert
names, HF-style shards and index). Only the layer count, the expert count (and with it the
router groups), the leading dense layers, the vocabulary and the MTP layers are overridden.

Nothing holds more than one tensor, and a large tensor is generated, quantised and written
``CHUNK_ELEMENTS`` at a time straight into its shard (the safetensors header is computed from
the layout first), so peak host memory stays near one row chunk however large the checkpoint.
Same seed, same bytes.
"""

from __future__ import annotations

import json
import math
import resource
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dsa_trt.config import FP8_E4M3_MAX, ModelConfig

from .checkpoint import (
    FP8,
    FP8_SCALE_AMAX_FLOOR,
    SCALE_SUFFIX,
    _dtype_name,
    expected_tensors,
    quantize_fp8_blockwise,
)
from .tiny_checkpoint import (
    ARCHITECTURE,
    E_SCORE_BIAS_STD,
    K_NORM_BIAS_STD,
    LM_HEAD_STD,
    NORM_WEIGHT_STD,
    TINY_CONFIG,
    V32_DIMS,
    _layer_order,
    _write_json,
    hf_config_dict,
    shard_file_name,
    shard_groups,
    write_index,
    write_tokenizer,
)

DEFAULT_LAYERS = 2
DEFAULT_DENSE_LAYERS = 1  # layer 0 dense, the rest MoE (the real model: 3 of 61)
MAX_GROUPS = V32_DIMS["n_group"]
TOKENIZER_VOCAB = TINY_CONFIG["vocab_size"]  # the tiny BPE tokenizer; the embedding may be larger

LINEAR_STD = 0.02  # HF's initializer_range: what DeepseekV32 random-inits every Linear with
# The tiny model's lm_head std 0.3 at hidden 256 gives logits of std ~5; keep that spread at any width.
REAL_LM_HEAD_STD = LM_HEAD_STD * math.sqrt(TINY_CONFIG["hidden_size"] / V32_DIMS["hidden_size"])
CHUNK_ELEMENTS = 1 << 24  # 64 MB of fp32 master per generated slice (a multiple of 128 rows)
MAX_SHARD_BYTES = 1 << 30  # HF's release uses ~4 GB shards; 1 GB gives several even for 2 layers
SAFETENSORS_ALIGN = 8


@dataclass
class WriteStats:
    out_dir: Path
    num_tensors: int
    num_shards: int
    bytes_written: int
    seconds: float
    peak_rss_bytes: int  # the process's high-water mark (ru_maxrss) after writing
    start_rss_bytes: int  # ... before the first tensor (imports included)

    def summary(self) -> str:
        return (f"{self.out_dir}: {self.num_tensors} tensors in {self.num_shards} shards, "
                f"{self.bytes_written / 1e9:.2f} GB in {self.seconds:.1f} s; peak RSS {self.peak_rss_bytes / 1e9:.2f} GB "
                f"({self.start_rss_bytes / 1e9:.2f} GB before writing)")


def router_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) for an expert-count override: the real 8 / 4 when it divides, else the
    most groups (<= 8) of >= 2 experts (HF scores a group by its top-2) whose top half still offers
    >= top_k experts."""
    for groups in range(min(MAX_GROUPS, num_experts // 2), 0, -1):
        if num_experts % groups:
            continue
        size = num_experts // groups
        keep = max(math.ceil(groups / 2), math.ceil(top_k / size))
        if keep <= groups:
            return groups, keep
    raise ValueError(f"--experts {num_experts}: need at least 2 experts")


def real_dims_config_dict(layers: int = DEFAULT_LAYERS, experts: int = V32_DIMS["n_routed_experts"],
                          dense_layers: int = DEFAULT_DENSE_LAYERS, vocab_size: int = V32_DIMS["vocab_size"],
                          mtp_layers: int = 0) -> dict:
    """The config.json of the preset (through transformers' DeepseekV32Config, like the tiny one)."""
    from transformers import DeepseekV32Config

    problems = []
    if layers < 1:
        problems.append(f"--layers {layers} must be >= 1")
    if not 0 <= dense_layers <= layers:
        problems.append(f"--dense-layers {dense_layers} must be in [0, --layers {layers}]")
    if vocab_size < TOKENIZER_VOCAB:
        problems.append(f"--vocab-size {vocab_size} must be >= {TOKENIZER_VOCAB} (the tokenizer's ids)")
    if mtp_layers < 0:
        problems.append(f"--mtp-layers {mtp_layers} must be >= 0")
    if experts < 2:
        problems.append(f"--experts {experts} must be >= 2")
    if problems:
        raise ValueError("; ".join(problems))
    top_k = min(V32_DIMS["num_experts_per_tok"], experts)
    n_group, topk_group = router_groups(experts, top_k)
    kwargs = dict(V32_DIMS, num_hidden_layers=layers, first_k_dense_replace=dense_layers, vocab_size=vocab_size,
                  n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
                  num_nextn_predict_layers=mtp_layers)
    config = DeepseekV32Config(**kwargs)
    config.architectures = [ARCHITECTURE["deepseek_v32"]]
    return hf_config_dict(config)


# ------------------------------------------------------------------------- the stream
def _std(name: str) -> float:
    if name == "lm_head.weight" or name.endswith("shared_head.head.weight"):
        return REAL_LM_HEAD_STD
    return LINEAR_STD


def _vector(name: str, size: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 norms 1 + N(0, 0.1), biases N(0, .), as the tiny master perturbs HF's trivial init."""
    noise = torch.randn(size, generator=gen)
    if name.endswith("k_norm.bias"):
        return noise * K_NORM_BIAS_STD
    if name.endswith("e_score_correction_bias"):
        return noise * E_SCORE_BIAS_STD
    return 1 + noise * NORM_WEIGHT_STD


def _quantize_in_place(master: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_blockwise's recipe (amax / 448 rounded up to a power of two), without its padded
    copy, when the slice is whole blocks: scaling by an exact power of two then casting gives the same
    e4m3 bytes, and |x| / scale <= 448 by construction, so no clamp. Otherwise the reference recipe."""
    rows, cols = master.shape
    bo, bi = block
    if rows % bo or cols % bi:
        return quantize_fp8_blockwise(master, block, pow2_scales=True)
    blocks = master.view(rows // bo, bo, cols // bi, bi)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg_())  # no |x| copy
    scale = amax.clamp_min_(FP8_SCALE_AMAX_FLOOR).div_(FP8_E4M3_MAX)
    scale = torch.exp2(torch.ceil(torch.log2(scale)))  # [rows / bo, cols / bi]
    blocks.mul_(scale.reciprocal()[:, None, :, None])
    return master.to(FP8), scale


def _matrix_chunks(name: str, shape: tuple[int, int], fp8: bool, block: tuple[int, int] | None,
                   gen: torch.Generator):
    """Row slices of the stored tensor (e4m3 or bf16) and, for fp8, of its scale, generated in turn."""
    rows, cols = shape
    step = max(block[0] if block else 1, CHUNK_ELEMENTS // cols // 128 * 128)
    for r0 in range(0, rows, step):
        master = torch.randn(min(step, rows - r0), cols, generator=gen) * _std(name)
        if fp8:
            yield _quantize_in_place(master, block)
        else:
            yield master.to(torch.bfloat16), None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())  # no copy


def _units(cfg: ModelConfig) -> list[list[tuple[str, tuple, torch.dtype]]]:
    """Write units in file order: a weight with its scale right after it, globals first, by layer."""
    specs = expected_tensors(cfg)
    units = []
    for name in sorted((n for n in specs if not n.endswith(SCALE_SUFFIX)), key=_layer_order):
        unit = [(name, specs[name].shape, specs[name].dtypes[0])]
        if name + SCALE_SUFFIX in specs:
            unit.append((name + SCALE_SUFFIX, specs[name + SCALE_SUFFIX].shape, torch.float32))
        units.append(unit)
    return units


def _shards(units, max_shard_bytes: int) -> list[list[tuple[str, tuple, torch.dtype]]]:
    """The units cut into shards (a weight and its scale stay together), each a flat entry list."""
    sizes = [sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in unit) for unit in units]
    return [[entry for unit in group for entry in unit] for group in shard_groups(units, sizes, max_shard_bytes)]


def _write_shard(path: Path, entries, cfg: ModelConfig, gen: torch.Generator) -> int:
    """One safetensors file, its header from the layout, then the data tensor by tensor, slice by slice."""
    header, offset = {}, 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % SAFETENSORS_ALIGN)
    scales: dict[str, torch.Tensor] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in entries:
            if name.endswith(SCALE_SUFFIX):
                scale = scales.pop(name)
                if tuple(scale.shape) != tuple(shape):
                    raise RuntimeError(f"{name}: wrote scale {tuple(scale.shape)}, the layout says {shape}")
                f.write(_tensor_bytes(scale))
            elif len(shape) == 1:
                f.write(_tensor_bytes(_vector(name, shape[0], gen).to(dtype)))
            else:
                parts = []
                for data, scale in _matrix_chunks(name, shape, dtype == FP8, cfg.fp8_weight_block, gen):
                    f.write(_tensor_bytes(data))
                    if scale is not None:
                        parts.append(scale)
                if parts:
                    scales[name + SCALE_SUFFIX] = torch.cat(parts)  # [ceil(rows/128), ceil(cols/128)] fp32: small
        if f.tell() != 8 + len(blob) + offset:
            raise RuntimeError(f"{path}: wrote {f.tell()} bytes, the header promised {8 + len(blob) + offset}")
    return offset


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def write_real_dims_checkpoint(out_dir: str | Path, seed: int = 0, layers: int = DEFAULT_LAYERS,
                               experts: int = V32_DIMS["n_routed_experts"], dense_layers: int = DEFAULT_DENSE_LAYERS,
                               vocab_size: int = V32_DIMS["vocab_size"], mtp_layers: int = 0,
                               max_shard_bytes: int = MAX_SHARD_BYTES) -> WriteStats:
    """Write the preset to ``out_dir`` (config, shards, index, tokenizer); returns time and peak RSS."""
    t0 = time.perf_counter()
    config = real_dims_config_dict(layers, experts, dense_layers, vocab_size, mtp_layers)
    start_rss = _rss_bytes()  # after transformers' import, which the config needs
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf_dict(config)
    gen = torch.Generator().manual_seed(seed)
    shards = _shards(_units(cfg), max_shard_bytes)
    weight_map, total = {}, 0
    for i, entries in enumerate(shards):
        file = shard_file_name(i, len(shards))
        total += _write_shard(out_dir / file, entries, cfg, gen)
        weight_map.update((name, file) for name, _, _ in entries)
    _write_json(out_dir / "config.json", config)
    write_index(out_dir, total, weight_map)
    write_tokenizer(out_dir)
    return WriteStats(out_dir, len(weight_map), len(shards), total, time.perf_counter() - t0, _rss_bytes(), start_rss)
