"""Read a DeepSeek-V3.2 / GLM-5 Hugging Face checkpoint: validate it whole, then read it lazily.

The layout is the one of the DeepSeek-V3.2 release: fp8 e4m3 Linears with a fp32 ``weight_scale_inv`` of
[ceil(out/128), ceil(in/128)] blocks (the edge blocks may be partial), bf16 embeddings, router,
indexer ``weights_proj`` and MTP ``eh_proj``/head, fp32 norms and biases; per-expert tensor names;
the MTP layer stored as ``model.layers.{num_hidden_layers}``. A checkpoint without a
``quantization_config`` has the same names, bf16 or fp32 everywhere and no scales.

Only safetensors is read (no pickle). Opening a :class:`Checkpoint` reads the config, the shard
index and every shard header, and reports every problem at once in one :class:`CheckpointError`;
tensor data is read one tensor at a time with ``safe_open``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from dsa_trt.checkpoint_layout import (  # noqa: F401  (re-exported: the layout is part of this reader's API)
    FP8,
    HIGH_PRECISION,
    NORM_DTYPES,
    SCALE_SUFFIX,
    TensorSpec,
    expected_tensors,
    is_mtp_tensor,
    scale_name,
)
from dsa_trt.config import FP8_E4M3_MAX, ConfigError, ModelConfig

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
FP8_SCALE_AMAX_FLOOR = 1e-4  # keeps all-zero blocks from producing a zero scale

# safetensors header dtype names
_DTYPE_OF_NAME = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served. ``problems`` holds one line per problem, each
    naming the tensor, file or field and how to fix it."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"checkpoint {path}: {len(self.problems)} problem(s):\n{lines}")


# ------------------------------------------------------------------------ fp8 block (de)quant
def quantize_fp8_blockwise(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), pow2_scales: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's recipe: per-block amax / 448, rounded up to a power of two for ue8m0.

    Returns (e4m3 weight [out, in], fp32 dequantization scale [ceil(out/bo), ceil(in/bi)])."""
    out_features, in_features = weight.shape
    bo, bi = block
    rows, cols = math.ceil(out_features / bo), math.ceil(in_features / bi)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32)  # zeros leave amax unchanged
    padded[:out_features, :in_features] = weight.float()
    blocks = padded.view(rows, bo, cols, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(FP8_SCALE_AMAX_FLOOR) / FP8_E4M3_MAX  # [rows, cols]
    if pow2_scales:
        # From the exponent bits: fp32 log2 rounds 2^k * (1 + 2^-23) to exactly k, so
        # ceil(log2(s)) would round such a scale down and saturate the block's amax.
        mantissa, exponent = torch.frexp(scale)
        scale = torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)
    return q.view(rows * bo, cols * bi)[:out_features, :in_features].contiguous(), scale


