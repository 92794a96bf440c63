"""Multi-rank serving: one process per rank, launched by torchrun (docs/architecture.md §7).

Every rank loads its own engine (``Engine.load(dir, rank=r)``) and allocates its own copy of the
paged caches (the MLA latent and the indexer keys are replicated across ranks). Rank 0 owns the
scheduler, the page pool and sampling: it wraps its engine in ``DistributedEngine``, whose
``forward`` first broadcasts the step (one header and one packed int64 payload), then runs the
local program. The other ranks sit in ``worker_loop``: receive a step, run the same forward (the
programs' ``dsa::all_reduce`` nodes meet there), drop the logits, repeat until rank 0 says stop.

    torchrun --standalone --nproc-per-node N -m dsa_trt.runtime.cli generate --engine DIR ...

``dsa-trt generate`` does that relaunch itself when the engine has world_size > 1. Backend: gloo on
the CPU, NCCL on GPUs (NVLink multicast off: ``launch_env``).

Context parallelism (export/parallel.py) uses the same broadcast: ``DistributedEngine(engine,
context_parallel=p)`` pads each step to a multiple of p, and every rank's program takes its
interleaved share of the one step all ranks received; ``run_engine_dir`` drives the engine
directories of both (cp_size from engine_config.json). A rank whose collective fails (a peer
died, or hung past DSA_DIST_TIMEOUT_S) raises ``RankFailure`` naming the peers that exited.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from dsa_trt.engine_config import EngineConfig, EngineDirError
from dsa_trt.plugins.collectives import EPCapacityError
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import ROW, STEP_DIMS, STEP_FIELDS, StepInputs, StepOutput

from . import knobs
from .engine import Engine

T = TypeVar("T")

CMD_STOP, CMD_STEP, CMD_DRAFT = 0, 1, 2  # CMD_DRAFT: an MTP draft step; its hidden_states follow the payload
# header: cmd, the size of every STEP_DIMS dim (tokens, batch, pages_per_seq, logit_rows), then
# the pool's page count; the payload carries the StepInputs fields (STEP_FIELDS
# order) as one int64 vector, each field restored to its own dtype on the receiving rank
DIMS_AT = 1
POOL_PAGES_AT = DIMS_AT + len(STEP_DIMS)
HEADER_LEN = POOL_PAGES_AT + 1


class RankFailure(RuntimeError):
    """A collective of a multi-rank engine failed: a peer rank exited or stopped answering within
    DSA_DIST_TIMEOUT_S. The message names the rank that saw it and the peers found dead."""


# (hostname, pid) of every rank, gathered when the group forms: after a failed collective, a
# rank names the peers whose processes are gone (torchrun --standalone: every rank on this host)
_peers: list[tuple[str, int]] = []
PEER_EXIT_POLLS, PEER_EXIT_POLL_S = 50, 0.1  # up to 5 s for a dead peer to show as exited


def init_process_group(device: str | None = None) -> tuple[int, int, torch.device]:
    """Joins the torchrun group (RANK / WORLD_SIZE / LOCAL_RANK): (rank, world size, this rank's device).

    Every collective of the group times out after DSA_DIST_TIMEOUT_S seconds (gloo and NCCL
    alike), so a rank that hangs, not only one that dies, stops the others."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("not launched by torchrun (RANK / WORLD_SIZE unset): run a multi-rank engine with "
                           "`torchrun --nproc-per-node N -m dsa_trt.runtime.cli generate --engine DIR`")
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        timeout = timedelta(seconds=knobs.get("DSA_DIST_TIMEOUT_S"))
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    record_peers()
    return dist.get_rank(), dist.get_world_size(), dev


def record_peers() -> None:
    """Every rank learns every rank's (hostname, pid); a collective, called once per group."""
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    _peers[:] = peers


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a killed child stays a zombie until its launcher reaps it
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        return False


def describe_peers() -> str:
    """Which peer ranks have exited, as far as this host can tell."""
    me, host = dist.get_rank(), socket.gethostname()
    local = [(r, pid) for r, (h, pid) in enumerate(_peers) if r != me and h == host]
    gone: list[str] = []
    # a dying process closes its sockets before the kernel shows it exited: look for a while
    for _ in range(PEER_EXIT_POLLS):
        gone = [f"rank {r} (pid {pid})" for r, pid in local if _process_gone(pid)]
        if gone or not local:
            break
        time.sleep(PEER_EXIT_POLL_S)
    if gone:
        return f"{', '.join(gone)} exited"
    return (f"no peer process has exited on this host (a peer hung past DSA_DIST_TIMEOUT_S="
            f"{knobs.get('DSA_DIST_TIMEOUT_S')} s, failed on its own, or runs elsewhere)")


