"""The engine-directory contract: what the builder writes, the runtime reads (docs/architecture.md §2).

engine_dir/
  engine_config.json        this schema
  rank<N>.<ext>             the program of rank N (one step): .pt2 (AOTInductor) or .plan (TensorRT);
                            N in [0, world_size): tp_size ranks, or the ep/cp group (export/parallel.py)
  rank<N>.weights.safetensors  rank N's weights, outside its .pt2 (``weights: "safetensors"``;
                            dsa_trt/weights_file.py: names, dtypes and shapes of the program's constants)
  rank<N>.mtp.<ext>         the MTP draft program of rank N (export/mtp.py), when mtp_layers > 0
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
from dsa_trt.weights_file import weights_file_name

ENGINE_FORMAT_VERSION = 2  # 2: the MTP draft program's weights outside it (rank<N>.mtp.weights.safetensors)
ENGINE_CONFIG_NAME = "engine_config.json"
COMPILERS = {"aoti": "pt2", "tensorrt": "plan", "eager": "safetensors"}
DTYPES = ("bfloat16", "float32")
WEIGHTS_FORMATS = (None, "safetensors")
# How a checkpoint's e4m3 weights live in the programs: "fp8" kept e4m3 with their 128x128 scales
# (W8A8 linears, bf16 activations), "dequant" dequantised to the program dtype (and every bf16 checkpoint)
WEIGHT_FORMATS = ("fp8", "dequant")


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
    # expert / context parallelism over one group of world_size ranks (export/parallel.py): ep_size
    # splits the routed experts (exchanged by dsa::ep_all_to_all), cp_size interleaves each step's
    # tokens; ep_capacity: the exchange's pairs per destination and step (None: the step's worst case)
    ep_size: int = 1
    cp_size: int = 1
    ep_capacity: int | None = None
    page_size: int = PAGE_SIZE
    max_num_tokens: int = 8192  # largest packed step the programs accept
    max_batch: int = 256
    max_pages_per_seq: int = 4096
    kv_scales: list[float] = field(default_factory=list)  # per layer; 1.0 in exact modes
    quant_recipe: str | None = None  # e.g. "fp8-kv-per-layer"
    tokenizer: str = "tokenizer.json"
    plugin_library: str | None = None  # TensorRT plugin library file name (tensorrt only)
    # "safetensors": rank<N>.weights.safetensors (and the draft's rank<N>.mtp.weights.safetensors); None: inside
    # the programs (TensorRT plans)
    weights: str | None = None
    weight_format: str = "dequant"  # WEIGHT_FORMATS; engines written before the field were all "dequant"
    # MTP layers compiled as the draft program rank<N>.mtp.<ext> (speculative decoding); the main
    # programs then also return the ``hidden`` output (dsa_trt/step.py). 0: no draft program.
    mtp_layers: int = 0
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
        problems += parallel_problems(self.model, self.tp_size, self.ep_size, self.cp_size, self.ep_capacity,
                                      self.max_num_tokens)
        if self.mtp_layers and self.ep_size * self.cp_size > 1:
            problems.append(f"mtp_layers {self.mtp_layers} with ep_size {self.ep_size} / cp_size {self.cp_size}: "
                            "expert / context-parallel engines have no MTP draft program (build them with --no-mtp)")
        if self.page_size != PAGE_SIZE:
            problems.append(f"page_size {self.page_size}: this runtime supports {PAGE_SIZE}")
        if self.weights not in WEIGHTS_FORMATS:
            problems.append(f"weights {self.weights!r} not in {WEIGHTS_FORMATS}")
        if self.weight_format not in WEIGHT_FORMATS:
            problems.append(f"weight_format {self.weight_format!r} not in {WEIGHT_FORMATS}")
        elif self.weight_format == "fp8" and (self.dtype != "bfloat16" or self.model.fp8_weight_block is None):
            problems.append(f"weight_format 'fp8' needs dtype bfloat16 and an fp8-block model (dtype {self.dtype!r}, "
                            f"fp8_weight_block {self.model.fp8_weight_block}); rebuild the engine")
        if not 0 <= self.mtp_layers <= self.model.num_nextn_predict_layers:
            problems.append(f"mtp_layers {self.mtp_layers} not in [0, num_nextn_predict_layers "
                            f"{self.model.num_nextn_predict_layers}]")
        if len(self.kv_scales) != self.model.num_hidden_layers:
            problems.append(f"kv_scales has {len(self.kv_scales)} entries for {self.model.num_hidden_layers} layers")
        if problems:
            raise EngineDirError("engine_config.json: " + "; ".join(problems))

    # derived
    @property
    def world_size(self) -> int:
        """Ranks to launch: one process (and one rank<N> program) each."""
        return max(self.tp_size, self.ep_size, self.cp_size)

    @property
    def layout(self) -> str:
        """The parallel layout in words, e.g. "tp=2" or "ep=2 x cp=2" ("one rank" when none)."""
        parts = [f"{k}={v}" for k, v in (("tp", self.tp_size), ("ep", self.ep_size), ("cp", self.cp_size)) if v > 1]
        return " x ".join(parts) or "one rank"

    @property
    def cache_bytes_per_token(self) -> int:
        return self.model.cache_bytes_per_token(self.cache_mode)

    def rank_file(self, rank: int) -> str:
        return f"rank{rank}.{COMPILERS[self.compiler]}"

    def rank_weights_file(self, rank: int) -> str | None:
        """The file of rank ``rank``'s weights, or None when they are inside its program."""
        return weights_file_name(rank) if self.weights == "safetensors" else None

    def draft_file(self, rank: int) -> str:
        """The MTP draft program of rank ``rank`` (present when mtp_layers > 0)."""
        return f"rank{rank}.mtp.{COMPILERS[self.compiler]}"

    def draft_weights_file(self, rank: int) -> str | None:
        """The file of the draft program's weights (those it does not share with the main program),
        or None when there is no draft program or its weights are inside it."""
        return weights_file_name(rank, draft=True) if self.weights == "safetensors" and self.mtp_layers else None

    def rank_files(self, rank: int) -> list[str]:
        """Every file rank ``rank`` loads: its program, its weights when apart, its draft program
        and the draft's weights when apart."""
        return [f for f in (self.rank_file(rank), self.rank_weights_file(rank),
                            self.draft_file(rank) if self.mtp_layers else None, self.draft_weights_file(rank)) if f]

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
            if verify_mode() != "off" and (manifest := read_manifest(engine_dir)) is not None:
                check_config_tie(engine_dir, json.loads(path.read_text()), manifest)  # cheap: no hashing
        return cfg

    def check_files(self, engine_dir: Path) -> None:
        missing = [f for r in range(self.world_size) for f in self.rank_files(r) if not (engine_dir / f).is_file()]
        if not (engine_dir / self.tokenizer).is_file():
            missing.append(self.tokenizer)
        if missing:
            raise EngineDirError(
                f"{engine_dir}: missing {', '.join(missing)} ({self.layout}, compiler={self.compiler}); "
                "the directory is incomplete: rebuild it with `make engine`"
            )