def dequantize_fp8_blockwise(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """W[i, j] = W_fp8[i, j] * S[i // bo, j // bi] in fp32 (exact: e4m3 times a power of two)."""
    out_features, in_features = weight.shape
    bo, bi = block
    # Broadcast per row-block instead of expanding S to [out, in]: one fp32 copy of W at 671B sizes.
    col_scale = scale.float().repeat_interleave(bi, 1)[:, :in_features]  # [ceil(out/bo), in]
    w = weight.float()  # [out, in]
    whole = out_features // bo
    w[: whole * bo].view(whole, bo, in_features).mul_(col_scale[:whole, None, :])
    if whole * bo < out_features:  # partial edge block, e.g. kv_a's 576 = 4 * 128 + 64 rows
        w[whole * bo :].mul_(col_scale[whole])
    return w


# ------------------------------------------------------------------------------ the reader
class _Header(NamedTuple):
    shard: Path
    shape: tuple[int, ...]
    dtype_name: str  # safetensors name, e.g. "F8_E4M3"


class Checkpoint:
    """A validated checkpoint directory, read lazily.

    ``include_mtp=False``: the MTP layer is not needed, so missing MTP tensors are no error
    (present ones are still validated) and ``names()`` leaves them out."""

    def __init__(self, path: str | Path, include_mtp: bool = False) -> None:
        self.path = Path(path)
        self.include_mtp = include_mtp
        self._handles: dict[Path, object] = {}  # shard -> open safe_open handle
        problems: list[str] = []
        self.config: ModelConfig = self._read_config(problems)  # type: ignore[assignment]
        self.tokenizer_path = self.path / TOKENIZER_FILE
        if not self.tokenizer_path.is_file():
            problems.append(
                f"no {TOKENIZER_FILE} in {self.path}: copy tokenizer.json (and tokenizer_config.json) "
                "from the original model repository"
            )
        self._headers, reported = self._read_shards(problems)
        if self.config is not None:
            self._check_tensors(reported, problems)
        if problems:
            raise CheckpointError(self.path, problems)

    # -------------------------------------------------------------------------- public
    def names(self, include_scales: bool = False) -> list[str]:
        """Sorted names of the tensors in scope; ``weight_scale_inv`` only when asked."""
        return sorted(
            n
            for n in self._headers
            if (include_scales or not n.endswith(SCALE_SUFFIX))
            and (self.include_mtp or not is_mtp_tensor(self.config, n))
        )

    def is_fp8(self, name: str) -> bool:
        return self._header(name).dtype_name == "F8_E4M3"

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (fp8 weights stay fp8; their scale is ``raw(scale_name(name))``)."""
        header = self._header(name)
        handle = self._handles.get(header.shard)
        if handle is None:
            handle = self._handles[header.shard] = safe_open(str(header.shard), framework="pt")
        tensor = handle.get_tensor(name)
        _check_finite(self.path, name, header.shard, tensor)  # as each tensor is read: no extra pass
        return tensor

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor in ``dtype``; fp8 weights are dequantized with their block scale first."""
        if not self.is_fp8(name):
            return self.raw(name).to(dtype)
        block = self.config.fp8_weight_block
        return dequantize_fp8_blockwise(self.raw(name), self.raw(scale_name(name)), block).to(dtype)

    def fp8_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An fp8 Linear as stored: (e4m3 weight [out, in], fp32 scale [ceil(out/128), ceil(in/128)])."""
        if not self.is_fp8(name):
            raise ValueError(
                f"{name} is stored as {self._header(name).dtype_name}, not F8_E4M3: read it with get() "
                "(only the Linears of an fp8 block-quantized checkpoint have a weight_scale_inv)"
            )
        return self.raw(name), self.raw(scale_name(name)).float()

    def stacked_experts(
        self, layer: int, lo: int, hi: int, dequantise: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Routed experts lo..hi-1 of MoE ``layer`` in the layout of dsa::moe_experts, as stored:

        w13 [E, 2I, D] (gate_proj rows, then up_proj rows), w13_scale [E, 2*ceil(I/128), ceil(D/128)],
        w2 [E, D, I] (down_proj), w2_scale [E, ceil(D/128), ceil(I/128)]; e4m3 + fp32 scales for an
        fp8 checkpoint, bf16 with both scales None otherwise (or with ``dequantise``). Reads only
        these 3 * E tensors (and their scales), each once, into the stacked buffers."""
        w13, w13_scale, w2, w2_scale = self._stacked_as_stored(layer, lo, hi)
        if w13_scale is None or not dequantise:
            return w13, w13_scale, w2, w2_scale
        block = self.config.fp8_weight_block
        w13 = torch.stack([dequantize_fp8_blockwise(w, s, block).to(torch.bfloat16) for w, s in zip(w13, w13_scale)])
        w2 = torch.stack([dequantize_fp8_blockwise(w, s, block).to(torch.bfloat16) for w, s in zip(w2, w2_scale)])
        return w13, None, w2, None

    def _stacked_as_stored(
        self, layer: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        cfg = self.config
        if not cfg.first_k_dense_replace <= layer < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
            raise ValueError(
                f"layer {layer} has no routed experts: MoE layers are {cfg.first_k_dense_replace}.."
                f"{cfg.num_hidden_layers + cfg.num_nextn_predict_layers - 1} (first_k_dense_replace="
                f"{cfg.first_k_dense_replace})"
            )
        if not 0 <= lo < hi <= cfg.n_routed_experts:
            raise ValueError(f"experts [{lo}, {hi}) must be a non-empty range in [0, n_routed_experts={cfg.n_routed_experts}]")
        p = f"model.layers.{layer}.mlp.experts."
        first = p + f"{lo}.gate_proj.weight"
        fp8 = self.is_fp8(first)
        inter, hidden = self._header(first).shape
        if fp8 and inter % self.config.fp8_weight_block[0]:
            raise ValueError(
                f"moe_intermediate_size={inter} is not a multiple of the {self.config.fp8_weight_block[0]}-row "
                "scale block: gate and up would share a scale row once stacked; dsa::moe_experts needs I % 128 == 0"
            )
        n = hi - lo
        dtype = FP8 if fp8 else torch.bfloat16
        w13 = torch.empty(n, 2 * inter, hidden, dtype=dtype)
        w2 = torch.empty(n, hidden, inter, dtype=dtype)
        w13_scale = w2_scale = None
        if fp8:
            bo, bi = self.config.fp8_weight_block
            w13_scale = torch.empty(n, 2 * math.ceil(inter / bo), math.ceil(hidden / bi), dtype=torch.float32)
            w2_scale = torch.empty(n, math.ceil(hidden / bo), math.ceil(inter / bi), dtype=torch.float32)
        for i, e in enumerate(range(lo, hi)):
            names = [f"{p}{e}.{proj}_proj.weight" for proj in ("gate", "up", "down")]
            for name, dst, rows in ((names[0], w13, slice(0, inter)), (names[1], w13, slice(inter, 2 * inter)),
                                    (names[2], w2, slice(None))):
                if fp8:
                    weight, scale = self.fp8_weight(name)
                    dst[i, rows] = weight
                    scale_rows = slice(rows.start // bo, rows.stop // bo) if rows.stop else slice(None)
                    (w13_scale if dst is w13 else w2_scale)[i, scale_rows] = scale
                else:
                    dst[i, rows] = self.raw(name).to(torch.bfloat16)
        return w13, w13_scale, w2, w2_scale

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- validation
    def _header(self, name: str) -> _Header:
        if name not in self._headers or (not self.include_mtp and is_mtp_tensor(self.config, name)):
            raise KeyError(f"{name!r} is not a tensor of {self.path} (MTP tensors need include_mtp=True)")
        return self._headers[name]

    def _read_config(self, problems: list[str]) -> ModelConfig | None:
        try:
            return ModelConfig.from_json(self.path)
        except ConfigError as e:
            problems.append(f"{e} (the tensors were not checked against it)")
            return None

    def _shard_files(self, problems: list[str]) -> tuple[list[Path], dict[str, str] | None, dict[str, Path]]:
        """(shard files that exist, the index's weight_map if any, tensor -> its missing shard)."""
        index = self.path / INDEX_FILE
        if not index.is_file():
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                problems.append(f"no *.safetensors files and no {INDEX_FILE} in {self.path}")
            return shards, None, {}
        try:
            weight_map: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            problems.append(f"{INDEX_FILE} is unreadable or has no 'weight_map' ({e!r}); regenerate it")
            return [], None, {}
        present, missing_shard_of = [], {}
        for file in sorted(set(weight_map.values())):
            shard = self.path / file
            if shard.is_file():
                present.append(shard)
                continue
            names = sorted(n for n, f in weight_map.items() if f == file)
            missing_shard_of.update((n, shard) for n in names)
            problems.append(
                f"shard file {file} is missing: {INDEX_FILE} maps {len(names)} tensor(s) to it "
                f"(e.g. {names[0]}); download the file again"
            )
        return present, weight_map, missing_shard_of

    def _read_shards(self, problems: list[str]) -> tuple[dict[str, _Header], set[str]]:
        """Every stored tensor's header, and the names already reported through the index."""
        shards, weight_map, missing_shard_of = self._shard_files(problems)
        headers: dict[str, _Header] = {}
        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in f.keys():
                        view = f.get_slice(name)
                        if name in headers:
                            problems.append(
                                f"tensor {name} is stored twice ({headers[name].shard.name} and "
                                f"{shard.name}); remove one copy"
                            )
                        headers[name] = _Header(shard, tuple(view.get_shape()), view.get_dtype())
            except Exception as e:  # safetensors raises its own error types for corrupt files
                problems.append(f"shard {shard.name} is not a readable safetensors file ({e}); download it again")
        if weight_map is None:
            return headers, set()
        for name, header in headers.items():
            if weight_map.get(name) != header.shard.name:
                problems.append(
                    f"tensor {name} is in {header.shard.name} but {INDEX_FILE} maps it to "
                    f"{weight_map.get(name)}; regenerate the index"
                )
        for name, file in weight_map.items():
            if name not in headers and name not in missing_shard_of:
                problems.append(
                    f"missing tensor {name}: {INDEX_FILE} maps it to {file}, which does not hold it; "
                    "download that shard again or regenerate the index"
                )
        return headers, set(weight_map) - set(headers)

    def _check_tensors(self, reported: set[str], problems: list[str]) -> None:
        cfg = self.config
        specs = expected_tensors(cfg)
        fmt = "an fp8 block-quantized" if cfg.fp8_weight_block else "an unquantized (no quantization_config)"
        for name, spec in specs.items():
            header = self._headers.get(name)
            if header is None:
                if name in reported:
                    continue  # already reported with its shard or index entry
                if not self.include_mtp and is_mtp_tensor(cfg, name):
                    continue
                if name.endswith(SCALE_SUFFIX):
                    problems.append(
                        f"missing weight_scale_inv {name} for fp8 weight {name.removesuffix(SCALE_SUFFIX)}: "
                        f"config.json's quantization_config says every such Linear has a "
                        f"{list(spec.shape)} fp32 block scale; re-export the weight with its scale"
                    )
                else:
                    problems.append(
                        f"missing tensor {name} ({list(spec.shape)}): config.json implies it; "
                        "check that config.json belongs to these weights or re-export the checkpoint"
                    )
                continue
            if header.shape != spec.shape:
                problems.append(
                    f"wrong shape for {name}: stored {list(header.shape)}, config.json implies "
                    f"{list(spec.shape)}; config.json and the weights disagree"
                )
            dtype = _DTYPE_OF_NAME.get(header.dtype_name)
            if dtype not in spec.dtypes:
                problems.append(
                    f"wrong dtype for {name}: stored {header.dtype_name}, {fmt} checkpoint stores it as "
                    f"{' or '.join(_dtype_name(t) for t in spec.dtypes)}; re-export this tensor"
                )
        for name in sorted(set(self._headers) - set(specs)):
            problems.append(
                f"unexpected tensor {name} in {self._headers[name].shard.name}: not part of the "
                f"{cfg.model_type} layout for this config.json (num_hidden_layers={cfg.num_hidden_layers}, "
                f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}, "
                f"n_routed_experts={cfg.n_routed_experts}); check config.json or remove the tensor"
            )


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN/Inf elements; fp8 by bit pattern (e4m3fn has no Inf: NaN is S.1111.111). count_nonzero,
    not sum: a bool sum goes through int64, 8 bytes per element of the largest tensor in memory."""
    if t.dtype == torch.float8_e4m3fn:
        return int(torch.count_nonzero((t.view(torch.uint8) & 0x7F) == 0x7F))
    if t.dtype == torch.float8_e5m2:
        return int(torch.count_nonzero((t.view(torch.uint8) & 0x7C) == 0x7C))
    return int(torch.count_nonzero(~torch.isfinite(t))) if t.is_floating_point() else 0


def _check_finite(path: Path, name: str, shard: Path, t: torch.Tensor) -> None:
    bad = count_nonfinite(t)
    if bad:
        raise CheckpointError(path, [
            f"tensor {name} in {shard.name} holds {bad:,} NaN/Inf value(s) of {t.numel():,}; the weights are "
            "corrupt (a bad download or export): download that shard again or re-export the checkpoint"
        ])


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in _DTYPE_OF_NAME.items() if v == dtype)
