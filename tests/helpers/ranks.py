"""Multi-rank tests on CPU processes: one process per rank (torch.multiprocessing), gloo."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun would give this rank (for code that joins the group itself, e.g.
    runtime/distributed.py), and one intra-op thread: the ranks share the machine's cores."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def join_group(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """This process joins a ``backend`` group of ``world`` ranks (rank_env's environment);
    nccl: GPU ``rank``, NVLink multicast off (the launcher's environment, runtime/distributed.py)."""
    rank_env(rank, world, port)
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)


def spawn(fn, world: int, out_dir: Path, *args) -> list[dict]:
    """Runs fn(rank, world, port, out_dir, *args) on ``world`` processes; returns what each rank saved
    to ``out_dir/rank<r>.pt``."""
    mp.spawn(fn, args=(world, free_port(), str(out_dir), *args), nprocs=world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]


def ref_all_to_all(buffers: list[torch.Tensor], counts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The exchange in one process: rank r receives, in block s, the first counts[s][r] rows of
    rank s's block r; the other rows are zeros."""
    p = len(buffers)
    out = [torch.zeros_like(b) for b in buffers]
    for s in range(p):
        for r in range(p):
            n = int(counts[s][r])
            out[r][s, :n] = buffers[s][r, :n]
    return out


def eager_parallel_engine(ckpt_dir: str, cache_mode: str, parallel):
    """An eager Engine over rank ``parallel.rank``'s network of export/parallel.py (no compile)."""
    from dsa_trt.engine_config import EngineConfig
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.parallel import build_parallel_network
    from dsa_trt.runtime.engine import eager_engine

    ckpt = Checkpoint(ckpt_dir)
    cfg = EngineConfig(model=ckpt.config, cache_mode=cache_mode, dtype="float32", device="cpu", compiler="eager",
                       kv_scales=[1.0] * ckpt.config.num_hidden_layers)
    net = build_parallel_network(ckpt, cache_mode, torch.float32, parallel)
    return eager_engine(net, cfg, torch.device("cpu"), Path(ckpt_dir) / "tokenizer.json")


def serve_until_killed(ckpt_dir: str, marker: str) -> None:
    """A torchrun-style rank (env RANK / WORLD_SIZE / MASTER_*) of a context-parallel eager engine:
    rank 0 runs decode steps until a peer fails, touching ``marker`` once steps flow; the test
    kills a rank and expects the survivors to exit with a RankFailure naming it."""
    from dsa_trt.export.parallel import ParallelConfig
    from dsa_trt.plugins.pools import allocate_pools
    from dsa_trt.runtime.distributed import run_parallel
    from dsa_trt.runtime.step_inputs import StepInputs

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])

    def load(rank, world, dev):
        return eager_parallel_engine(ckpt_dir, "fp32", ParallelConfig(size=world, rank=rank, context_parallel=True))

    def rank0(engine):
        pools = allocate_pools(engine.config.model, "fp32", 4)
        step = StepInputs.build([(list(range(2, 12)), 0, [1])])
        for i in range(100_000):
            engine.forward(step, *pools)
            if i == 2:
                Path(marker).touch()

    run_parallel(load, rank0, device="cpu", context_parallel=world)
