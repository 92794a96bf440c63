"""The step contract: the inputs of one engine step, defined once (docs/architecture.md §3).

A step packs T tokens from B sequences (prefill chunks and decode tokens mixed). Token t belongs
to page-table row ``req_idx[t]``, sits at absolute position ``positions[t]``, sees the keys at
positions ``[0, positions[t]]`` of its own sequence (causal), and is written to cache slot
``slot_mapping[t]`` (page * 64 + offset; -1 = do not write). The engine returns logits only for
the tokens listed in ``logits_indices`` (usually the last token of each sequence in the step).

The ``StepInputs`` dataclass below IS the field table: each tensor field carries its dtype, its
shape in named dims and its padding value (``step_field``). Everything that restates the step
derives from it: the exported program's positional inputs and dynamic shapes (``export_dims``,
``dynamic_shapes``), the ONNX input and dim names (``onnx_dim_names``), the TensorRT bindings
(``STEP_INPUT_NAMES``), the tensor-parallel broadcast (runtime/distributed.py), the CUDA-graph
static buffers (``StepInputs.padding``) and the Triton step model (runtime/triton/repository.py).

Program I/O around the step inputs: the per-layer cache pools ``mla_pools_<l>`` and
``index_pools_<l>`` (dim 0 ``pool_pages``), then the outputs ``STEP_OUTPUTS``: ``logits``
[logit_rows, vocab] fp32 and, in programs built for speculative decoding (engine_config.json
``mtp_layers`` > 0), ``hidden`` [tokens, hidden_size] in the activation dtype; in the ONNX /
TensorRT form ``<pool input>_out`` (aliased to each written pool) follow them.

``hidden`` is returned for every packed token, not only the logits rows (a documented equivalent of
"the hidden states at the logits rows"): the MTP layer keeps its own cache, so every computed
position needs its draft-layer entry, which is made from that position's main hidden state. The
main program's ``hidden`` is its final-norm output (the lm_head input, MODEL.md §5); the draft
program (export/mtp.py) takes it as the extra input ``DRAFT_HIDDEN_INPUT`` after the step tensors
and returns its own layer output as ``hidden`` (fed back for the next draft token).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Mapping, NamedTuple, Union

import torch
from torch.nn.utils.rnn import pad_sequence

from dsa_trt.cache_layout import PAGE_SIZE

ROW = "row"  # padding value of a field whose padding rows hold their own row index (0, 1, 2, ...)
Pad = Union[int, str, None]  # an int: fill value; ROW: the row index; None: any value (never read)


@dataclass(frozen=True)
class StepDim:
    """A dynamic dimension of the step: its name in every compiled form and its bounds. ``limit``
    names the EngineConfig field (and export_program argument) that bounds it; ``max`` is used
    when it has none."""

    name: str
    min: int
    limit: str | None = None
    max: int | None = None


STEP_DIMS = (
    StepDim("tokens", 1, "max_num_tokens"),  # packed tokens of the step (T)
    StepDim("batch", 1, "max_batch"),  # sequences in the step (B), rows of the page table
    StepDim("pages_per_seq", 1, "max_pages_per_seq"),  # page-table width
    StepDim("logit_rows", 1, "max_num_tokens"),  # rows of logits returned (N)
)
# dim 0 of every cache pool; min 2 so that tracing does not specialise a one-page pool
POOL_PAGES = StepDim("pool_pages", 2, None, 1 << 24)
POOL_INPUTS = ("mla_pools", "index_pools")  # the program's pool arguments after the step tensors
LOGITS = "logits"
HIDDEN = "hidden"
STEP_OUTPUTS = (LOGITS, HIDDEN)  # the program outputs, in order (``hidden`` only in MTP-enabled engines)
DRAFT_HIDDEN_INPUT = "hidden_states"  # the draft program's input after the step tensors: [tokens, hidden_size]
POOL_OUTPUT_SUFFIX = "_out"


class StepOutput(NamedTuple):
    """What one program call returns: ``logits`` [logit_rows, vocab] fp32 and ``hidden``
    [tokens, hidden_size] (None when the program does not return it). ``drafts`` is the runtime's,
    never a program's: the next draft token per sequence [batch] of a fused MTP verify step
    (runtime/speculative.py)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    drafts: torch.Tensor | None = None

    @classmethod
    def of(cls, result) -> "StepOutput":
        """A program's raw result (a tensor, or a tuple in STEP_OUTPUTS order) as a StepOutput."""
        if isinstance(result, torch.Tensor):
            return cls(result)
        result = tuple(result)
        if not 1 <= len(result) <= len(STEP_OUTPUTS):
            raise ValueError(f"a step program returns {STEP_OUTPUTS}, got {len(result)} outputs")
        return cls(*result)


def output_names(with_hidden: bool) -> tuple[str, ...]:
    """The program's output names (before the ONNX form's pool outputs)."""
    return STEP_OUTPUTS if with_hidden else STEP_OUTPUTS[:1]