def parallel_problems(model: ModelConfig, tp: int, ep: int, cp: int, ep_capacity: int | None = None,
                      max_num_tokens: int | None = None) -> list[str]:
    """What is wrong with a tp / ep / cp layout (empty: it can be built and served). One list for
    the builder (before any work) and engine_config.json (on load)."""
    if min(tp, ep, cp) < 1:
        return [f"tp={tp}, ep={ep}, cp={cp}: each must be >= 1"]
    problems = []
    if tp > 1 and ep * cp > 1:
        problems.append(f"tp={tp} with ep={ep} / cp={cp}: expert / context parallelism replicates the attention; "
                        "combining it with tensor parallelism is not implemented (use either --tp or --ep/--cp)")
    if ep > 1 and cp > 1 and ep != cp:
        problems.append(f"ep={ep} and cp={cp}: both run over one group of ranks; give them the same size")
    if ep > 1 and cp == 1:
        # every rank would receive the same step: correct, but each (token, expert) pair would be
        # computed ep times; context parallelism gives each rank its own share of the tokens
        problems.append(f"ep={ep} without cp: expert parallelism is served with context-parallel attention over "
                        f"the same ranks; build with --ep {ep} --cp {ep}")
    if ep > 1 and model.n_routed_experts % ep:
        problems.append(f"ep={ep} does not divide n_routed_experts = {model.n_routed_experts}; choose an "
                        "expert-parallel size that divides it")
    if ep_capacity is not None and (ep == 1 or ep_capacity < 1):
        problems.append(f"ep_capacity {ep_capacity}: needs ep > 1 and a value >= 1 (or none: the step's worst case)")
    if cp > 1 and max_num_tokens is not None and max_num_tokens % cp:
        problems.append(f"max_num_tokens {max_num_tokens} is not a multiple of cp={cp}: a context-parallel step "
                        "is padded to a multiple of cp; choose a multiple")
    return problems


