"""Per-step metadata: the one dataclass every engine's forward() takes (docs/architecture.md §3).

A step packs T tokens from B sequences (prefill chunks and decode tokens mixed). Token t belongs
to page-table row ``req_idx[t]``, sits at absolute position ``positions[t]``, sees the keys at
positions ``[0, positions[t]]`` of its own sequence (causal), and is written to cache slot
``slot_mapping[t]`` (page * 64 + offset; -1 = do not write). The engine returns logits only for
the tokens listed in ``logits_indices`` (usually the last token of each sequence in the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsa_trt.config import PAGE_SIZE


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_idx: torch.Tensor  # [T] int32, row of page_table
    page_table: torch.Tensor  # [B, max_pages] int32 (padding entries: any valid page id, e.g. 0)
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64, rows of the packed tokens whose logits are returned
    # True when every sequence in the step starts at position 0 and its length <= index_topk:
    # then the dense MHA-form prefill program is exact (top-k would select every key).
    dense_prefill: bool = False

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """The positional tensor inputs of the exported program (before the cache pools)."""
        return (
            self.input_ids,
            self.positions,
            self.req_idx,
            self.page_table,
            self.slot_mapping,
            self.logits_indices,
        )

    def to(self, device: torch.device | str) -> "StepInputs":
        return StepInputs(
            *(t.to(device, non_blocking=True) for t in self.as_tuple()), dense_prefill=self.dense_prefill
        )

    @staticmethod
    def build(
        seqs: list[tuple[list[int], int, list[int]]],
        index_topk: int,
        device: torch.device | str = "cpu",
        logits_for: str = "last",
    ) -> "StepInputs":
        """Pack sequences into a step.

        seqs: one (new_token_ids, start_position, page_ids) per sequence, where page_ids are the
        physical pages holding positions [0, start + len(new_token_ids)) of that sequence.
        logits_for: "last" (one row per sequence) or "all" (every packed token).
        """
        ids, pos, req, slots, last = [], [], [], [], []
        max_pages = max(1, max(len(p) for _, _, p in seqs))
        table = torch.zeros(len(seqs), max_pages, dtype=torch.int32)
        dense = True
        for b, (toks, start, pages) in enumerate(seqs):
            n = len(toks)
            if n == 0:
                raise ValueError(f"sequence {b} has no new tokens in this step")
            need = -(-(start + n) // PAGE_SIZE)
            if len(pages) < need:
                raise ValueError(f"sequence {b}: {len(pages)} pages cannot hold {start + n} tokens")
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            for i, tok in enumerate(toks):
                p = start + i
                ids.append(tok)
                pos.append(p)
                req.append(b)
                slots.append(pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE)
            last.append(len(ids) - 1)
            dense = dense and start == 0 and n <= index_topk
        logits_indices = list(range(len(ids))) if logits_for == "all" else last
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            req_idx=torch.tensor(req, dtype=torch.int32, device=device),
            page_table=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            dense_prefill=dense,
        )
