"""Expert parallelism with data-parallel attention, and context-parallel prefill (docs/architecture.md §7).

One group of p ranks (``ParallelConfig``); every rank holds the attention, the dense MLPs, the
shared experts, the router, the embedding and lm_head whole (replicated), and, under expert
parallelism, routed experts [r*E/p, (r+1)*E/p) only.

**Expert-parallel exchange** (``ExpertParallelMoE``): a rank routes its own tokens, sends each
(token, expert) pair to the rank owning the expert and sums the weighted results it gets back,
instead of all-reducing [T, D] over the ranks. Dispatch and combine are one ``dsa::ep_all_to_all``
each over static buffers ``[p, C, row]``; the bucketing around them (cumsum, scatter, gather) is
plain graph code, so no shape depends on the routing and a decode step stays capturable.
C, the pairs a rank may send to one destination in a step, is ``T * m`` by default, with
``m = min(top_k, E/p)``: the most a rank's T tokens can route to one rank (a token's experts are
distinct), so it can never overflow; a set ``ep_capacity`` makes C that constant for every step,
bounding the buffers of long prefill steps, and a step that would overflow raises
``EPCapacityError`` on every rank (plugins/collectives.py) — never a silently dropped pair.
Dispatch rows: the bf16/fp32 token row, the global expert id + 1 (0 = empty slot) as int32, the
combine weight as fp32, packed as bytes; the expert rank applies the weight (as dsa::moe_experts
does), and the combine returns fp32 rows that the origin sums in ascending expert order (the
one-rank order). Without context parallelism each rank runs attention on its own sequences and
caches (data-parallel attention); every rank's step must then have the same token count (the
driver pads them), so the buffers of all ranks have one shape.

**Context parallelism** (interleave): a step's token i belongs to rank i % p. Each rank embeds
and projects its own tokens; before the cache writes the MLA latents (c_kv, k_pe) and the indexer
keys are all-gathered (``dsa::all_gather``) and put back into token order, so every rank writes
the whole step into its own caches and then runs the indexer, top-k and sparse MLA for its own
queries only. The gathered rows are the ones before fp8 quantisation (the network dtype): the
cache-write ops then quantise exactly as on one rank, so every rank's caches are the one-rank
caches; the cost, 2x the bytes of e4m3 rows, is O(T) per layer. After the last layer only the
rows whose logits are needed travel: each rank puts its own rows of ``logits_indices`` and zeros
elsewhere, and one ``dsa::all_reduce`` of [N, D] assembles them exactly (x + 0 = x). The MoE of a
context-parallel network runs on the rank's own tokens, with expert parallelism or with every
expert on every rank. The step's token count must be a multiple of p
(``runtime.distributed.pad_step_tokens``); padding tokens write nowhere.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.export import Dim, ExportedProgram, export

import dsa_trt.plugins.collectives  # noqa: F401  (registers dsa::all_gather, dsa::ep_all_to_all, dsa::all_reduce)
from dsa_trt.config import ConfigError, ModelConfig
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import STEP_FIELDS, StepInputs, dynamic_shapes, export_dims

from .checkpoint import Checkpoint
from .layers import MoE, fp32_linear, rope_cos_sin
from .network import DSAForCausalLM
from .program import build_network, example_step

ID_BYTES = 4  # int32 global expert id + 1 (0 = empty slot)
WEIGHT_BYTES = 4  # fp32 combine weight


@dataclass(frozen=True)
class ParallelConfig:
    """Rank ``rank`` of a group of ``size`` ranks. ``expert_parallel``: routed experts split by
    rank and exchanged; ``context_parallel``: each step's tokens interleaved over the ranks;
    ``ep_capacity``: pairs one rank may send to one destination rank in a step (None: the worst
    case of the step, which never overflows)."""

    size: int
    rank: int
    expert_parallel: bool = True
    context_parallel: bool = False
    ep_capacity: int | None = None

    def __post_init__(self):
        if self.size < 2:
            raise ConfigError(f"parallel size {self.size}: expert / context parallelism needs >= 2 ranks "
                              "(a one-rank engine is the plain network)")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"parallel rank {self.rank} not in [0, {self.size})")
        if not (self.expert_parallel or self.context_parallel):
            raise ConfigError("ParallelConfig with neither expert_parallel nor context_parallel: use the plain "
                              "network (or tensor parallelism, export/sharding.py)")
        if self.ep_capacity is not None and self.ep_capacity < 1:
            raise ConfigError(f"ep_capacity {self.ep_capacity} must be >= 1 (or None for the worst case)")

    def check(self, cfg: ModelConfig) -> None:
        if self.expert_parallel and cfg.n_routed_experts % self.size:
            raise ConfigError(f"ep={self.size} does not divide n_routed_experts = {cfg.n_routed_experts}; choose "
                              "an expert-parallel size that divides it")


def exchange_capacity(num_tokens: int, top_k: int, experts_per_rank: int, ep_capacity: int | None) -> int:
    """C of a step of ``num_tokens`` local tokens: ``ep_capacity`` when set (one static buffer for
    every step), else the step's worst case T * min(k, E/p) (grows with the step, never overflows).

    Not min(worst, ep_capacity): with a symbolic T the exported program would need guards on it."""
    return num_tokens * min(top_k, experts_per_rank) if ep_capacity is None else ep_capacity


def exchange_plan(ids: torch.Tensor, experts_per_rank: int, size: int, capacity: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] global expert ids -> (pos [T*k] row of each pair in the flat [p*C] send buffer,
    p*C for a pair past the capacity; counts [p] pairs per destination before the cap).

    Pairs keep their (token, column) order within a destination block."""
    dest = (ids.reshape(-1) // experts_per_rank).long()  # [T*k]
    onehot = F.one_hot(dest, size)  # [T*k, p]
    slot = (onehot.cumsum(0) * onehot).sum(1) - 1  # rank of the pair within its destination
    counts = onehot.sum(0)  # [p]
    pos = torch.where(slot < capacity, dest * capacity + slot, torch.full_like(slot, size * capacity))
    return pos, counts


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class ExpertParallelMoE(MoE):
    """The MoE of rank ``rank`` of ``size``: its experts [lo, hi) whole, the shared experts whole,
    the exchange instead of the all-reduce. Parameters and checkpoint names are the MoE's."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, rank: int, size: int, ep_capacity: int | None,
                 expert_op: bool = False, weight_format: str = "dequant"):
        per_rank = cfg.n_routed_experts // size
        super().__init__(cfg, dtype, (rank * per_rank, (rank + 1) * per_rank), tp_size=1, expert_op=expert_op,
                         weight_format=weight_format)
        self.rank, self.size, self.ep_capacity = rank, size, ep_capacity
        self.experts_per_rank, self.top_k = per_rank, cfg.num_experts_per_tok
        # an id no rank-local expert has: empty receive rows carry it, and dsa::moe_experts skips it
        self.foreign_expert = self.expert_hi % cfg.n_routed_experts

    def _experts_on_rows(self, x: torch.Tensor, gid: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One pair per row: x [R, D], gid [R] global id (-1 empty), w [R] -> w * expert(x) fp32 [R, D]
        (zero rows for empty slots)."""
        if self.expert_op:
            ids = torch.where(gid >= 0, gid, torch.full_like(gid, self.foreign_expert))
            return self.stacked_experts(x, ids[:, None], w[:, None])
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.expert_lo, self.expert_hi):
            c = torch.where(gid == e, w, torch.zeros_like(w))
            out = out + c[:, None] * self.experts[str(e)](x).float()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, num_tokens, dim = self.size, x.shape[0], x.shape[1]
        ids, weights = self.gate.select(x)  # [T, k] global ids, fp32 weights
        # combine in ascending expert order, as one rank sums its experts
        ids, order = ids.sort(dim=1)
        weights = weights.gather(1, order)
        cap = exchange_capacity(num_tokens, self.top_k, self.experts_per_rank, self.ep_capacity)
        pos, counts = exchange_plan(ids, self.experts_per_rank, p, cap)

        # dispatch: [token row | global id + 1 | weight] per pair, bytes; row p*C catches overflow
        k = ids.shape[1]
        rows = torch.cat([_as_bytes(x).repeat_interleave(k, dim=0),
                          _as_bytes((ids.reshape(-1, 1) + 1).to(torch.int32)),
                          _as_bytes(weights.reshape(-1, 1).float())], dim=1)  # [T*k, W]
        send = rows.new_zeros((p * cap + 1, rows.shape[1])).index_copy(0, pos, rows)
        width = rows.shape[1]
        recv = torch.ops.dsa.ep_all_to_all(send[: p * cap].view(p, cap, width), counts, p)  # [p, C, W]
        recv = recv.view(p * cap, width)
        row_bytes = dim * x.element_size()
        xr = recv[:, :row_bytes].contiguous().view(x.dtype)  # [p*C, D]
        gid = recv[:, row_bytes : row_bytes + ID_BYTES].contiguous().view(torch.int32)[:, 0].long() - 1
        wr = recv[:, row_bytes + ID_BYTES :].contiguous().view(torch.float32)[:, 0]
        y = self._experts_on_rows(xr, gid, wr)  # [p*C, D] fp32, weighted

        # combine: the results go back to the block they came from; origin sums its k pairs
        recv_counts = (gid >= 0).view(p, cap).sum(1)
        back = torch.ops.dsa.ep_all_to_all(y.view(p, cap, dim), recv_counts, p).view(p * cap, dim)
        back = torch.cat([back, back.new_zeros((1, dim))])  # the overflow row (raised before it is read)
        pair_out = back.index_select(0, pos).view(num_tokens, k, dim)
        out = torch.zeros((num_tokens, dim), dtype=torch.float32, device=x.device)
        for j in range(k):
            out = out + pair_out[:, j]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out.to(x.dtype)


