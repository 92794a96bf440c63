"""Triton model repository for an engine directory (docs/architecture.md §6).

    repo/<name>/config.pbtxt       python backend, decoupled: TRT-LLM request schema (schema.py)
    repo/<name>/1/model.py         this package's model.py: AsyncLLM over the engine directory
    repo/<name>_step/...           engines of TensorRT plans only: a `tensorrt_plan` model of the
                                   program (one forward step), needing the plugin library

A `tensorrt_plan` model is one engine step over caller-held caches; generation (scheduling, paged
caches, sampling) lives in the python model, as in tensorrtllm_backend. The plugin library is
loaded by the TensorRT backend from the server command line (`server_args`).
"""

from __future__ import annotations

import shutil
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsa_trt.cache_layout import BYTES_PER_INT32, PAGE_SIZE, index_page_shape, mla_page_shape
from dsa_trt.engine_config import EngineConfig, EngineDirError
from dsa_trt.step import HIDDEN, LOGITS, POOL_OUTPUT_SUFFIX, STEP_FIELDS, pool_input_name

from .schema import INPUTS, OUTPUTS, Field

MODEL_PY = Path(__file__).resolve().parent / "model.py"
# the step fields' dtypes as Triton data types
TRITON_TYPES = {torch.int64: "TYPE_INT64", torch.int32: "TYPE_INT32"}


@dataclass
class ModelRepository:
    path: Path
    models: list[str]
    server_args: list[str] = field(default_factory=list)  # e.g. --backend-config=tensorrt,plugins=...


def _pbtxt_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _tensor_block(kind: str, fields: tuple[Field, ...] | list[Field]) -> str:
    rows = []
    for f in fields:
        opt = " optional: true" if f.optional and kind == "input" else ""
        dims = ", ".join(str(d) for d in f.dims)
        rows.append(f"  {{ name: {_pbtxt_str(f.name)} data_type: {f.data_type} dims: [ {dims} ]{opt} }}")
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def _parameters(params: dict[str, str]) -> str:
    return "".join(f"parameters {{ key: {_pbtxt_str(k)} value {{ string_value: {_pbtxt_str(v)} }} }}\n"
                   for k, v in params.items())


def python_model_config(name: str, engine_dir: Path, num_pages: int | None = None,
                        site_packages: list[str] | None = None, max_model_len: int | None = None,
                        launch_id: str | None = None, speculative: str | None = None) -> str:
    """config.pbtxt of the decoupled python model. max_batch_size 1: every request carries a batch
    dimension of 1 (Triton's OpenAI frontend sends [[prompt]]) and Triton refuses larger ones.

    max_model_len (advertised in the model's config, GET /v2/models/<name>/config): what one request
    can hold, prompt + max_tokens; model.py refuses to load when its pool holds another number.
    launch_id: lets the launcher tell its own server from another one on the same port."""
    params = {
        "engine_dir": str(engine_dir),
        # the stub runs the system libpython: model.py adds these (with their .pth files) to sys.path
        "site_packages": ":".join(site_packages if site_packages is not None else interpreter_site_packages()),
    }
    if num_pages is not None:
        params["num_pages"] = str(num_pages)
    if max_model_len is not None:
        params["max_model_len"] = str(max_model_len)
    if launch_id is not None:
        params["launch_id"] = launch_id
    if speculative:  # LLM(speculative=...): "mtp" or "mtp:N" (runtime/speculative.py)
        params["speculative"] = speculative
    return (
        f"name: {_pbtxt_str(name)}\n"
        'backend: "python"\n'
        "max_batch_size: 1\n"
        "model_transaction_policy { decoupled: true }\n"
        + _tensor_block("input", INPUTS)
        + _tensor_block("output", OUTPUTS)
        # one instance: it owns the engine and the caches and batches requests itself (AsyncLLM)
        + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        + _parameters(params)
    )


