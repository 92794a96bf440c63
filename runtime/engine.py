"""Engines: one per rank, ``forward(step, mla_pools, index_pools) -> logits`` (docs/architecture.md §6).

``run`` returns every program output (dsa_trt/step.py StepOutput: logits, and the final-norm
``hidden`` of every token in engines built with an MTP draft program); ``draft`` runs that draft
program (export/mtp.py) over its own one-layer pools.

``Engine.load(engine_dir)`` opens the compiled program of one rank of an engine directory (an
AOTInductor package gets its weights from rank<N>.weights.safetensors, mapped, checked against
the package's constant table, handed to load_constants: dsa_trt/weights_file.py); every
step, prefill or decode, runs it (one path for every token: docs/architecture.md §8). Both AOTInductor packages and TensorRT plans implement the same call; the eager network (the
reference path, built by the builder) implements it too.
"""

from __future__ import annotations

import struct
import warnings
import zipfile
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import dsa_trt.plugins.collectives  # noqa: F401  (dsa::all_reduce, called by tensor-parallel programs)
import dsa_trt.plugins.ops  # noqa: F401  (registers torch.ops.dsa.* before any program loads)
from dsa_trt.checkpoint_layout import mtp_shared_copies
from dsa_trt.engine_config import EngineConfig, EngineDirError, verify_engine_files
from dsa_trt.package_check import PackageLinkError, check_package
from dsa_trt.weights_file import WeightsFileError, check_against_table, constant_table, map_weights

from dsa_trt.step import StepOutput

from .step_inputs import StepInputs

Program = Callable[..., torch.Tensor]


class Engine:
    def __init__(self, config: EngineConfig, program: Program, device: torch.device,
                 tokenizer_path: Path | None = None, draft_program: Program | None = None):
        self.config = config
        self.tokenizer_path = tokenizer_path
        self.device = device
        self.program = program
        self.draft_program = draft_program  # the MTP layer (speculative decoding), or None

    @classmethod
    def load(cls, engine_dir: str | Path, rank: int = 0, device: str | None = None, draft: bool = True) -> "Engine":
        """draft: also load the MTP draft program when the directory has one (mtp_layers > 0)."""
        engine_dir = Path(engine_dir)
        cfg = EngineConfig.load(engine_dir)
        if cfg.world_size > 1 and not dist.is_initialized():
            # its programs' collectives would fail on the first step, far from the cause
            raise EngineDirError(f"{engine_dir}: this {cfg.layout} engine ({cfg.world_size} ranks) runs one process "
                                 "per rank: use `dsa-trt generate --engine DIR` (it launches them with torchrun), or "
                                 "dsa_trt.runtime.distributed.run_engine_dir under torchrun")
        if not 0 <= rank < cfg.world_size:
            raise EngineDirError(f"{engine_dir}: rank {rank} not in [0, {cfg.world_size}) ({cfg.layout})")
        verify_engine_files(engine_dir, cfg, rank)  # manifest.json: sizes, sha256, config tie (DSA_VERIFY_ENGINE)
        dev = torch.device(device or cfg.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise EngineDirError(
                f"{engine_dir}: the engine was compiled for CUDA but this machine has no GPU; "
                "rebuild it here with `make engine` (it compiles for the CPU when no GPU is present)"
            )
        if dev.type == "cuda":
            from dsa_trt.plugins import cuda_ops

            try:  # the kernels must serve this engine: no silent fallback to the 20-37x slower reference
                cuda_ops.check_engine(dev, cfg.cache_mode, cfg.dtype, what=str(engine_dir))
            except RuntimeError as e:
                raise EngineDirError(str(e)) from e
        names = [cfg.rank_file(rank)] + ([cfg.draft_file(rank)] if draft and cfg.mtp_layers else [])
        if cfg.compiler == "aoti":
            programs = [_load_aoti(engine_dir / name, dev) for name in names]
            if (weights := cfg.rank_weights_file(rank)) is not None:  # the main program's, outside it
                programs[0] = _with_weights(programs[0], engine_dir / cfg.rank_file(rank), engine_dir / weights, dev)
            if len(programs) > 1 and (weights := cfg.draft_weights_file(rank)) is not None:
                # the draft's own weights, and the embedding and head it shares with the main program
                shared = {name: programs[0].weights[main] for name, main in mtp_shared_copies(cfg.model).items()
                          if main in programs[0].weights}
                programs[1] = _with_weights(programs[1], engine_dir / cfg.draft_file(rank), engine_dir / weights, dev,
                                            shared)
        elif cfg.compiler == "tensorrt":
            from .tensorrt_engine import load_plan  # thin adapter; needs `import tensorrt`

            programs = [load_plan(engine_dir, cfg, rank, name) for name in names]
        else:
            raise EngineDirError(f"{engine_dir}: compiler {cfg.compiler!r} has no runtime loader")
        return cls(cfg, programs[0], dev, engine_dir / cfg.tokenizer, programs[1] if len(programs) > 1 else None)

    @torch.no_grad()
    def run(self, step: StepInputs, mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor]) -> StepOutput:
        return StepOutput.of(self.program(*step.as_tuple(), mla_pools, index_pools))

    def forward(self, step: StepInputs, mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor]) -> torch.Tensor:
        """The logits [logit_rows, vocab] of the step (``run`` gives every output)."""
        return self.run(step, mla_pools, index_pools).logits

    @property
    def has_draft(self) -> bool:
        return self.draft_program is not None

    @torch.no_grad()
    def draft(self, step: StepInputs, hidden_states: torch.Tensor, mla_pools: list[torch.Tensor],
              index_pools: list[torch.Tensor]) -> StepOutput:
        """One MTP draft step: ``step.input_ids`` are the next tokens (t_{i+1} at position i),
        ``hidden_states`` [tokens, D] the main model's final-norm states (or the previous draft
        step's ``hidden``); pools: the MTP layer's own, one layer each (export/mtp.py)."""
        if self.draft_program is None:
            raise RuntimeError("this engine has no MTP draft program (engine_config.json mtp_layers = 0, or it was "
                               "loaded with draft=False)")
        return StepOutput.of(self.draft_program(*step.as_tuple(), hidden_states, mla_pools, index_pools))