# ------------------------------------------------------------------------------ the manifest
# manifest.json, written by the builder last: the size and sha256 of every file of the directory
# and the engine_config.json the compiled programs were built from ("built_with"; each program's
# entry names that config's hash). Engine.load checks it (verify_engine_files), so a flipped bit, a
# swapped or replaced program, or an edited engine_config.json is an error naming the file or field.
#
# Cost: sha256 streams each file in HASH_CHUNK pieces, one thread per file (hashlib releases the
# GIL), and reads only the files of the loading rank (its two programs, tokenizer, quant, plugin).
# At ~1.5-2 GB/s per core with SHA extensions, a 700 GB tp=8 engine hashes ~88 GB per rank: about
# 25 s per rank on 2 threads, or the disk's read time when slower (700 GB at 7 GB/s is ~100 s, in
# which the page cache is warmed for the load that follows). DSA_VERIFY_ENGINE=size checks sizes and
# the config tie only (milliseconds; misses a flipped bit); =off skips the manifest.
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
HASH_CHUNK = 8 << 20
HASH_THREADS = 4
VERIFY_MODES = ("full", "size", "off")


def config_sha256(raw: dict) -> str:
    """Hash of an engine_config.json's content (key order and whitespace do not matter)."""
    import hashlib

    return hashlib.sha256(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _hash_files(paths: list[Path]) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(paths)))) as pool:
        return list(pool.map(file_sha256, paths))


