"""Collectives of the tensor-parallel network as torch custom ops, namespace ``dsa`` (docs/architecture.md §7).

``dsa::all_reduce(x, group_size)`` sums the row-parallel partial outputs (o_proj, dense and
expert down projections) over the ranks of one engine. As a custom op it stays one node in the
exported program: AOTInductor calls it through the dispatcher (the implementation below, i.e.
``torch.distributed`` over gloo or NCCL), and the TensorRT path maps it to an NCCL all-reduce.

The network emits the op only when ``tp_size > 1``; a TP=1 program has no collective at all.
Running a TP>1 program without the matching process group is an error, never a silent identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PLUGIN_NAMES = {"all_reduce": "DsaAllReduce"}


def _check_group(group_size: int) -> None:
    if group_size == 1:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"dsa::all_reduce(group_size={group_size}): torch.distributed is not initialised. A tensor-parallel "
            "engine runs one process per rank: launch it with torchrun (dsa_trt.runtime.distributed)"
        )
    world = dist.get_world_size()
    if world != group_size:
        raise RuntimeError(
            f"dsa::all_reduce(group_size={group_size}): the process group has {world} ranks; the engine was "
            f"built for tp={group_size}: launch {group_size} processes"
        )


@torch.library.custom_op("dsa::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sum of ``x`` over the ``group_size`` ranks of the default process group (a new tensor)."""
    _check_group(group_size)
    out = x.clone()  # a custom op may not return (an alias of) its input
    if group_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@all_reduce.register_fake
def _(x, group_size):
    return torch.empty_like(x)