@dataclass(frozen=True)
class StepField:
    name: str
    dtype: torch.dtype
    dims: tuple[str, ...]  # STEP_DIMS names, one per axis
    pad: Pad  # the value of padding rows in a CUDA-graph bucket (see StepInputs.padding)
    doc: str


_META = "dsa_trt.step"


def step_field(dtype: torch.dtype, dims: tuple[str, ...], pad: Pad, doc: str):
    """A tensor field of StepInputs with its contract (collected into STEP_FIELDS)."""
    return field(metadata={_META: (dtype, dims, pad, doc)})


@dataclass
class StepInputs:
    input_ids: torch.Tensor = step_field(torch.int64, ("tokens",), None, "token id of each packed token")
    positions: torch.Tensor = step_field(torch.int64, ("tokens",), 0, "absolute position in its sequence")
    req_idx: torch.Tensor = step_field(torch.int32, ("tokens",), ROW, "its row of page_table")
    # padding entries of a row: any valid page id (the kernels read them only below the row's length)
    page_table: torch.Tensor = step_field(torch.int32, ("batch", "pages_per_seq"), 0, "physical pages per row")
    slot_mapping: torch.Tensor = step_field(torch.int64, ("tokens",), -1, "cache slot written; -1 = none")
    logits_indices: torch.Tensor = step_field(torch.int64, ("logit_rows",), ROW,
                                              "packed rows whose logits are returned")

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """The positional tensor inputs of the exported program (before the cache pools)."""
        return tuple(getattr(self, f.name) for f in STEP_FIELDS)

    def to(self, device: torch.device | str) -> "StepInputs":
        moved = (t.to(device, non_blocking=True) for t in self.as_tuple())
        return StepInputs(*moved)

    def dim_sizes(self) -> dict[str, int]:
        """STEP_DIMS name -> this step's size (read from the first field that has the dim)."""
        sizes: dict[str, int] = {}
        for f in STEP_FIELDS:
            shape = getattr(self, f.name).shape
            for axis, name in enumerate(f.dims):
                sizes.setdefault(name, shape[axis])
        return sizes

    def pad_tokens(self, multiple: int) -> "StepInputs":
        """This step with padding tokens appended so the token count is a multiple of ``multiple``.

        Padding tokens write nowhere (slot -1) and sit at position 0 of page-table row 0 (one valid
        key); the logits rows are padded the same way (repeats of packed row 0), so the first rows
        of the result are the unpadded step's. The deterministic mode pads
        every step this way: the linears then always see a whole number of ``multiple``-row blocks,
        and a row's result no longer depends on how many rows the step has (docs/architecture.md §8).
        """
        sizes = self.dim_sizes()
        extra = {"tokens": -sizes["tokens"] % multiple, "logit_rows": -sizes["logit_rows"] % multiple}
        if not any(extra.values()):
            return self
        padded = []
        for f in STEP_FIELDS:
            t = getattr(self, f.name)
            n = extra.get(f.dims[0], 0)
            if n:
                # token padding: row 0 of page_table (a valid row); logits padding: repeats of row 0
                value = 0 if f.pad in (None, ROW) else f.pad
                t = torch.cat([t, t.new_full((n, *t.shape[1:]), value)])
            padded.append(t)
        return StepInputs(*padded)

    @staticmethod
    def padding(sizes: Mapping[str, int], device: torch.device | str = "cpu") -> "StepInputs":
        """A step of the given dim sizes holding only padding rows: slot -1 (writes nowhere),
        position 0 and page 0 (attends to one valid key), req_idx / logits_indices = the row
        index. The static buffers of a CUDA-graph bucket; ``input_ids`` (pad None) is zeros."""
        tensors = []
        for f in STEP_FIELDS:
            shape = tuple(sizes[d] for d in f.dims)
            if f.pad == ROW:
                if len(shape) != 1:
                    raise ValueError(f"{f.name}: row-index padding needs a 1-d field, got dims {f.dims}")
                tensors.append(torch.arange(shape[0], dtype=f.dtype, device=device))
            else:
                tensors.append(torch.full(shape, f.pad or 0, dtype=f.dtype, device=device))
        return StepInputs(*tensors)

    @staticmethod
    def build(
        seqs: list[tuple[list[int], int, list[int] | torch.Tensor]],
        device: torch.device | str = "cpu",
        logits_for: str = "last",
    ) -> "StepInputs":
        """Pack sequences into a step.

        seqs: one (new_token_ids, start_position, page_ids) per sequence, where page_ids (a list,
        or an int32 tensor such as runtime/scheduler.py Request.page_row()) are the physical pages
        holding positions [0, start + len(new_token_ids)) of that sequence.
        logits_for: "last" (one row per sequence) or "all" (every packed token).
        Host cost: O(new tokens) Python work, plus O(pages) per list page row (a tensor row is one
        copy: at 128K-token contexts a row holds 2,048 pages).
        """
        ids, pos, req, last, rows = [], [], [], [], []
        for b, (toks, start, pages) in enumerate(seqs):
            n = len(toks)
            if n == 0:
                raise ValueError(f"sequence {b} has no new tokens in this step")
            if len(pages) * PAGE_SIZE < start + n:
                raise ValueError(f"sequence {b}: {len(pages)} pages cannot hold {start + n} tokens")
            rows.append(pages if isinstance(pages, torch.Tensor) else torch.tensor(pages, dtype=torch.int32))
            ids.extend(toks)
            pos.extend(range(start, start + n))
            req.extend([b] * n)
            last.append(len(ids) - 1)
        table = pad_sequence(rows, batch_first=True)  # zero-padded: [batch, most pages]
        positions = torch.tensor(pos, dtype=torch.int64)
        req_idx = torch.tensor(req, dtype=torch.int32)
        slots = table[req_idx.long(), positions // PAGE_SIZE].long() * PAGE_SIZE + positions % PAGE_SIZE
        logits_indices = torch.arange(len(ids)) if logits_for == "all" else torch.tensor(last, dtype=torch.int64)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            req_idx=req_idx.to(device),
            page_table=table.to(device),
            slot_mapping=slots.to(device),
            logits_indices=logits_indices.to(device),
        )


