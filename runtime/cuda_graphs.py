"""Decode steps replayed from CUDA graphs, one per (batch, page-table width) bucket (docs/architecture.md §6).

A decode-only step (one new token per sequence) is padded to the next batch bucket and the next
power-of-two page-table width, copied into static input buffers, and replayed. The buffers and
their padding values come from the step contract (dsa_trt/step.py, ``StepInputs.padding``):
padding rows write nowhere (slot -1), attend to one key of page 0 and their logits are dropped,
so the real rows are exactly what the eager call computes. Graphs are captured lazily, on first use of a
bucket, and share one memory pool.
"""

from __future__ import annotations

import torch

from dsa_trt.step import ROW, STEP_FIELDS, StepInputs, StepOutput

from .engine import Engine

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 8  # pages per sequence of the smallest width bucket


# per replay: fields padded with a value are refilled, then the step's rows copied in; row-index
# fields (req_idx, logits_indices) already equal a decode step's; pad None: padding rows read any
# value, so only the real rows are copied
_COPIED = tuple((f.name, f.pad) for f in STEP_FIELDS if f.pad != ROW)


def _bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


def copy_step(static: StepInputs, step: StepInputs) -> None:
    """Load a decode step into the static buffers of a bigger bucket (``StepInputs.padding``)."""
    for name, pad in _COPIED:
        buf, src = getattr(static, name), getattr(step, name)
        if pad is not None:
            buf.fill_(pad)
        buf[tuple(slice(0, n) for n in src.shape)].copy_(src, non_blocking=True)


class _Graph:
    def __init__(self, engine: Engine, batch: int, width: int, pools, pool_handle):
        dev = engine.device
        # a decode bucket: one token and one logits row per sequence
        step = StepInputs.padding({"tokens": batch, "batch": batch, "pages_per_seq": width, "logit_rows": batch}, dev)
        self.static = step
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside the graph (lazy init, autotuning, allocations)
                engine.forward(step, *pools)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool_handle):
            self.out = engine.run(step, *pools)  # every output of the step contract (logits, hidden)

    def run(self, step: StepInputs) -> StepOutput:
        copy_step(self.static, step)
        self.graph.replay()
        n = step.page_table.shape[0]  # a decode step: one token and one logits row per sequence
        return StepOutput(self.out.logits[:n], None if self.out.hidden is None else self.out.hidden[:n])


class CudaGraphRunner:
    """Wraps an Engine: decode-only steps go through captured graphs, everything else runs eagerly."""

    def __init__(self, engine: Engine, mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor],
                 max_batch: int | None = None, min_batch: int = 1):
        if engine.device.type != "cuda":
            raise ValueError("CUDA graphs need an engine on a CUDA device")
        self.engine = engine
        self.pools = (mla_pools, index_pools)
        cap = min(max_batch or engine.config.max_batch, engine.config.max_batch)
        # min_batch: the deterministic mode keeps every replayed batch a multiple of its token block
        self.buckets = tuple(b for b in BATCH_BUCKETS if min_batch <= b <= max(cap, min_batch))
        self.min_batch = min_batch
        self.max_width = engine.config.max_pages_per_seq
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool_handle = torch.cuda.graph_pool_handle()

    @staticmethod
    def is_decode(step: StepInputs) -> bool:
        # one token per sequence, each sequence's logits row is its token
        return (step.input_ids.shape[0] == step.page_table.shape[0]
                and step.logits_indices.shape[0] == step.input_ids.shape[0])

    def forward(self, step: StepInputs) -> torch.Tensor:
        return self.run(step).logits

    def run(self, step: StepInputs) -> StepOutput:
        """Every output of the step (graph replay for decode steps, eager otherwise)."""
        batch, width = step.page_table.shape
        b = _bucket(batch, self.buckets)
        w = _bucket(width, [MIN_WIDTH << i for i in range(32) if (MIN_WIDTH << i) <= max(self.max_width, MIN_WIDTH)])
        if not self.is_decode(step) or b is None or w is None:
            return self.engine.run(step.pad_tokens(self.min_batch), *self.pools)
        key = (b, w)
        if key not in self._graphs:
            self._graphs[key] = _Graph(self.engine, b, w, self.pools, self._pool_handle)
        return self._graphs[key].run(step)