def step_model_io(cfg: EngineConfig) -> tuple[list[Field], list[Field]]:
    """Inputs and outputs of one engine step as a TensorRT plan, named by the step contract
    (dsa_trt/step.py) as builder/onnx_export.py names them: the StepInputs fields in order (every
    dim dynamic), then mla_pools_<l>, index_pools_<l>; outputs ``logits`` and ``<pool>_out``
    (aliased to the pool input). fp8 pools use the INT32 carrier (PLUGINS.md)."""
    m = cfg.model
    ins = [Field(f.name, TRITON_TYPES[f.dtype], (-1,) * len(f.dims), optional=False) for f in STEP_FIELDS]
    mla, idx = mla_page_shape(cfg.cache_mode), index_page_shape(cfg.cache_mode)
    if cfg.cache_mode == "fp8":
        dtype = "TYPE_INT32"
        mla, idx = (mla[:-1] + (mla[-1] // BYTES_PER_INT32,)), (idx[:-1] + (idx[-1] // BYTES_PER_INT32,))
    elif cfg.cache_mode == "bf16":
        dtype = "TYPE_BF16"
    else:
        raise EngineDirError(f"cache_mode {cfg.cache_mode!r}: the TensorRT plugins take fp8 or bf16 caches")
    pools = []
    for layer in range(m.num_hidden_layers):
        pools += [Field(pool_input_name("mla_pools", layer), dtype, (-1, *mla), optional=False),
                  Field(pool_input_name("index_pools", layer), dtype, (-1, *idx), optional=False)]
    outs = [Field(LOGITS, "TYPE_FP32", (-1, m.vocab_size))]
    if cfg.mtp_layers:  # the main program's final-norm states: the draft program's input (dsa_trt/step.py)
        outs.append(Field(HIDDEN, "TYPE_BF16" if cfg.dtype == "bfloat16" else "TYPE_FP32", (-1, m.hidden_size)))
    outs += [Field(f"{p.name}{POOL_OUTPUT_SUFFIX}", p.data_type, p.dims) for p in pools]
    return ins + pools, outs


def tensorrt_step_config(name: str, cfg: EngineConfig, rank: int = 0) -> str:
    ins, outs = step_model_io(cfg)
    return (
        f"name: {_pbtxt_str(name)}\n"
        'platform: "tensorrt_plan"\n'
        "max_batch_size: 0\n"  # shapes are the step's own (packed tokens, pages): no batch dimension
        + _tensor_block("input", ins)
        + _tensor_block("output", outs)
        + f"instance_group [ {{ kind: KIND_GPU count: 1 gpus: [ {rank} ] }} ]\n"
    )


def plugin_backend_args(engine_dir: Path, cfg: EngineConfig) -> list[str]:
    lib = (engine_dir / cfg.plugin_library) if cfg.plugin_library else None
    if lib is None or not lib.is_file():
        raise EngineDirError(f"{engine_dir}: TensorRT engine without its plugin library "
                             f"(engine_config.json plugin_library={cfg.plugin_library!r}); rebuild the engine")
    return [f"--backend-config=tensorrt,plugins={lib.resolve()}"]


def expected_max_model_len(cfg: EngineConfig, num_pages: int | None) -> int | None:
    """LLM.max_model_len for this engine and pool (None: a CUDA pool sized from free memory at load)."""
    if num_pages is None:
        from dsa_trt.runtime import knobs
        from dsa_trt.runtime.llm import DEFAULT_CPU_PAGES

        num_pages = knobs.get("DSA_NUM_PAGES") or (DEFAULT_CPU_PAGES if cfg.device != "cuda" else None)
    if num_pages is None:
        return None
    return min(cfg.model.max_position_embeddings, cfg.max_pages_per_seq * PAGE_SIZE, num_pages * PAGE_SIZE)


def write_model_repository(engine_dir: str | Path, repo_dir: str | Path, model_name: str = "dsa_trt",
                           num_pages: int | None = None, site_packages: list[str] | None = None,
                           launch_id: str | None = None, speculative: str | None = None) -> ModelRepository:
    """Write (or overwrite) the models of ``engine_dir`` into ``repo_dir``; returns what was written
    and the tritonserver arguments it needs."""
    engine_dir = Path(engine_dir).resolve()
    repo = Path(repo_dir)
    cfg = EngineConfig.load(engine_dir)
    if speculative:
        from dsa_trt.runtime.speculative import parse_speculative

        parse_speculative(speculative)  # a bad value fails here, not when the server loads the model
        if not cfg.mtp_layers:
            raise EngineDirError(f"{engine_dir}: speculative={speculative!r} but the engine has no MTP draft program "
                                 "(engine_config.json mtp_layers=0); rebuild it with its MTP layer")
    if cfg.world_size != 1:  # the python model holds one in-process engine; no rank launcher behind it yet
        raise EngineDirError(f"{engine_dir}: {cfg.world_size} ranks ({cfg.layout}); the Triton model serves "
                             "one-rank engines only: run this one with `dsa-trt generate --engine DIR`")
    repo.mkdir(parents=True, exist_ok=True)
    _write_model(repo / model_name, python_model_config(model_name, engine_dir, num_pages, site_packages,
                                                        expected_max_model_len(cfg, num_pages), launch_id,
                                                        speculative))
    shutil.copy(MODEL_PY, repo / model_name / "1" / "model.py")
    written = ModelRepository(repo, [model_name])
    if cfg.compiler == "tensorrt":
        written.server_args = plugin_backend_args(engine_dir, cfg)
        name = model_name + "_step"
        d = _write_model(repo / name, tensorrt_step_config(name, cfg))
        (d / "1" / "model.plan").unlink(missing_ok=True)
        (d / "1" / "model.plan").symlink_to((engine_dir / cfg.rank_file(0)).resolve())
        written.models.append(name)
    return written


def _write_model(model_dir: Path, config: str) -> Path:
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config)
    return model_dir


def interpreter_site_packages() -> list[str]:
    """This interpreter's site-packages (the venv's when run from it), dsa_trt's included."""
    paths = [p for p in site.getsitepackages() if Path(p).is_dir()]
    return paths or [p for p in sys.path if p.endswith("site-packages")]
