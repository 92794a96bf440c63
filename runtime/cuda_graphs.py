"""Steps replayed from CUDA graphs, one per bucket (docs/architecture.md §6).

A step is *uniform* when every sequence has at most ``q`` new tokens and either every token has a
logits row (decode: q = 1; an MTP verify step: the last token and n drafts, q = n + 1) or only
each sequence's last token has one (the MTP draft passes). Such a step is padded into the bucket
(q, logits mode, batch bucket, page-table-width bucket): sequence b owns static rows
[b*q, (b+1)*q), its real tokens last in them; padding rows and padding sequences follow the step
contract's padding (dsa_trt/step.py, ``StepInputs.padding``): slot -1 (they write nowhere),
page 0, and a position no later than their sequence's last, so every real row computes exactly
what the eager call computes (the attention of a row reads only its own sequence's keys up to its
position; tests/test_graph_buckets.py checks the padded step against the unpadded one). Any other
step runs eagerly. Graphs are captured lazily, on first use of a bucket, and share one memory pool.

The padded step is assembled on the host from the scheduler's CPU step (a few small tensors), then
copied into the bucket's static buffers; outputs are views of the graph's buffers, valid until the
next replay of the same runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dsa_trt.step import StepInputs, StepOutput

from .engine import Engine
from .step_inputs import DeviceIds, with_device_ids

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 8  # pages per sequence of the smallest width bucket
MAX_Q = 9  # tokens per sequence of the largest uniform bucket: 1 + MAX_DRAFT_TOKENS (runtime/speculative.py)


def _bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class Uniform:
    """A uniform step's shape: ``q`` rows per sequence; ``all_logits``: every row has a logits row
    (then every sequence has exactly q tokens), else only each sequence's last row."""

    q: int
    all_logits: bool


def uniform_shape(step: StepInputs) -> Uniform | None:
    """The Uniform shape of a host (CPU) step packed by sequence (``StepInputs.build``), or None."""
    batch, tokens = step.page_table.shape[0], step.input_ids.shape[0]
    req = step.req_idx.long()
    if tokens == 0 or bool((req[1:] < req[:-1]).any()):
        return None
    counts = torch.bincount(req, minlength=batch)
    if counts.shape[0] != batch or bool((counts == 0).any()):
        return None
    q = int(counts.max())
    rows = step.logits_indices
    if rows.shape[0] == tokens and bool((counts == q).all()) and torch.equal(rows, torch.arange(tokens)):
        return Uniform(q, True)
    if rows.shape[0] == batch and torch.equal(rows, torch.cumsum(counts, 0) - 1):
        return Uniform(q, False)
    return None


def bucket_padding(shape: Uniform, batch: int, width: int) -> StepInputs:
    """A bucket holding only padding (the step contract's values), with the bucket's fixed rows:
    req_idx = row // q and the logits rows of ``shape``; they stay the same for every replay."""
    q = shape.q
    out = StepInputs.padding({"tokens": batch * q, "batch": batch, "pages_per_seq": width,
                              "logit_rows": batch * q if shape.all_logits else batch})
    out.req_idx = torch.arange(batch * q, dtype=torch.int32) // q
    out.logits_indices = torch.arange(batch * q) if shape.all_logits else torch.arange(batch) * q + (q - 1)
    return out


def pad_uniform(step: StepInputs, shape: Uniform, batch: int, width: int) -> tuple[StepInputs, torch.Tensor]:
    """The host step padded into a (shape, batch, width) bucket, and ``dst`` [tokens]: the bucket
    row of each real token (real tokens last in their sequence's q rows)."""
    q, real_batch = shape.q, step.page_table.shape[0]
    req = step.req_idx.long()
    counts = torch.bincount(req, minlength=real_batch)
    starts = torch.cumsum(counts, 0) - counts
    dst = req * q + (q - counts[req]) + (torch.arange(req.shape[0]) - starts[req])
    out = bucket_padding(shape, batch, width)
    # a real sequence's padding rows sit at its first new position: no later than any of its keys
    first = torch.zeros(batch, dtype=torch.int64)
    first[:real_batch] = step.positions[starts]
    out.positions = first.repeat_interleave(q)
    out.positions[dst] = step.positions
    out.input_ids[dst] = step.input_ids
    out.slot_mapping[dst] = step.slot_mapping
    out.page_table[:real_batch, : step.page_table.shape[1]] = step.page_table
    return out, dst


class _Graph:
    def __init__(self, call: Callable, shape: Uniform, batch: int, width: int, hidden_size: int | None,
                 dtype: torch.dtype, dev: torch.device, pool_handle):
        self.shape, self.batch, self.width = shape, batch, width
        self.static = bucket_padding(shape, batch, width).to(dev)
        self.hidden = None if hidden_size is None else torch.zeros(batch * shape.q, hidden_size, dtype=dtype,
                                                                     device=dev)
        args = (self.static,) if self.hidden is None else (self.static, self.hidden)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside the graph (lazy init, autotuning, allocations)
                call(*args)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool_handle):
            self.out = call(*args)  # every output of the step contract (logits, hidden)

    def run(self, step: StepInputs, hidden: torch.Tensor | None, device_ids: DeviceIds | None = None) -> StepOutput:
        padded, dst = pad_uniform(step, self.shape, self.batch, self.width)
        for name in ("input_ids", "positions", "page_table", "slot_mapping"):  # req_idx, logits rows: fixed
            getattr(self.static, name).copy_(getattr(padded, name), non_blocking=True)
        if device_ids is not None:  # token ids still on the device, over their placeholders
            rows, ids = device_ids
            self.static.input_ids.index_copy_(0, dst[rows].to(ids.device, non_blocking=True), ids)
        dst = dst.to(self.static.input_ids.device, non_blocking=True)
        if hidden is not None:
            self.hidden.index_copy_(0, dst, hidden)
        self.graph.replay()
        real = step.logits_indices.shape[0]
        out_hidden = None if self.out.hidden is None else self.out.hidden.index_select(0, dst)
        drafts = None if self.out.drafts is None else self.out.drafts[: step.page_table.shape[0]]
        return StepOutput(self.out.logits[:real], out_hidden, drafts)


