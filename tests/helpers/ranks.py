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


def join_group(rank: int, world: int, port: int) -> None:
    """This process joins a gloo group of ``world`` ranks (the env torchrun would set)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)


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