def _load_aoti(path: Path, device: torch.device) -> Program:
    if not path.is_file():
        raise EngineDirError(f"{path}: missing; rebuild the engine directory with `make engine`")
    try:
        check_package(path)  # a wrapper with a static C++ runtime would segfault in the loader
    except PackageLinkError as e:
        raise EngineDirError(str(e)) from e
    except (zipfile.BadZipFile, ValueError, struct.error, IndexError):
        pass  # not a package this check can read: the loader's error below names the problem
    device_index = -1
    if device.type == "cuda":
        device_index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(device_index)
        torch.empty(1, device=f"cuda:{device_index}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            # single-threaded runner: the default one waits on CUDA events to pick a free model
            # instance, which is illegal while a decode step is captured into a CUDA graph
            return torch._inductor.aoti_load_package(str(path), device_index=device_index,
                                                     run_single_threaded=device.type == "cuda")
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign package: say which file
            raise EngineDirError(f"{path}: cannot load this AOTInductor package ({type(e).__name__}: {e}); "
                                 "it may come from another torch version or device: rebuild it") from e


class AotiProgram:
    """A loaded package and the weights it points into: ``load_constants(user_managed=True)`` keeps
    raw pointers, so the tensors (and on the CPU the file mapping they view) live as long as this."""

    def __init__(self, program, weights: dict[str, torch.Tensor], mapping) -> None:
        self.program, self.weights, self.mapping = program, weights, mapping

    def __call__(self, *args):
        return self.program(*args)


def _with_weights(program, package: Path, weights_path: Path, device: torch.device,
                  shared: dict[str, torch.Tensor] | None = None) -> AotiProgram:
    """Map ``weights_path``, check it against the package's constant table, hand it to the program.
    ``shared``: constants of another program already loaded on ``device`` (the MTP draft's
    embedding and head are the main program's), taken for the names the file does not hold.

    CPU: the tensors are views of a private mapping of the file (no copy; pages are read on first
    use). CUDA: one host-to-device copy per tensor, then the mapping is dropped."""
    try:
        table = constant_table(package)
        mapped = map_weights(weights_path)
        shared = {n: t for n, t in (shared or {}).items() if n in table and n not in mapped.tensors}
        check_against_table(weights_path, {**mapped.tensors, **shared}, table, program.get_constant_fqns())
    except WeightsFileError as e:
        raise EngineDirError(str(e)) from None
    tensors, mapping = {n: mapped.tensors[n] for n in table if n not in shared}, mapped.mapping
    if device.type != "cpu":
        tensors = {n: t.to(device) for n, t in tensors.items()}
        mapping = None
    tensors.update(shared)
    program.load_constants(tensors, check_full_update=True, user_managed=True)
    return AotiProgram(program, tensors, mapping)


def eager_engine(net, config: EngineConfig, device: torch.device, tokenizer_path: Path, draft_net=None) -> Engine:
    """The reference path: the eager network (and MTP draft network) wrapped as an Engine (same interface)."""
    return Engine(config, net, device, Path(tokenizer_path), draft_net)
