"""TensorRT plans as engine programs: ``load_plan(...)(*step_tensors, mla_pools, index_pools) -> logits [, hidden]``.

The same call as an AOTInductor program (runtime/engine.py). A thin adapter: it binds the device
pointers of the caller's torch tensors to the plan's I/O tensors by name, sets the step's input
shapes and enqueues on the current CUDA stream; nothing is copied on the way in.

Names and layouts are those of the step contract (dsa_trt/step.py), which the ONNX graph
(builder/onnx_export.py; this module does not import the builder) also follows: inputs
``STEP_INPUT_NAMES``, then ``mla_pools_<l>`` and ``index_pools_<l>``; outputs ``logits`` and
``<pool>_out``. An fp8-mode byte
pool is bound through a free view in the plan's carrier dtype (INT32: ``pool.view(torch.int32)``).
A ``<pool>_out`` output that the plan aliases to its pool input (the cache-write plugins'
getAliasedInput) is bound to the same buffer: the step writes the caller's pool in place.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from dsa_trt.engine_config import EngineConfig, EngineDirError
from dsa_trt.step import (DRAFT_HIDDEN_INPUT, LOGITS, POOL_INPUTS, POOL_OUTPUT_SUFFIX, STEP_INPUT_NAMES,
                          STEP_OUTPUTS, pool_input_name)

STEP_INPUTS = STEP_INPUT_NAMES  # the plan's step bindings, in the program's positional order

_loaded_libraries: dict[str, object] = {}  # plugin library path -> registry handle: once per process


def _tensorrt():
    try:
        import tensorrt as trt
    except ImportError as e:
        raise EngineDirError(f"this engine directory holds TensorRT plans but `import tensorrt` fails ({e}); "
                             "install TensorRT or rebuild the engine with --compiler aoti") from e
    return trt


def _torch_dtypes(trt) -> dict:
    return {trt.float32: torch.float32, trt.bfloat16: torch.bfloat16, trt.float16: torch.float16,
            trt.int32: torch.int32, trt.int64: torch.int64, trt.int8: torch.int8, trt.uint8: torch.uint8,
            trt.bool: torch.bool, trt.fp8: torch.float8_e4m3fn}


def _load_plugin_library(trt, path: Path) -> None:
    key = str(path.resolve())
    if key in _loaded_libraries:
        return
    if not path.is_file():
        raise EngineDirError(f"{path}: the engine's TensorRT plugin library is missing; rebuild the engine")
    handle = trt.get_plugin_registry().load_library(key)
    if handle is None:
        raise EngineDirError(f"{path}: TensorRT could not load this plugin library (see the TensorRT log)")
    _loaded_libraries[key] = handle


class TensorRTProgram:
    """One deserialised plan with its execution context; callable like an AOTInductor program."""

    def __init__(self, trt, engine, path: Path, logger, runtime):
        self._logger, self._runtime = logger, runtime  # TensorRT holds pointers to both: keep them alive
        self.engine, self.path = engine, path
        self.context = engine.create_execution_context()
        if self.context is None:
            raise EngineDirError(f"{path}: cannot create an execution context (out of device memory?)")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        is_input = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        dtypes = _torch_dtypes(trt)
        self.inputs = {n: dtypes[engine.get_tensor_dtype(n)] for n in names if is_input[n]}
        self.outputs = {n: dtypes[engine.get_tensor_dtype(n)] for n in names if not is_input[n]}
        if LOGITS not in self.outputs:
            raise EngineDirError(f"{path}: the plan has no `{LOGITS}` output (outputs: {sorted(self.outputs)})")
        # <pool>_out -> <pool> when TensorRT updates the pool in place, else None (it writes a copy)
        aliased_input = getattr(engine, "get_aliased_input_tensor", lambda name: None)  # TensorRT >= 10.5
        self.aliased = {n: aliased_input(n) for n in self.outputs if n not in STEP_OUTPUTS}
        self.draft = DRAFT_HIDDEN_INPUT in self.inputs  # an MTP draft plan: the hidden input after the step
        copies = [n for n, src in self.aliased.items() if src is None]
        if copies:
            warnings.warn(f"{path.name}: TensorRT does not alias {len(copies)} pool output(s) to their inputs "
                          f"(e.g. {copies[0]}): every step copies those pools back (a full pool copy per layer). "
                          "Rebuild with a TensorRT that honours PreviewFeature.ALIASED_PLUGIN_IO_10_03.",
                          stacklevel=3)
        self.max_pool_pages = min((engine.get_tensor_profile_shape(n, 0)[2][0] for n in self.inputs
                                   if "_pools_" in n), default=None)

    def __call__(self, *args) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        names = STEP_INPUTS + ((DRAFT_HIDDEN_INPUT,) if self.draft else ())
        step, pools = args[: len(names)], args[len(names):]
        if len(step) != len(names) or len(pools) != len(POOL_INPUTS):
            raise TypeError(f"expected the {len(names)} step tensors {names} and the pool lists "
                            f"{POOL_INPUTS}, got {len(args)} arguments")
        tensors = dict(zip(names, step))
        for kind, layers in zip(POOL_INPUTS, pools):
            tensors.update({pool_input_name(kind, i): p for i, p in enumerate(layers)})
        ctx = self.context
        bound = {}
        for name, dtype in self.inputs.items():
            t = tensors.get(name)
            if t is None:
                raise ValueError(f"{self.path.name}: the plan needs input {name}, which the step does not give")
            t = self._as_input(name, t, dtype)
            if not ctx.set_input_shape(name, tuple(t.shape)):
                lo, _, hi = self.engine.get_tensor_profile_shape(name, 0)
                raise ValueError(f"{self.path.name}: {name} shape {tuple(t.shape)} is outside the plan's profile "
                                 f"[{tuple(lo)} .. {tuple(hi)}]")
            ctx.set_tensor_address(name, t.data_ptr())
            bound[name] = t
        device = next(iter(bound.values())).device
        results = []
        for name in (n for n in STEP_OUTPUTS if n in self.outputs):  # logits, then hidden (MTP-enabled plans)
            t = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=self.outputs[name], device=device)
            ctx.set_tensor_address(name, t.data_ptr())
            results.append(t)
        copies = []
        for name, source in self.aliased.items():
            pool = bound[name[: -len(POOL_OUTPUT_SUFFIX)]]
            out = pool if source is not None else torch.empty_like(pool)
            ctx.set_tensor_address(name, out.data_ptr())
            if source is None:
                copies.append((pool, out))
        stream = torch.cuda.current_stream(device)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"{self.path.name}: TensorRT enqueue failed (a plugin error is in the TensorRT log)")
        for pool, out in copies:
            pool.copy_(out)
        return results[0] if len(results) == 1 else tuple(results)

    def _as_input(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not t.is_cuda:
            raise ValueError(f"{self.path.name}: {name} is on {t.device}; TensorRT plans take CUDA tensors")
        pool = "_pools_" in name
        if t.dtype != dtype:
            if not pool or t.dtype != torch.uint8:
                raise ValueError(f"{self.path.name}: {name} is {t.dtype}; the plan takes {dtype}")
            t = t.view(dtype)  # fp8 byte pool -> the plan's carrier (free: same bytes)
        if not t.is_contiguous():
            if pool:  # a copy would take the step's cache writes with it
                raise ValueError(f"{self.path.name}: {name} must be contiguous (the plan writes it in place)")
            t = t.contiguous()  # kept alive in `bound` until the step is enqueued
        return t


def load_plan(engine_dir: str | Path, cfg: EngineConfig, rank: int, name: str | None = None) -> TensorRTProgram:
    """The plan ``name`` (default rank<rank>.plan; rank<rank>.mtp.plan: the draft) of an engine
    directory, its plugin library loaded first."""
    engine_dir = Path(engine_dir)
    path = engine_dir / (name or cfg.rank_file(rank))
    if not path.is_file():
        raise EngineDirError(f"{path}: missing; rebuild the engine directory with `make engine`")
    trt = _tensorrt()
    if not cfg.plugin_library:
        raise EngineDirError(f"{engine_dir}: engine_config.json names no plugin_library for these TensorRT plans")
    _load_plugin_library(trt, engine_dir / cfg.plugin_library)
    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise EngineDirError(f"{path}: TensorRT cannot deserialise this plan (another TensorRT version or GPU?); "
                             "rebuild it")
    return TensorRTProgram(trt, engine, path, logger, runtime)