def guarded(what: str, fn: Callable[[], T]) -> T:
    """Runs ``fn`` (collectives inside); a failure becomes a RankFailure naming the dead peers.
    Errors every rank raises alike (an overflowing expert exchange, bad input) pass through."""
    try:
        return fn()
    except (EPCapacityError, ValueError):
        raise
    except RuntimeError as e:
        if str(e).startswith(f"{EPCapacityError.__name__}: "):
            # the op's error out of a compiled program: AOTInductor's proxy executor re-raises the
            # Python exception as a RuntimeError("<type>: <message>"); it is still every rank's
            raise EPCapacityError(str(e).split(": ", 1)[1].splitlines()[0]) from e
        if not dist.is_initialized():
            raise
        raise RankFailure(f"rank {dist.get_rank()} of {dist.get_world_size()}: {what} failed: {describe_peers()}; "
                          f"this rank stops too ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from e


def pad_step_tokens(step: StepInputs, num_tokens: int) -> StepInputs:
    """``step`` with padding tokens appended up to ``num_tokens``: slot -1 (they write nowhere),
    position 0 of page-table row 0 (one valid key), token id 0; ``logits_indices`` unchanged, so
    the logits are the unpadded step's. Context parallelism pads to a multiple of the group size,
    data-parallel attention pads every rank's step to the largest."""
    have = step.input_ids.shape[0]
    if num_tokens < have:
        raise ValueError(f"pad_step_tokens: the step has {have} tokens, more than {num_tokens}")
    if num_tokens == have:
        return step
    padded = []
    for f in STEP_FIELDS:
        t = getattr(step, f.name)
        if f.dims[0] == "tokens":
            value = 0 if f.pad in (None, ROW) else f.pad
            t = torch.cat([t, t.new_full((num_tokens - have, *t.shape[1:]), value)])
        padded.append(t)
    return StepInputs(*padded)


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
    """Rank 0's engine: the same interface as ``Engine``; each forward is mirrored on every rank.

    ``context_parallel`` (the group size of a context-parallel engine, export/parallel.py): every
    step is padded to a multiple of it before the broadcast; each rank's program then takes its
    interleaved share (tokens i % p == rank) of the one step every rank received."""

    def __init__(self, engine: Engine, context_parallel: int = 1):
        super().__init__(engine.config, engine.program, engine.device, engine.tokenizer_path, engine.draft_program)
        self.context_parallel = context_parallel
        self._stopped = False
        self._steps = 0

    @torch.no_grad()
    def run(self, step: StepInputs, mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor]) -> StepOutput:
        if self.context_parallel > 1:
            n = step.input_ids.shape[0]
            step = pad_step_tokens(step, -(-n // self.context_parallel) * self.context_parallel)
        header, payload = _pack(step, mla_pools[0].shape[0], self.device)
        self._steps += 1

        def run():
            dist.broadcast(header, src=0)
            dist.broadcast(payload, src=0)
            return super(DistributedEngine, self).run(step, mla_pools, index_pools)

        return guarded(f"step {self._steps}", run)

    @torch.no_grad()
    def draft(self, step: StepInputs, hidden_states: torch.Tensor, mla_pools: list[torch.Tensor],
              index_pools: list[torch.Tensor]) -> StepOutput:
        header, payload = _pack(step, mla_pools[0].shape[0], self.device, CMD_DRAFT)
        hidden_states = hidden_states.contiguous()

        def run():
            dist.broadcast(header, src=0)
            dist.broadcast(payload, src=0)
            dist.broadcast(hidden_states, src=0)
            return super(DistributedEngine, self).draft(step, hidden_states, mla_pools, index_pools)

        return guarded(f"draft of step {self._steps}", run)

    def shutdown(self) -> None:
        """Releases the workers (idempotent)."""
        if not self._stopped:
            self._stopped = True
            header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
            header[0] = CMD_STOP
            guarded("the stop broadcast", lambda: dist.broadcast(header, src=0))


@torch.no_grad()
def worker_loop(engine: Engine) -> int:
    """Rank > 0: mirrors rank 0's steps on this rank's engine and caches; returns the steps run."""
    pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    mtp_pools: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # the draft layer's, on first use
    cfg, steps = engine.config, 0
    header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=engine.device)
    if knobs.get("DSA_DETERMINISTIC") == "1":  # rank 0's LLM runs its steps under the same kernel plans
        os.environ.update(knobs.DETERMINISTIC_KERNEL_ENV)
    while True:
        guarded(f"waiting for step {steps + 1} from rank 0", lambda: dist.broadcast(header_t, src=0))
        header = header_t.tolist()
        if header[0] == CMD_STOP:
            return steps
        num_pages = header[POOL_PAGES_AT]
        payload = torch.empty(_payload_len(header), dtype=torch.int64, device=engine.device)

        def run():
            nonlocal pools, mtp_pools
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

        try:
            guarded(f"step {steps + 1}", run)
        except (EPCapacityError, ValueError):
            # raised on every rank alike, so rank 0 raised it too and hands it to its caller: keep
            # mirroring. Rank 0 then stops the group or steps on; leaving the loop here would put
            # this rank in the final barrier while rank 0 broadcasts (a wait for the timeout).
            pass
        steps += 1


def run_parallel(load: Callable[[int, int, torch.device], Engine], rank0: Callable[[Engine], T],
                 device: str | None = None, context_parallel: int = 1) -> T | None:
    """In a torchrun process: join the group, ``load(rank, world, device)`` this rank's engine; rank 0
    runs ``rank0(engine)`` (e.g. build an ``LLM`` over it and generate) while the other ranks
    mirror its steps. Returns rank 0's result on rank 0 and None elsewhere. A failed rank stops
    the others with a RankFailure (no barrier is waited on after a failure)."""
    rank, world, dev = init_process_group(device)
    # rank 0's forward broadcasts before it runs, which a captured CUDA graph would skip: the
    # multi-rank driver runs its steps eagerly (LLM reads this knob when it is built)
    os.environ["DSA_CUDA_GRAPHS"] = "0"
    peer_failed = False
    try:
        engine = load(rank, world, dev)
        if rank == 0:
            dengine = DistributedEngine(engine, context_parallel)
            try:
                return rank0(dengine)
            except RankFailure:
                dengine._stopped = True  # the peers are gone or failing: no stop message to send
                raise
            finally:
                dengine.shutdown()
        worker_loop(engine)
        return None
    except RankFailure:
        peer_failed = True
        raise
    finally:
        if not peer_failed:  # a barrier with a dead peer would only wait for the timeout
            dist.barrier()
        dist.destroy_process_group()


def run_engine_dir(engine_dir: str | Path, rank0: Callable[[Engine], T], device: str | None = None) -> T | None:
    """``run_parallel`` over the rank programs of a multi-rank engine directory: tensor parallel
    (tp_size ranks), or one expert- / context-parallel group (ep_size / cp_size ranks, every step
    padded to a multiple of cp_size). Each rank loads its own rank<r> program."""
    cfg = EngineConfig.load(engine_dir, check_files=True)

    def load(rank: int, world: int, dev: torch.device) -> Engine:
        if world != cfg.world_size:
            raise EngineDirError(f"{engine_dir}: built for {cfg.layout} ({cfg.world_size} ranks) but {world} processes "
                                 f"were launched; use --nproc-per-node {cfg.world_size}")
        return Engine.load(engine_dir, rank=rank, device=str(dev))

    return run_parallel(load, rank0, device or ("cpu" if cfg.device == "cpu" else None), context_parallel=cfg.cp_size)


run_tensor_parallel = run_engine_dir  # the name of the tp-only days, kept for its callers


def launch_env(environ: dict | None = None) -> dict:
    """The ranks' environment: NVLink multicast (NVLS) off, as this deployment's GPUs require, and
    NCCL errors / timeouts tearing the process down (so a dead peer cannot leave a rank waiting)."""
    env = dict(os.environ if environ is None else environ)
    env["NCCL_NVLS_ENABLE"] = "0"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def relaunch_with_torchrun(nproc: int, module_args: list[str]) -> int:
    """Runs ``python -m <module_args>`` as ``nproc`` torchrun processes on this host; their exit code.
    torchrun stops every rank when one exits with an error and names it (its "Root Cause")."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", *module_args]
    return subprocess.call(cmd, env=launch_env())