class ParallelDSAForCausalLM(DSAForCausalLM):
    """DSAForCausalLM as rank ``parallel.rank`` of an expert- and/or context-parallel group (see
    the module docstring). Same arguments as DSAForCausalLM (tp_size must be 1), plus ``parallel``."""

    def __init__(self, cfg: ModelConfig, cache_mode: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                 tp_rank: int = 0, tp_size: int = 1, expert_op: bool | None = None, weight_format: str = "auto",
                 parallel: ParallelConfig | None = None):
        if parallel is None:
            raise ConfigError("ParallelDSAForCausalLM needs a ParallelConfig")
        if tp_size != 1:
            raise ConfigError(f"tp_size {tp_size}: expert / context parallelism replicates the attention; "
                              "combining it with tensor parallelism is not implemented")
        parallel.check(cfg)
        super().__init__(cfg, cache_mode, dtype, 0, 1, expert_op, weight_format)
        self.parallel = parallel
        if parallel.expert_parallel:
            for layer in self.model.layers:
                if not layer.dense_mlp:
                    layer.mlp = ExpertParallelMoE(cfg, dtype, parallel.rank, parallel.size, parallel.ep_capacity,
                                                  self.expert_op, self.weight_format)

    def forward(self, input_ids, positions, req_idx, page_table, slot_mapping, logits_indices,
                mla_pools: list[torch.Tensor], index_pools: list[torch.Tensor]) -> torch.Tensor:
        if not self.parallel.context_parallel:  # data-parallel attention over this rank's own step
            return super().forward(input_ids, positions, req_idx, page_table, slot_mapping, logits_indices,
                                   mla_pools, index_pools)
        p, r = self.parallel.size, self.parallel.rank
        num_tokens = input_ids.shape[0]
        if isinstance(num_tokens, int) and num_tokens % p:
            raise ValueError(f"context-parallel step of {num_tokens} tokens: the count must be a multiple of "
                             f"cp={p}; pad it with dsa_trt.runtime.distributed.pad_step_tokens")

        def mine(t: torch.Tensor) -> torch.Tensor:  # token i = l*p + r -> local row l
            return t.view(-1, p)[:, r].contiguous()

        def gather_cache_rows(t: torch.Tensor) -> torch.Tensor:  # [L, ...] per rank -> [L*p, ...] token order
            every = torch.ops.dsa.all_gather(t.contiguous(), p)  # [p, L, ...]
            return every.transpose(0, 1).reshape(-1, *t.shape[1:])

        local_positions = mine(positions)
        cos, sin = rope_cos_sin(local_positions, self.inv_freq, self.cfg.rope_attention_scaling())
        meta = {
            "positions": local_positions,
            "req_idx": mine(req_idx),
            "page_table": page_table,
            "slot_mapping": slot_mapping,  # the whole step's: the cache writes take the gathered rows
            "seq_lens": (local_positions + 1).to(torch.int32),
            "gather_cache_rows": gather_cache_rows,
        }
        h = self.model.embed_tokens(mine(input_ids))
        for layer, mla_pool, index_pool in zip(self.model.layers, mla_pools, index_pools):
            h = layer(h, cos, sin, meta, mla_pool, index_pool, self.cache_mode)
        owned = (logits_indices % p == r)[:, None]
        rows = torch.where(owned, h[logits_indices // p], torch.zeros((), dtype=h.dtype, device=h.device))
        h = self.model.norm(torch.ops.dsa.all_reduce(rows, p))  # each row is non-zero on one rank only
        return fp32_linear(h, self.lm_head.weight)


def build_parallel_network(ckpt: Checkpoint, cache_mode: str, dtype: torch.dtype, parallel: ParallelConfig,
                           kv_scales: list[float] | None = None, device: str | torch.device = "cpu",
                           expert_op: bool | None = None, weight_format: str = "auto") -> ParallelDSAForCausalLM:
    """Rank ``parallel.rank``'s network with the checkpoint's weights (only its routed experts under
    expert parallelism; ``expert_op`` and ``weight_format`` as build_network), in eval mode."""
    cls = functools.partial(ParallelDSAForCausalLM, parallel=parallel)
    return build_network(ckpt, cache_mode, dtype, kv_scales, device=device, expert_op=expert_op,
                         weight_format=weight_format, network_cls=cls)


def export_parallel_program(net: ParallelDSAForCausalLM, max_num_tokens: int = 8192, max_batch: int = 256,
                            max_pages_per_seq: int = 4096, device="cpu") -> ExportedProgram:
    """export_program for a parallel network: the same inputs and dims (dsa_trt/step.py), except
    that a context-parallel program's token count is ``p * tokens_per_rank`` (a multiple of p)."""
    cfg, pc = net.cfg, net.parallel
    step = example_step(cfg, device)
    if pc.context_parallel:
        n = step.input_ids.shape[0]
        step = _pad_tokens(step, -(-n // pc.size) * pc.size)
    mla, idx = allocate_pools(cfg, net.cache_mode, 4, device=device)
    dims = export_dims(max_num_tokens=max_num_tokens, max_batch=max_batch, max_pages_per_seq=max_pages_per_seq)
    if pc.context_parallel:
        dims["tokens"] = pc.size * Dim("tokens_per_rank", min=1, max=max_num_tokens // pc.size)
    with torch.no_grad():
        return export(net, step.as_tuple() + (mla, idx), dynamic_shapes=dynamic_shapes(dims, cfg.num_hidden_layers))


def _pad_tokens(step: StepInputs, num_tokens: int) -> StepInputs:
    """Tracing input only: padding tokens (slot -1) up to ``num_tokens`` (the runtime's pad_step_tokens)."""
    extra = num_tokens - step.input_ids.shape[0]
    fill = {"input_ids": 0, "positions": 0, "req_idx": 0, "slot_mapping": -1}  # the per-token fields
    fields = {}
    for f in STEP_FIELDS:
        t = getattr(step, f.name)
        fields[f.name] = torch.cat([t, t.new_full((extra,), fill[f.name])]) if f.name in fill else t
    return StepInputs(**fields)


def exchange_bytes(num_tokens: int, cfg: ModelConfig, size: int, ep_capacity: int | None,
                   itemsize: int = 2) -> dict[str, int]:
    """Bytes of one MoE layer's exchange buffers on one rank (send + receive of each direction)."""
    per_rank = cfg.n_routed_experts // size
    cap = exchange_capacity(num_tokens, cfg.num_experts_per_tok, per_rank, ep_capacity)
    dispatch_row = cfg.hidden_size * itemsize + ID_BYTES + WEIGHT_BYTES
    combine_row = cfg.hidden_size * 4
    return {"capacity": cap, "dispatch": 2 * size * cap * dispatch_row, "combine": 2 * size * cap * combine_row,
            "rows_per_destination_mean": math.ceil(num_tokens * cfg.num_experts_per_tok / size)}
