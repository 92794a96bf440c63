"""Collectives of the multi-rank networks as torch custom ops, namespace ``dsa`` (docs/architecture.md §7).

* ``dsa::all_reduce(x, group_size)`` sums the row-parallel partial outputs of tensor parallelism
  (o_proj, dense and expert down projections) and, under context parallelism, the hidden rows
  whose logits are needed (each row is non-zero on exactly one rank, so the sum is exact).
* ``dsa::all_gather(x, group_size)`` -> ``[group_size, *x.shape]`` in rank order: context-parallel
  prefill gathers every rank's MLA latents and indexer keys before the cache writes.
* ``dsa::ep_all_to_all(x, counts, group_size)``: the expert-parallel exchange. ``x [p, C, W]``
  holds up to C rows for each destination rank (the dispatch: packed (token, expert) pairs; the
  combine: the weighted expert outputs going back); ``counts [p]`` says how many rows of each
  destination block are real. The result ``[p, C, W]`` holds in block s the rows rank s sent
  here, zeros after them. Shapes never depend on the routing, so a decode step stays
  CUDA-graph capturable.

As custom ops they stay one node each in the exported program: AOTInductor calls them through the
dispatcher (the implementations below, i.e. ``torch.distributed`` over gloo on the CPU or NCCL on
GPUs, the same calls for both), and the TensorRT path maps them to NCCL collectives.

Capacity: a destination block holds C rows. Before sending, ``ep_all_to_all`` all-gathers every
rank's counts (p * (p + 1) integers), so every rank sees the same overflow and raises the same
``EPCapacityError`` naming the ranks, the pair count and the capacity: no rank drops a pair, and
none is left waiting in a collective the others skipped. Outside CUDA-graph capture the rows
travel compacted (``all_to_all_single`` with the real split sizes). Inside a capture the counts
cannot be read on the host: the whole buffer travels (the rows after each count are zeros, which
the receiver reads as empty), and the capacity must then be the worst case of the captured step
(export/parallel.py sizes it so).

A program emits these ops only when its group has more than one rank; running it without the
matching process group is an error, never a silent identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PLUGIN_NAMES = {"all_reduce": "DsaAllReduce", "all_gather": "DsaAllGather", "ep_all_to_all": "DsaEpAllToAll"}


class EPCapacityError(RuntimeError):
    """An expert-parallel exchange would overflow its per-destination buffer; raised on every rank."""


def _check_group(op: str, group_size: int) -> None:
    if group_size == 1:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"dsa::{op}(group_size={group_size}): torch.distributed is not initialised. A multi-rank engine runs "
            "one process per rank: launch it with torchrun (dsa_trt.runtime.distributed)"
        )
    world = dist.get_world_size()
    if world != group_size:
        raise RuntimeError(
            f"dsa::{op}(group_size={group_size}): the process group has {world} ranks; the engine was built for "
            f"{group_size} ranks: launch {group_size} processes"
        )


@torch.library.custom_op("dsa::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sum of ``x`` over the ``group_size`` ranks of the default process group (a new tensor)."""
    _check_group("all_reduce", group_size)
    out = x.clone()  # a custom op may not return (an alias of) its input
    if group_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@all_reduce.register_fake
def _(x, group_size):
    return torch.empty_like(x)


@torch.library.custom_op("dsa::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[group_size, *x.shape]``: block r is rank r's ``x`` (every rank passes the same shape)."""
    _check_group("all_gather", group_size)
    if group_size == 1:
        return x.clone()[None]
    # rank blocks concatenated along dim 0 (the layout both gloo and NCCL take), then split
    flat = x.new_empty((group_size * x.shape[0], *x.shape[1:])) if x.dim() else x.new_empty(group_size)
    dist.all_gather_into_tensor(flat, x.contiguous())
    return flat.view(group_size, *x.shape)


@all_gather.register_fake
def _(x, group_size):
    return x.new_empty((group_size, *x.shape))


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _exchange_counts(x: torch.Tensor, counts: torch.Tensor, group_size: int) -> torch.Tensor:
    """[p, p] int64 on the host: row s = the rows rank s sends to each rank; raises on overflow or
    on ranks whose buffers disagree, identically on every rank."""
    capacity = x.shape[1]
    mine = torch.cat([counts.new_tensor([capacity, x.shape[2]]), counts]).to(torch.int64)
    every = mine.new_empty(group_size * (group_size + 2))
    dist.all_gather_into_tensor(every, mine)
    every = every.view(group_size, group_size + 2).cpu()
    shapes = every[:, :2].tolist()
    if any(s != shapes[0] for s in shapes):
        raise EPCapacityError(
            "dsa::ep_all_to_all: the ranks' exchange buffers differ ([capacity, row width] per rank: "
            f"{shapes}); every rank's step must have the same token count (pad the steps to one size)")
    sent = every[:, 2:]
    over = (sent > capacity).nonzero()
    if over.numel():
        src, dst = (int(v) for v in over[0])
        raise EPCapacityError(
            f"dsa::ep_all_to_all: rank {src} routes {int(sent[src, dst])} (token, expert) pairs to rank {dst}, more "
            f"than the exchange capacity of {capacity} pairs per destination rank (largest need "
            f"{int(sent.max())}); rebuild with a larger ep_capacity (dsa-trt build --ep-capacity, ParallelConfig) "
            "or give the step fewer tokens")
    if bool((sent < 0).any()):
        raise EPCapacityError(f"dsa::ep_all_to_all: negative row counts {sent.tolist()}")
    return sent


@torch.library.custom_op("dsa::ep_all_to_all", mutates_args=())
def ep_all_to_all(x: torch.Tensor, counts: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [p, C, W] rows for each destination rank, counts [p] the real rows of each block ->
    [p, C, W]: block s = the rows rank s sent to this rank, zeros after them."""
    if x.dim() != 3 or x.shape[0] != group_size:
        raise ValueError(f"dsa::ep_all_to_all: x must be [group_size={group_size}, capacity, width], got "
                         f"{list(x.shape)}")
    if counts.shape != (group_size,):
        raise ValueError(f"dsa::ep_all_to_all: counts must be [{group_size}], got {list(counts.shape)}")
    _check_group("ep_all_to_all", group_size)
    if group_size == 1:
        return x.clone()
    out = torch.zeros_like(x)
    if _capturing(x):  # counts unreadable on the host: the whole buffer travels
        dist.all_to_all_single(out, x.contiguous())
        return out
    sent = _exchange_counts(x, counts, group_size)
    me = dist.get_rank()
    send_splits, recv_splits = sent[me].tolist(), sent[:, me].tolist()
    send = torch.cat([x[d, :n] for d, n in enumerate(send_splits)])
    recv = x.new_empty((sum(recv_splits), x.shape[2]))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    at = 0
    for s, n in enumerate(recv_splits):
        out[s, :n] = recv[at : at + n]
        at += n
    return out


@ep_all_to_all.register_fake
def _(x, counts, group_size):
    return torch.empty_like(x)
