"""ONNX (builder/onnx_export.py) -> TensorRT plan, with our plugin library loaded (docs/architecture.md §2).

Thin by design: everything decidable without TensorRT (the plugin contract of the graph, the
optimisation-profile shapes, where the plugin library is) is plain Python below and is tested on
every machine; ``build_plan`` only drives the TensorRT builder and needs ``import tensorrt``.

Plan settings:
* strongly typed network (TensorRT 11: always; 10.x: the STRONGLY_TYPED creation flag), so the
  graph's dtypes (bf16 activations, the explicit FP8 Q of the indexer query) are the engine's;
* ``PreviewFeature.ALIASED_PLUGIN_IO_10_03``: the cache-write plugins' outputs alias their pool
  inputs (PLUGINS.md "Aliasing"); TensorRT honours getAliasedInput only with it;
* one optimisation profile over the named dynamic dims of the graph (``Profile``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx

from .onnx_export import tensorrt_problems

REPO = Path(__file__).resolve().parents[1]
PLUGIN_LIB_KNOB = "DSA_TRT_PLUGIN_LIB"  # the same knob as tests/test_tensorrt_plugins.py
PLUGIN_LIB_NAME = "libdsa_trt_plugins.so"
KERNEL_LIB_NAME = "libdsa_kernels.so"  # the plugin library's RUNPATH is $ORIGIN: it travels alongside
MAX_TENSOR_VOLUME = 2**31 - 1  # TensorRT's element limit for most layers; bounds the pool-pages profile


class TensorRTBuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Profile:
    """min / opt / max of every named dynamic dim (export/program.py's Dim names).

    opt is what TensorRT tunes its kernels for: a mid-size mixed step. ``pool_pages`` max defaults
    to the largest pool whose tensors stay under TensorRT's 2^31-element limit (``max_pool_pages``).
    """

    tokens: tuple[int, int, int] = (1, 256, 8192)
    batch: tuple[int, int, int] = (1, 32, 256)
    pages_per_seq: tuple[int, int, int] = (1, 32, 4096)
    logit_rows: tuple[int, int, int] = (1, 32, 8192)
    pool_pages: tuple[int, int, int] | None = None

    @classmethod
    def from_limits(cls, max_num_tokens: int, max_batch: int, max_pages_per_seq: int,
                    max_pool_pages: int | None = None) -> "Profile":
        return cls(_dim(1, 256, max_num_tokens), _dim(1, 32, max_batch), _dim(1, 32, max_pages_per_seq),
                   _dim(1, 32, max_num_tokens), _dim(2, 4096, max_pool_pages) if max_pool_pages else None)

    def dims(self, model: onnx.ModelProto) -> dict[str, tuple[int, int, int]]:
        return {"tokens": self.tokens, "batch": self.batch, "pages_per_seq": self.pages_per_seq,
                "logit_rows": self.logit_rows, "pool_pages": self.pool_pages or _dim(2, 4096, max_pool_pages(model))}


def _dim(lo: int, opt: int, hi: int) -> tuple[int, int, int]:
    return lo, max(lo, min(opt, hi)), hi


def max_pool_pages(model: onnx.ModelProto) -> int:
    """The most pool pages for which every pool input stays within MAX_TENSOR_VOLUME elements."""
    per_page = [_volume(v, skip="pool_pages") for v in model.graph.input if _dim_names(v)[:1] == ["pool_pages"]]
    return MAX_TENSOR_VOLUME // max(per_page) if per_page else 2


def _dim_names(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _volume(value: onnx.ValueInfoProto, skip: str) -> int:
    n = 1
    for d in _dim_names(value):
        if d != skip:
            n *= int(d)
    return n


def profile_shapes(model: onnx.ModelProto, profile: Profile) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shape of every graph input, from its named dims; an unknown name is an error."""
    dims = profile.dims(model)
    shapes = {}
    for v in model.graph.input:
        names = _dim_names(v)
        unknown = [d for d in names if isinstance(d, str) and d not in dims]
        if unknown or any(d == 0 for d in names):
            raise TensorRTBuildError(f"input {v.name} has dims {names}: no profile for {unknown or 'unnamed dims'}")
        shapes[v.name] = tuple(tuple(dims[d][i] if isinstance(d, str) else d for d in names) for i in range(3))
    return shapes


def plugin_library() -> Path:
    """$DSA_TRT_PLUGIN_LIB, else build/libdsa_trt_plugins.so (`make trt-plugins`)."""
    lib = Path(os.environ.get(PLUGIN_LIB_KNOB) or REPO / "build" / PLUGIN_LIB_NAME)
    if not lib.is_file():
        raise FileNotFoundError(f"{lib}: the TensorRT plugin library is not built; run `make trt-plugins` "
                                f"(TENSORRT_ROOT=...) or point {PLUGIN_LIB_KNOB} at it")
    return lib


def install_plugin_library(engine_dir: Path, lib: Path | None = None) -> str:
    """Copy the plugin library (and the kernel library it links, found beside it) into the engine
    directory; returns the file name engine_config.json records."""
    lib = lib or plugin_library()
    shutil.copy2(lib, engine_dir / PLUGIN_LIB_NAME)
    kernels = lib.parent / KERNEL_LIB_NAME
    if not kernels.is_file():
        raise FileNotFoundError(f"{kernels}: {lib.name} needs the kernel library beside it (`make kernels`)")
    shutil.copy2(kernels, engine_dir / KERNEL_LIB_NAME)
    return PLUGIN_LIB_NAME


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as e:
        raise TensorRTBuildError(f"`import tensorrt` fails ({e}); build with --compiler aoti here") from e
    if not hasattr(trt, "Builder"):
        raise TensorRTBuildError("the `tensorrt` module found is not TensorRT's Python package (no trt.Builder)")
    return trt


def build_plan(onnx_path: str | Path, plan_path: str | Path, plugin_lib: str | Path, profile: Profile,
               workspace_bytes: int | None = None) -> Path:
    """Parse the ONNX with the plugin library registered, build a strongly typed plan, write it."""
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    problems = tensorrt_problems(model)
    if problems:
        raise TensorRTBuildError(f"{onnx_path.name} does not meet the plugin contract:\n  " + "\n  ".join(problems))
    shapes = profile_shapes(model, profile)
    trt = _import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    registry = builder.get_plugin_registry()
    if registry.load_library(str(plugin_lib)) is None:  # getCreators(): the creators of namespace dsa
        raise TensorRTBuildError(f"{plugin_lib}: IPluginRegistry::loadLibrary failed (see the TensorRT log)")
    flags = 0
    if int(trt.__version__.split(".")[0]) < 11:  # TensorRT 11 networks are always strongly typed
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n  ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TensorRTBuildError(f"{onnx_path.name}: the ONNX parser failed:\n  {errors}")
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    opt_profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        opt_profile.set_shape(name, *shapes[name])
    config.add_optimization_profile(opt_profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TensorRTBuildError(f"{onnx_path.name}: TensorRT could not build a plan (its log above says why)")
    plan_path.write_bytes(bytes(plan))
    return plan_path