class CudaGraphRunner:
    """Wraps an Engine's main program (``draft=False``) or its MTP draft program (``draft=True``,
    over the draft layer's pools): uniform steps go through captured graphs, every other step runs
    eagerly. Steps come in on the host (CPU); results are on the engine's device."""

    def __init__(self, engine: Engine, mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor],
                 max_batch: int | None = None, min_batch: int = 1, draft: bool = False,
                 call: Callable[[StepInputs], StepOutput] | None = None):
        if engine.device.type != "cuda":
            raise ValueError("CUDA graphs need an engine on a CUDA device")
        # call: a step function over the main program's step layout (the speculator's fused verify +
        # draft step) captured in place of the program itself
        self.engine, self.draft, self.call = engine, draft, call
        self.pools = (mla_pools, index_pools)
        cfg = engine.config
        cap = min(max_batch or cfg.max_batch, cfg.max_batch)
        # min_batch: the deterministic mode keeps every replayed batch a multiple of its token block
        self.buckets = tuple(b for b in BATCH_BUCKETS if min_batch <= b <= max(cap, min_batch))
        self.min_batch = min_batch
        self.widths = [MIN_WIDTH << i for i in range(32) if (MIN_WIDTH << i) <= max(cfg.max_pages_per_seq, MIN_WIDTH)]
        self.max_tokens = cfg.max_num_tokens
        self._graphs: dict[tuple[Uniform, int, int], _Graph] = {}
        self._pool_handle = torch.cuda.graph_pool_handle()

    def _call(self, step: StepInputs, hidden: torch.Tensor | None = None) -> StepOutput:
        if self.call is not None:
            return self.call(step)
        if self.draft:
            return self.engine.draft(step, hidden, *self.pools)
        return self.engine.run(step, *self.pools)

    def _eager(self, step: StepInputs, hidden: torch.Tensor | None, device_ids: DeviceIds | None = None) -> StepOutput:
        dev = self.engine.device
        padded = step.pad_tokens(self.min_batch)  # appends rows: the step's token indices stay
        if hidden is not None and padded.input_ids.shape[0] > hidden.shape[0]:
            hidden = torch.cat([hidden, hidden.new_zeros(padded.input_ids.shape[0] - hidden.shape[0], hidden.shape[1])])
        out = self._call(with_device_ids(padded.to(dev), device_ids), hidden)
        return StepOutput(out.logits[: step.logits_indices.shape[0]],
                          None if out.hidden is None else out.hidden[: step.input_ids.shape[0]],
                          None if out.drafts is None else out.drafts[: step.page_table.shape[0]])

    def bucket(self, step: StepInputs) -> tuple[Uniform, int, int] | None:
        """The graph bucket of a host step, or None (it runs eagerly)."""
        shape = uniform_shape(step)
        # the main program's last-row steps are prefills: eager (a bucket per prompt length is not worth it)
        if shape is None or shape.q > MAX_Q or not (shape.all_logits or self.draft):
            return None
        batch, width = step.page_table.shape
        b = _bucket(batch, self.buckets)
        w = _bucket(width, self.widths)
        if b is None or w is None or b * shape.q > self.max_tokens:
            return None
        return shape, b, w

    def forward(self, step: StepInputs) -> torch.Tensor:
        return self.run(step).logits

    def run(self, step: StepInputs, hidden: torch.Tensor | None = None, device_ids: DeviceIds | None = None) -> StepOutput:
        """Every output of the host step (graph replay for uniform steps, eager otherwise);
        ``hidden`` [tokens, D] on the device: the draft program's input; ``device_ids``
        (runtime/step_inputs.py DeviceIds): token ids on the device, written over the host step's
        placeholders at those token indices."""
        if step.input_ids.device.type != "cpu":
            raise ValueError("CudaGraphRunner takes the scheduler's host (CPU) step; it pads and copies it itself")
        if self.draft and hidden is None:
            raise ValueError("the draft program's steps need hidden_states")
        key = self.bucket(step)
        if key is None:
            return self._eager(step, hidden, device_ids)
        if key not in self._graphs:
            cfg = self.engine.config
            self._graphs[key] = _Graph(self._call, *key, cfg.model.hidden_size if self.draft else None,
                                       getattr(torch, cfg.dtype), self.engine.device, self._pool_handle)
        return self._graphs[key].run(step, hidden, device_ids)

    @property
    def captured(self) -> list[tuple[Uniform, int, int]]:
        """The buckets captured so far."""
        return list(self._graphs)
