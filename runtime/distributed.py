"""Tensor-parallel serving: one process per rank, launched by torchrun (docs/architecture.md §7).

Every rank loads its own engine (``Engine.load(dir, rank=r)``) and allocates its own copy of the
paged caches (the MLA latent and the indexer keys are replicated across ranks). Rank 0 owns the
scheduler, the page pool and sampling: it wraps its engine in ``DistributedEngine``, whose
``forward`` first broadcasts the step (one header and one packed int64 payload), then runs the
local program. The other ranks sit in ``worker_loop``: receive a step, run the same forward (the
programs' ``dsa::all_reduce`` nodes meet there), drop the logits, repeat until rank 0 says stop.

    torchrun --standalone --nproc-per-node N -m dsa_trt.runtime.cli generate --engine DIR ...

``dsa-trt generate`` does that relaunch itself when the engine has tp_size > 1. Backend: gloo on
the CPU, NCCL on GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from dsa_trt.engine_config import EngineConfig, EngineDirError
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import STEP_DIMS, STEP_FIELDS, StepInputs, StepOutput

from .engine import Engine

T = TypeVar("T")

CMD_STOP, CMD_STEP, CMD_DRAFT = 0, 1, 2  # CMD_DRAFT: an MTP draft step; its hidden_states follow the payload
# header: cmd, the size of every STEP_DIMS dim (tokens, batch, pages_per_seq, logit_rows), then
# the pool's page count; the payload carries the StepInputs fields (STEP_FIELDS
# order) as one int64 vector, each field restored to its own dtype on the receiving rank
DIMS_AT = 1
POOL_PAGES_AT = DIMS_AT + len(STEP_DIMS)
HEADER_LEN = POOL_PAGES_AT + 1


def init_process_group(device: str | None = None) -> tuple[int, int, torch.device]:
    """Joins the torchrun group (RANK / WORLD_SIZE / LOCAL_RANK): (rank, world size, this rank's device)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("not launched by torchrun (RANK / WORLD_SIZE unset): run a tensor-parallel engine with "
                           "`torchrun --nproc-per-node N -m dsa_trt.runtime.cli generate --engine DIR`")
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), dev


def _shapes(header: list[int]) -> list[tuple[int, ...]]:
    sizes = dict(zip((d.name for d in STEP_DIMS), header[DIMS_AT:POOL_PAGES_AT]))
    return [tuple(sizes[d] for d in f.dims) for f in STEP_FIELDS]


def _pack(step: StepInputs, num_pages: int, device: torch.device, cmd: int = CMD_STEP
          ) -> tuple[torch.Tensor, torch.Tensor]:
    sizes = step.dim_sizes()
    header = [cmd, *(sizes[d.name] for d in STEP_DIMS), num_pages]
    payload = torch.cat([x.reshape(-1).to(device=device, dtype=torch.int64) for x in step.as_tuple()])
    return torch.tensor(header, dtype=torch.int64, device=device), payload


def _unpack(header: list[int], payload: torch.Tensor) -> StepInputs:
    parts, at = [], 0
    for shape, f in zip(_shapes(header), STEP_FIELDS):
        n = torch.Size(shape).numel()
        parts.append(payload[at : at + n].view(shape).to(f.dtype))
        at += n
    return StepInputs(*parts)


def _payload_len(header: list[int]) -> int:
    return sum(torch.Size(s).numel() for s in _shapes(header))


