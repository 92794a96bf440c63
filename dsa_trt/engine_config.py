"""The engine-directory contract: what the builder writes, the runtime reads (docs/architecture.md §2).

engine_dir/
  engine_config.json        this schema
  rank<N>.<ext>             the general (sparse) program of rank N: .pt2 (AOTInductor) or .plan (TensorRT)
  rank<N>.dense.<ext>       the dense-prefill program (short fresh prompts), same compiler
  tokenizer.json            (+ tokenizer_config.json)
  quant/<recipe>.json       calibration artifact (fp8 cache mode)

Part of the contract layer (dsa_trt/*.py), which the runtime imports instead of the builder; the
check of the compiled packages themselves is dsa_trt/package_check.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsa_trt import __version__
from dsa_trt.cache_layout import CACHE_MODES, PAGE_SIZE
from dsa_trt.config import ModelConfig

ENGINE_FORMAT_VERSION = 1
ENGINE_CONFIG_NAME = "engine_config.json"
COMPILERS = {"aoti": "pt2", "tensorrt": "plan", "eager": "safetensors"}
DTYPES = ("bfloat16", "float32")


class EngineDirError(ValueError):
    """An engine directory cannot be loaded; the message names the file or field and the fix."""


@dataclass
class EngineConfig:
    model: ModelConfig
    cache_mode: str  # fp8 | bf16 | fp32
    dtype: str  # activation dtype of the compiled programs
    device: str  # "cuda" or "cpu": where the programs were compiled to run
    compiler: str  # aoti | tensorrt | eager
    tp_size: int = 1
    page_size: int = PAGE_SIZE
    max_num_tokens: int = 8192  # largest packed step the programs accept
    max_batch: int = 256
    max_pages_per_seq: int = 4096
    kv_scales: list[float] = field(default_factory=list)  # per layer; 1.0 in exact modes
    quant_recipe: str | None = None  # e.g. "fp8-kv-per-layer"
    tokenizer: str = "tokenizer.json"
    plugin_library: str | None = None  # TensorRT plugin library file name (tensorrt only)
    versions: dict = field(default_factory=dict)  # library versions at build time
    format_version: int = ENGINE_FORMAT_VERSION
    dsa_trt_version: str = __version__

    def __post_init__(self) -> None:
        problems = []
        if self.cache_mode not in CACHE_MODES:
            problems.append(f"cache_mode {self.cache_mode!r} not in {CACHE_MODES}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.compiler not in COMPILERS:
            problems.append(f"compiler {self.compiler!r} not in {tuple(COMPILERS)}")
        if self.tp_size < 1 or self.model.num_attention_heads % self.tp_size:
            problems.append(f"tp_size {self.tp_size} must divide num_attention_heads {self.model.num_attention_heads}")
        if self.page_size != PAGE_SIZE:
            problems.append(f"page_size {self.page_size}: this runtime supports {PAGE_SIZE}")
        if len(self.kv_scales) != self.model.num_hidden_layers:
            problems.append(f"kv_scales has {len(self.kv_scales)} entries for {self.model.num_hidden_layers} layers")
        if problems:
            raise EngineDirError("engine_config.json: " + "; ".join(problems))

    # derived
    @property
    def cache_bytes_per_token(self) -> int:
        return self.model.cache_bytes_per_token(self.cache_mode)

    def rank_file(self, rank: int, dense: bool = False) -> str:
        return f"rank{rank}{'.dense' if dense else ''}.{COMPILERS[self.compiler]}"

    # I/O
    def save(self, engine_dir: str | Path) -> Path:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        path = Path(engine_dir) / ENGINE_CONFIG_NAME
        path.write_text(json.dumps(d, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, engine_dir: str | Path, check_files: bool = True) -> "EngineConfig":
        engine_dir = Path(engine_dir)
        path = engine_dir / ENGINE_CONFIG_NAME
        if not engine_dir.is_dir():
            raise EngineDirError(f"{engine_dir}: not a directory; build one with `make engine OUT={engine_dir}`")
        if not path.is_file():
            raise EngineDirError(f"{path}: missing; is {engine_dir} an engine directory? (`make engine` writes it)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise EngineDirError(f"{path}: not valid JSON ({e}); rebuild the engine") from e
        version = d.get("format_version")
        if version != ENGINE_FORMAT_VERSION:
            raise EngineDirError(
                f"{path}: format_version {version} but this runtime reads {ENGINE_FORMAT_VERSION}; "
                f"rebuild the engine with this dsa_trt ({__version__})"
            )
        try:
            d["model"] = ModelConfig.from_dict(d["model"])
            cfg = cls(**d)
        except (TypeError, KeyError, ValueError) as e:
            raise EngineDirError(f"{path}: {e}") from e
        if check_files:
            cfg.check_files(engine_dir)
        return cfg

    def check_files(self, engine_dir: Path) -> None:
        missing = [self.rank_file(r) for r in range(self.tp_size) if not (engine_dir / self.rank_file(r)).is_file()]
        if self.compiler != "eager":
            missing += [
                self.rank_file(r, dense=True)
                for r in range(self.tp_size)
                if not (engine_dir / self.rank_file(r, dense=True)).is_file()
            ]
        if not (engine_dir / self.tokenizer).is_file():
            missing.append(self.tokenizer)
        if missing:
            raise EngineDirError(
                f"{engine_dir}: missing {', '.join(missing)} (tp_size={self.tp_size}, compiler={self.compiler}); "
                "the directory is incomplete: rebuild it with `make engine`"
            )