def write_manifest(engine_dir: str | Path, cfg: EngineConfig) -> Path:
    """Record every file of ``engine_dir`` (engine_config.json already saved, manifest excepted)."""
    engine_dir = Path(engine_dir)
    raw = json.loads((engine_dir / ENGINE_CONFIG_NAME).read_text())
    tie = config_sha256(raw)
    programs = {f for r in range(cfg.world_size) for f in cfg.rank_files(r)}
    names = sorted(p.relative_to(engine_dir).as_posix() for p in engine_dir.rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME and p.parent.name != "__pycache__"
                   and p.relative_to(engine_dir).as_posix() != ENGINE_CONFIG_NAME)
    digests = _hash_files([engine_dir / n for n in names])
    files = {}
    for name, digest in zip(names, digests):
        files[name] = {"size": (engine_dir / name).stat().st_size, "sha256": digest}
        if name in programs:
            files[name]["built_from"] = tie
    manifest = {"format": MANIFEST_FORMAT, "config_sha256": tie, "built_with": raw, "files": files}
    path = engine_dir / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def read_manifest(engine_dir: Path) -> dict | None:
    path = engine_dir / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
        if m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), dict):
            raise ValueError(f"format {m.get('format')!r}, this runtime reads {MANIFEST_FORMAT}")
        m["built_with"], m["config_sha256"]  # noqa: B018 - both must be there
        return m
    except (json.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise EngineDirError(f"{path}: unreadable manifest ({type(e).__name__}: {e}); rebuild the engine") from None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def check_config_tie(engine_dir: Path, raw: dict, manifest: dict) -> None:
    """engine_config.json must be the config the programs were compiled from."""
    if config_sha256(raw) == manifest["config_sha256"]:
        return
    now, then = _flat(raw), _flat(manifest["built_with"])
    diff = [f"{k} is {now.get(k, '(absent)')!r} but the programs were built with {then.get(k, '(absent)')!r}"
            for k in sorted(set(now) | set(then)) if now.get(k) != then.get(k)]
    raise EngineDirError(
        f"{engine_dir / ENGINE_CONFIG_NAME}: does not match the config its compiled programs were built from "
        f"({MANIFEST_NAME}): {'; '.join(diff[:6]) or 'content differs'}; the programs bake these values in: "
        "restore the file or rebuild the engine"
    )


def verify_mode(mode: str | None = None) -> str:
    import os

    raw = mode if mode is not None else os.environ.get("DSA_VERIFY_ENGINE", "full")
    if raw.strip().lower() not in VERIFY_MODES:
        raise EngineDirError(f"DSA_VERIFY_ENGINE={raw!r} must be one of {', '.join(VERIFY_MODES)}")
    return raw.strip().lower()


def verify_engine_files(engine_dir: str | Path, cfg: EngineConfig, rank: int = 0, mode: str | None = None) -> None:
    """Check the files rank ``rank`` loads against manifest.json (mode: DSA_VERIFY_ENGINE)."""
    engine_dir = Path(engine_dir)
    mode = verify_mode(mode)
    if mode == "off":
        return
    manifest = read_manifest(engine_dir)
    if manifest is None:
        import warnings

        warnings.warn(f"{engine_dir}: no {MANIFEST_NAME} (an engine built before manifests): its files are not "
                      "verified; rebuild it to get one", RuntimeWarning, stacklevel=2)
        return
    check_config_tie(engine_dir, json.loads((engine_dir / ENGINE_CONFIG_NAME).read_text()), manifest)
    files = manifest["files"]
    mine = set(cfg.rank_files(rank))
    others = {f for r in range(cfg.world_size) for f in cfg.rank_files(r)} - mine
    # this rank's programs and the shared files; other ranks' programs and the ONNX are not loaded here
    names = sorted(n for n in files if n not in others and not n.startswith("onnx/"))
    for name in sorted(mine - set(files)):
        if (engine_dir / name).is_file():
            raise EngineDirError(f"{engine_dir / name}: not in {MANIFEST_NAME}; rebuild the engine")
    for name in names:
        path = engine_dir / name
        if not path.is_file():
            raise EngineDirError(f"{path}: listed in {MANIFEST_NAME} but missing; rebuild the engine")
        if files[name].get("built_from", manifest["config_sha256"]) != manifest["config_sha256"]:
            raise EngineDirError(f"{path}: compiled from another engine_config.json than this directory's "
                                 f"({MANIFEST_NAME}); rebuild the engine")
    digests = _hash_files([engine_dir / n for n in names]) if mode == "full" else [None] * len(names)
    by_digest = {e["sha256"]: n for n, e in files.items()}
    for name, digest in zip(names, digests):
        path, entry = engine_dir / name, files[name]
        size = path.stat().st_size
        if digest is not None and digest != entry["sha256"]:
            other = by_digest.get(digest)
            hint = (f"it holds what {MANIFEST_NAME} records for {other} (files swapped or copied over?)" if other
                    else "its content changed since the build (corruption, or an edit)")
            raise EngineDirError(f"{path}: sha256 {digest[:16]}... does not match {MANIFEST_NAME} "
                                 f"({entry['sha256'][:16]}..., {size:,} vs {entry['size']:,} bytes): {hint}; "
                                 "rebuild the engine or restore the file (DSA_VERIFY_ENGINE=size|off skips this)")
        if size != entry["size"]:
            raise EngineDirError(f"{path}: {size:,} bytes but {MANIFEST_NAME} recorded {entry['size']:,}; the file "
                                 "was replaced or truncated: rebuild the engine (or restore the file)")