class DistributedEngine(Engine):
    """Rank 0's engine: the same interface as ``Engine``; each forward is mirrored on every rank."""

    def __init__(self, engine: Engine):
        super().__init__(engine.config, engine.program, engine.device, engine.tokenizer_path, engine.draft_program)
        self._stopped = False

    @torch.no_grad()
    def run(self, step: StepInputs, mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor]) -> StepOutput:
        header, payload = _pack(step, mla_pools[0].shape[0], self.device)
        dist.broadcast(header, src=0)
        dist.broadcast(payload, src=0)
        return super().run(step, mla_pools, index_pools)

    @torch.no_grad()
    def draft(self, step: StepInputs, hidden_states: torch.Tensor, mla_pools: list[torch.Tensor],
              index_pools: list[torch.Tensor]) -> StepOutput:
        header, payload = _pack(step, mla_pools[0].shape[0], self.device, CMD_DRAFT)
        dist.broadcast(header, src=0)
        dist.broadcast(payload, src=0)
        hidden_states = hidden_states.contiguous()
        dist.broadcast(hidden_states, src=0)
        return super().draft(step, hidden_states, mla_pools, index_pools)

    def shutdown(self) -> None:
        """Releases the workers (idempotent)."""
        if not self._stopped:
            header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
            header[0] = CMD_STOP
            dist.broadcast(header, src=0)
            self._stopped = True


@torch.no_grad()
def worker_loop(engine: Engine) -> int:
    """Rank > 0: mirrors rank 0's steps on this rank's engine and caches; returns the steps run."""
    pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    mtp_pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # the draft layer's, on first use
    cfg, steps = engine.config, 0
    header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=engine.device)
    while True:
        dist.broadcast(header_t, src=0)
        header = header_t.tolist()
        if header[0] == CMD_STOP:
            return steps
        num_pages = header[POOL_PAGES_AT]
        payload = torch.empty(_payload_len(header), dtype=torch.int64, device=engine.device)
        dist.broadcast(payload, src=0)
        step = _unpack(header, payload)
        if header[0] == CMD_DRAFT:
            if mtp_pools is None or mtp_pools[0][0].shape[0] != num_pages:
                mtp_pools = allocate_pools(cfg.model, cfg.cache_mode, num_pages, engine.device, num_layers=1)
            hidden = torch.empty(step.input_ids.shape[0], cfg.model.hidden_size, dtype=getattr(torch, cfg.dtype),
                                 device=engine.device)
            dist.broadcast(hidden, src=0)
            engine.draft(step, hidden, *mtp_pools)
        else:
            if pools is None or pools[0][0].shape[0] != num_pages:  # same page count as rank 0
                pools = allocate_pools(cfg.model, cfg.cache_mode, num_pages, engine.device)
            engine.run(step, *pools)
        steps += 1


def run_tensor_parallel(engine_dir: str | Path, rank0: Callable[[Engine], T], device: str | None = None) -> T | None:
    """In a torchrun process: load this rank's engine; rank 0 runs ``rank0(engine)`` (e.g. build an
    ``LLM`` over it and generate) while the other ranks mirror its steps. Returns rank 0's result
    on rank 0 and None elsewhere."""
    cfg = EngineConfig.load(engine_dir, check_files=True)
    rank, world, dev = init_process_group(device or ("cpu" if cfg.device == "cpu" else None))
    if world != cfg.tp_size:
        raise EngineDirError(f"{engine_dir}: built for tp={cfg.tp_size} but {world} processes were launched; "
                             f"use --nproc-per-node {cfg.tp_size}")
    engine = Engine.load(engine_dir, rank=rank, device=str(dev))
    # rank 0's forward broadcasts before it runs, which a captured CUDA graph would skip: the
    # tensor-parallel driver runs its steps eagerly (LLM reads this knob when it is built)
    os.environ["DSA_CUDA_GRAPHS"] = "0"
    try:
        if rank == 0:
            dengine = DistributedEngine(engine)
            try:
                return rank0(dengine)
            finally:
                dengine.shutdown()
        worker_loop(engine)
        return None
    finally:
        dist.barrier()
        dist.destroy_process_group()


def relaunch_with_torchrun(nproc: int, module_args: list[str]) -> int:
    """Runs ``python -m <module_args>`` as ``nproc`` torchrun processes on this host; their exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", *module_args]
    return subprocess.call(cmd)