STEP_FIELDS = tuple(StepField(f.name, *f.metadata[_META]) for f in fields(StepInputs) if _META in f.metadata)
STEP_INPUT_NAMES = tuple(f.name for f in STEP_FIELDS)  # program / ONNX / TensorRT input names, in order


def _check_table() -> None:
    known = {d.name for d in STEP_DIMS}
    for f in STEP_FIELDS:
        unknown = [d for d in f.dims if d not in known]
        if unknown:
            raise AssertionError(f"StepInputs.{f.name}: dims {unknown} are not in STEP_DIMS")
    used = {d for f in STEP_FIELDS for d in f.dims}
    if used != known:
        raise AssertionError(f"STEP_DIMS {sorted(known - used)} appear in no StepInputs field")


_check_table()


def pool_input_name(kind: str, layer: int) -> str:
    """``mla_pools_<l>`` / ``index_pools_<l>``: the flattened name of a pool argument."""
    if kind not in POOL_INPUTS:
        raise ValueError(f"pool kind {kind!r} not in {POOL_INPUTS}")
    return f"{kind}_{layer}"


def dim_bounds(max_num_tokens: int, max_batch: int, max_pages_per_seq: int) -> dict[str, tuple[int, int]]:
    """Every dynamic dim (the step's and pool_pages) -> (min, max) for these engine limits."""
    limits = {"max_num_tokens": max_num_tokens, "max_batch": max_batch, "max_pages_per_seq": max_pages_per_seq}
    bounds = {}
    for d in (*STEP_DIMS, POOL_PAGES):
        hi = limits[d.limit] if d.limit is not None else d.max
        if hi is None or hi < d.min:
            raise ValueError(f"dim {d.name}: max {hi} (from {d.limit or 'its fixed max'}) is below its min {d.min}")
        bounds[d.name] = (d.min, hi)
    return bounds


def export_dims(max_num_tokens: int, max_batch: int, max_pages_per_seq: int) -> dict:
    """Dim name -> torch.export.Dim (one symbol per name, shared by every input that has it)."""
    from torch.export import Dim

    return {name: Dim(name, min=lo, max=hi)
            for name, (lo, hi) in dim_bounds(max_num_tokens, max_batch, max_pages_per_seq).items()}


def dynamic_shapes(dims: Mapping, num_layers: int, draft: bool = False) -> tuple:
    """torch.export dynamic_shapes of ``program(*step.as_tuple(), mla_pools, index_pools)``; with
    ``draft``, of ``draft_program(*step.as_tuple(), hidden_states, mla_pools, index_pools)``."""
    step = tuple({axis: dims[name] for axis, name in enumerate(f.dims)} for f in STEP_FIELDS)
    extra = ({0: dims["tokens"]},) if draft else ()
    pools = [{0: dims[POOL_PAGES.name]}] * num_layers
    return step + extra + tuple(pools for _ in POOL_INPUTS)


def onnx_dim_names() -> dict[tuple[str, int], str]:
    """(graph input, axis) -> dim name: the first input axis that carries each dim (one symbol per
    name in the exported graph, so naming that axis names the dim everywhere)."""
    names: dict[tuple[str, int], str] = {}
    seen: set[str] = set()
    for f in STEP_FIELDS:
        for axis, name in enumerate(f.dims):
            if name not in seen:
                names[(f.name, axis)] = name
                seen.add(name)
    names[(pool_input_name(POOL_INPUTS[0], 0), 0)] = POOL_PAGES.name
    return names
