"""What the tiny model's training records to train its indexers (export/train_tiny.py): the V3.2
report's KL objective between a layer's attention distribution and its indexer's scores.

An IndexerTap stands in for an HF indexer's forward (differentiable scores from detached inputs);
the Recorder keeps, per attention layer, those scores, the selection and the attention
probabilities, and per MoE router the selected experts (for expert balancing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class IndexerTap:
    """Stands in for an HF indexer's forward while training: computes its scores,
    differentiably and from detached inputs (HF's forward runs under no_grad and returns only
    the indices), keeps those of the first ``rows`` batch rows for the KL loss and returns the
    top-k as HF does. ``dense`` (top-k off): every key is selected, so only those rows are scored."""

    def __init__(self, indexer: nn.Module) -> None:
        self.indexer = indexer
        self.rows: int | None = None  # None: every row
        self.dense = False
        self.scores: torch.Tensor | None = None  # [rows, S, T]
        self.selected: torch.Tensor | None = None  # [B, S, k]
        indexer.forward = self.forward  # instance attribute: shadows the class's forward

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
        if cache is not None:
            raise ValueError("IndexerTap is for cache-less training forwards (use_cache=False)")
        cos, sin = position_embeddings
        x, q, mask = hidden_states.detach(), q_resid.detach(), attention_mask
        b, s, t = x.shape[0], x.shape[1], attention_mask.shape[-1]
        r = b if self.rows is None else min(self.rows, b)
        self.scores = indexer_scores(self.indexer, *(_rows(v, 0, r) for v in (x, q, cos, sin, mask)))
        if self.dense:
            # Every key (the causal mask removes the future ones): the scores' order is irrelevant.
            self.selected = torch.arange(t, device=x.device).expand(b, s, t)
            return self.selected.to(torch.int32)
        scores = self.scores.detach()
        if r < b:
            with torch.no_grad():
                rest = indexer_scores(self.indexer, *(_rows(v, r, b) for v in (x, q, cos, sin, mask)))
            scores = torch.cat([scores, rest])
        topk = min(self.indexer.index_topk, t)
        self.selected = scores.topk(topk, dim=-1).indices
        return self.selected.to(torch.int32)

    def remove(self) -> None:
        del self.indexer.forward


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Batch rows [start, stop) of ``t``; a batch dim of 1 (rope tables, masks) broadcasts."""
    return t if t.shape[0] == 1 else t[start:stop]


class Recorder:
    """Indexer taps and forward hooks that keep, per attention layer, the indexer's scores and
    selection and the attention probabilities, and per MoE router the selected experts."""

    def __init__(self, attentions: list[nn.Module], routers: list[nn.Module]) -> None:
        self.taps = [IndexerTap(attn.indexer) for attn in attentions]
        self.probs: list[torch.Tensor | None] = [None] * len(attentions)
        self.routed: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = []
        for i, attn in enumerate(attentions):
            self._handles.append(attn.register_forward_hook(self._attention_hook(i)))
        for i, router in enumerate(routers):
            self._handles.append(router.register_forward_hook(self._router_hook(i)))

    def _attention_hook(self, i: int):
        def hook(module, args, output):
            self.probs[i] = output[1].detach()  # [B, H, S, T]

        return hook

    def _router_hook(self, i: int):
        def hook(module, args, output):
            self.routed[i] = output[2].detach()  # [tokens, k]

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for tap in self.taps:
            tap.remove()


def indexer_scores(indexer: nn.Module, x, q_resid, cos, sin, mask) -> torch.Tensor:
    """HF DeepseekV32Indexer's scores I[b, s, t] before top-k (its forward, L190-235), in a
    differentiable form: I = sum_h w[h] / sqrt(H) * ReLU(q[h] . k / sqrt(D)) + mask. -> [B, S, T] fp32."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    b, s, _ = x.shape
    h, d, rope = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(b, s, h, d)  # [B, S, H, D]
    k = indexer.k_norm(indexer.wk(x)).unsqueeze(2)  # [B, S, 1, D]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1).float().view(b, s * h, d)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2).float()  # [B, T, D]
    # One [S*H, D] x [D, T] product per sequence (not S small ones): same sums, far fewer calls.
    scores = F.relu(torch.bmm(q, k.transpose(1, 2)) * indexer.softmax_scale).view(b, s, h, -1)  # [B, S, H, T]
    weights = indexer.weights_proj(x.float()).float() * h**-0.5  # [B, S, H]
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]
    if mask.dtype == torch.bool:
        return index_scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    return index_scores + mask


def indexer_kl(scores: torch.Tensor, selected: torch.Tensor, probs: torch.Tensor, sparse: bool) -> torch.Tensor:
    """Mean over queries of KL(p_t || softmax(I_t)), p_t = attention ``probs`` [B, H, S, T] summed
    over heads and L1-normalised, I = ``scores`` [B, S, T]. ``sparse``: both distributions
    restricted to the ``selected`` keys [B, S, k] (the attention is already). Only the first
    ``scores.shape[0]`` rows count (the rows the indexer trains on)."""
    rows = scores.shape[0]
    probs, selected = probs[:rows], selected[:rows]
    target = probs.sum(dim=1)  # [B, S, T]
    target = target / target.sum(dim=-1, keepdim=True)
    if sparse:
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, selected, True)
        scores = scores.masked_fill(~keep, torch.finfo(torch.float32).min)
    log_q = F.log_softmax(scores, dim=-1)
    # xlogy: masked keys have p = 0 and log q ~ -3e38; 0 * log 0 must read 0, not nan.
    kl = torch.xlogy(target, target) - target * log_q
    return kl.sum(dim=-1).mean()
