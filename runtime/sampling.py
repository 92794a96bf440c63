"""Sampling parameters and the batched device sampler (docs/architecture.md §6).

Order of operations per row, as in vLLM: penalties -> temperature -> top-k -> top-p -> draw.
Every parameter is a per-row tensor, so one batch mixes greedy, seeded and unseeded rows in the
same kernels. A seeded row draws exactly one uniform per token from its own torch.Generator and
selects by inverse CDF over its own sorted row, so its tokens do not depend on which other
requests share the batch (nor on preemption: the generator lives with the request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-5  # below this, logits / T overflows fp32: treat as greedy (vLLM's eps)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed range
OPENAI_PENALTY_RANGE = 2.0  # presence/frequency penalties live in [-2, 2] (OpenAI API)


@dataclass
class SamplingParams:
    """Per-request decoding settings, validated once at construction with messages naming the value.

    Stop strings are matched by the caller on detokenized text (Scheduler.finish); stop_token_ids
    and EOS (unless ignore_eos) are handled by the scheduler. logprobs=None: none returned;
    logprobs=k: the chosen token's logprob and the k most likely alternatives.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens; 1 = off
    presence_penalty: float = 0.0  # OpenAI style, over output tokens; 0 = off
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        bad = []

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_num(self.temperature) or self.temperature < 0:
            bad.append(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            bad.append(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad.append(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad.append(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            bad.append(f"seed={self.seed!r} must be None or an int in [0, 2**64)")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad.append(f"stop={self.stop!r} must be a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad.append(f"stop_token_ids={self.stop_token_ids!r} must be a list of ints >= 0")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad.append(f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or abs(v) > OPENAI_PENALTY_RANGE:
                bad.append(f"{name}={v!r} must be in [-2, 2] (0 = off)")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            bad.append(f"logprobs={self.logprobs!r} must be None or an int >= 0")
        if not isinstance(self.ignore_eos, bool):
            bad.append(f"ignore_eos={self.ignore_eos!r} must be a bool")
        if bad:
            raise ValueError("SamplingParams: " + "; ".join(bad))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_history(self) -> bool:
        """True when sampling reads previous tokens (any penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for a seeded request (None for unseeded ones)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [N] int64
    # Log-probabilities under the model's raw distribution (log_softmax of the logits, before
    # penalties/temperature/top-k/top-p), as OpenAI-style APIs report; None when no row asks.
    logprobs: torch.Tensor | None = None  # [N] fp32, of the chosen token
    top_token_ids: torch.Tensor | None = None  # [N, K] int64, K = max requested; row i uses [:k_i]
    top_logprobs: torch.Tensor | None = None  # [N, K] fp32, descending


class TokenHistory:
    """One request's tokens as the penalties read them, on the sampling device and brought up to
    date in O(new tokens) per step: ``counts`` [V] fp32 of its generated tokens, ``seen`` [V] bool
    of every token of its prompt or output. (Rebuilt from the id lists at every step they cost
    O(context): 190 ms per step at B = 32 x 32K-token prompts on the 2-core machine.) ``request``:
    anything with ``token_ids`` (prompt then generated, only ever appended to) and
    ``num_prompt_tokens`` (runtime/scheduler.py Request)."""

    def __init__(self, request):
        self.request = request
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self._synced = 0  # token_ids[:_synced] are in counts / seen

    def rows(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ids, n_prompt = self.request.token_ids, self.request.num_prompt_tokens
        if self.counts is None or self.counts.device != device or self.counts.shape[0] != vocab:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if n_prompt:
                self.seen[torch.tensor(ids[:n_prompt], dtype=torch.int64, device=device)] = True
            self._synced = n_prompt
        if len(ids) > self._synced:
            new = torch.tensor(ids[self._synced :], dtype=torch.int64, device=device)
            self.counts.index_put_((new,), torch.ones_like(new, dtype=torch.float32), accumulate=True)
            self.seen[new] = True
            self._synced = len(ids)
        return self.counts, self.seen


def _history_rows(n: int, vocab: int, dev: torch.device, prev_tokens,
                  prompt_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [N, V] fp32 of the generated tokens, seen [N, V] bool of prompt or generated) from id lists."""
    outputs = [list(prev_tokens[i]) if prev_tokens else [] for i in range(n)]
    prompts = [list(prompt_tokens[i]) if prompt_tokens else [] for i in range(n)]

    def row_token_index(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [i for i, toks in enumerate(lists) for _ in toks]
        cols = [t for toks in lists for t in toks]
        return torch.tensor(rows, dtype=torch.int64, device=dev), torch.tensor(cols, dtype=torch.int64, device=dev)

    counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
    r, c = row_token_index(outputs)
    counts.index_put_((r, c), torch.ones_like(c, dtype=torch.float32), accumulate=True)
    seen = counts > 0
    r, c = row_token_index(prompts)
    seen[r, c] = True
    return counts, seen


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prev_tokens: Sequence[Sequence[int]] | None,
    prompt_tokens: Sequence[Sequence[int]] | None,
    histories: Sequence[TokenHistory | None] | None = None,
) -> torch.Tensor:
    """Repetition (HF: divide positive / multiply negative logits of seen tokens, prompt included)
    then presence and frequency (OpenAI: subtract per generated-token count). Rows without
    penalties are untouched bit for bit (neutral values are exact in fp32). A row's tokens come
    from ``histories[i]`` where given (the runtime's), else from its id lists."""
    n, vocab = logits.shape
    dev = logits.device
    if histories is not None:
        rows = [h.rows(vocab, dev) if h is not None else None for h in histories]
        zero_counts = torch.zeros(vocab, dtype=torch.float32, device=dev)
        zero_seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        counts = torch.stack([r[0] if r else zero_counts for r in rows])
        seen = torch.stack([r[1] if r else zero_seen for r in rows])
    else:
        counts, seen = _history_rows(n, vocab, dev, prev_tokens, prompt_tokens)

    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    return logits - freq * counts - pres * (counts > 0).float()


def top_k_top_p_mask(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep-mask over descending-sorted logits [N, V]: the first k (k = 0: all), then the smallest
    prefix of those whose probability mass reaches p (a token is kept if the mass before it < p)."""
    vocab = sorted_logits.shape[-1]
    rank = torch.arange(vocab, device=sorted_logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    keep = rank < k
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # top_p = 1 is "off": fp32 cumsum can pass 1.0 before the tail and would drop real tokens
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep[:, 0] = True  # never empty, even if rounding says otherwise
    return keep


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    prev_tokens: Sequence[Sequence[int]] | None = None,
    prompt_tokens: Sequence[Sequence[int]] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
) -> SampleOutput:
    """Pick one token per row of ``logits`` [N, V] fp32 (any device); everything stays on device.

    generators[i]: row i's torch.Generator (on logits.device), required for seeded rows.
    prev_tokens[i] / prompt_tokens[i]: row i's generated / prompt token ids, read only for rows
    with penalties (``SamplingParams.needs_history``); pass [] for the others. ``histories[i]``
    (the runtime's, O(new tokens) per step): row i's TokenHistory instead of those lists, None
    for rows without penalties.
    """
    n, vocab = logits.shape
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} logits rows")
    dev = logits.device
    logits = logits.float()
    raw = logits
    if any(p.needs_history for p in params):
        logits = apply_penalties(logits, params, prev_tokens, prompt_tokens, histories)
    tokens = torch.argmax(logits, dim=-1)  # [N] greedy choice, replaced below for sampled rows
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, dtype=torch.int64, device=dev)
        sub = [params[i] for i in rows]
        temp = torch.tensor([p.temperature for p in sub], dtype=torch.float32, device=dev)[:, None]
        top_k = torch.tensor([p.top_k for p in sub], dtype=torch.int64, device=dev)
        top_p = torch.tensor([p.top_p for p in sub], dtype=torch.float32, device=dev)
        scaled = logits[idx] / temp  # [R, V]
        # stable sort: equal logits keep vocab order, so a row's choice is a function of the row
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        keep = top_k_top_p_mask(sorted_logits, top_k, top_p)
        probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)  # [R, V]
        cdf = torch.cumsum(probs, dim=-1)
        u = _uniforms(sub, [generators[i] if generators else None for i in rows], dev)  # [R]
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # [R, 1]
        # u * total can round up to total: fall back to the last token with nonzero probability
        pick = torch.minimum(pick, (probs > 0).sum(-1, keepdim=True) - 1)
        tokens[idx] = order.gather(1, pick)[:, 0]
    out = SampleOutput(token_ids=tokens)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if asked:
        logp = torch.log_softmax(raw, dim=-1)
        out.logprobs = logp.gather(1, tokens[:, None])[:, 0]
        k = min(max(asked), vocab)
        if k > 0:
            out.top_logprobs, out.top_token_ids = torch.topk(logp, k, dim=-1)
    return out


def _uniforms(
    params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None], dev: torch.device
) -> torch.Tensor:
    """One U[0,1) per row: seeded rows from their own generator, the rest from the global RNG."""
    u = torch.rand(len(params), device=dev)
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.seed is not None:
            if g is None:
                raise ValueError(f"row {i} has seed={p.seed} but no generator; use make_generator()")
            u[i] = torch.rand((), generator=g, device=dev)
    return u
