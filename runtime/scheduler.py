"""Continuous batching over the page pool: what runs each step (docs/architecture.md §6).

Each schedule() packs, under a token budget: one token for every decoding request, then prefill
chunks (running chunked prefills first, then new admissions in arrival order). When a running
request needs a page and none is free or evictable, the most recently arrived running request is
preempted: its pages are released (its full pages stay in the prefix cache, so the recompute is
often mostly hits) and it goes back to the front of the waiting queue to recompute prompt +
generated tokens. Nothing is dropped and nothing raises: a request finishes only by EOS, stop
token, max_tokens, the caller (stop strings, cancel), or by outgrowing the whole pool (reason
"length": the pool is then its length limit).

Speculative decoding (``num_draft`` > 0, runtime/speculative.py): a decoding request with an MTP
state gets ``1 + num_draft`` tokens, its last known token then draft placeholders that the driver
fills before the step runs; every one of them has a logits row. update() then takes the accepted
drafts plus one token per sequence: rejected positions are simply not counted as computed (their
cache slots are rewritten later), and a page enters the prefix cache only once it is full of
accepted tokens AND the MTP layer's cache covers it (``mtp_computed``), so a prefix hit reuses
both books of the main layers and the draft layer's entries.

Driver loop (runtime/llm.py):
    step = sched.schedule()                     # None when nothing is left
    logits = engine.run(step.inputs.to(dev), mla_pools, index_pools).logits   # [B, V]
    out = sample(logits[step.sample_rows], **step.sampling_args())
    for req in sched.update(step, out.token_ids.tolist()): ... stop strings -> sched.finish()
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dsa_trt.config import PAGE_SIZE
from dsa_trt.runtime.page_pool import PagePool, page_key, pages_for
from dsa_trt.runtime.sampling import SamplingParams, TokenHistory
from dsa_trt.runtime.step_inputs import StepInputs


class RequestState(enum.Enum):
    WAITING = "waiting"  # new or preempted; holds no pages
    RUNNING = "running"  # holds pages for positions [0, num_computed) and the current chunk
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order key: lower = older; preemption picks the highest
    generator: torch.Generator | None = None  # per-request RNG for seeded sampling (make_generator)
    state: RequestState = RequestState.WAITING
    pages: list[int] = field(default_factory=list)  # page i holds positions [64 i, 64 i + 64); replaced or
    # extended (+=), never edited in place: page_row() mirrors it
    page_keys: list[bytes] = field(default_factory=list)  # chain keys of pages[:len] (full, computed)
    num_computed: int = 0  # tokens whose MLA + indexer entries are in the pages
    num_cached_tokens: int = 0  # prefix-cache hit at the latest admission
    num_preemptions: int = 0
    # speculative decoding: positions [0, mtp_computed) have their MTP-layer cache entries; `hidden`
    # holds the main model's final-norm states of positions [mtp_computed, num_computed), whose
    # entries the next step's MTP pass writes (runtime/speculative.py)
    mtp_computed: int = 0
    hidden: Any = None  # an empty one: a fused step's MTP pass covered them all and left `draft`
    draft: Any = None  # the next draft token (0-d, on the device) a fused verify step made
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    _row: torch.Tensor | None = field(default=None, repr=False)  # page_row()'s buffer
    _row_of: list[int] | None = field(default=None, repr=False)  # the pages list it mirrors
    _row_len: int = field(default=0, repr=False)
    _history: TokenHistory | None = field(default=None, repr=False)  # token_history()

    def token_history(self) -> TokenHistory:
        """The penalties' view of this request's tokens (runtime/sampling.py), made on first use."""
        if self._history is None:
            self._history = TokenHistory(self)
        return self._history

    def page_row(self) -> torch.Tensor:
        """``pages`` as an int32 tensor (a view of a buffer grown in place), the step's page-table
        row: O(new pages) per step where converting the list costs O(pages) (2,048 pages at a
        128K-token context; B=32 of them took 4 ms per step on the 2-core machine)."""
        n = len(self.pages)
        if self._row_of is not self.pages or self._row_len > n:  # replaced (admission, preemption, finish)
            self._row, self._row_of, self._row_len = torch.empty(max(2 * n, 16), dtype=torch.int32), self.pages, 0
        elif n > self._row.shape[0]:
            grown = torch.empty(2 * n, dtype=torch.int32)
            grown[: self._row_len] = self._row[: self._row_len]
            self._row = grown
        if n > self._row_len:
            self._row[self._row_len : n] = torch.tensor(self.pages[self._row_len :], dtype=torch.int32)
            self._row_len = n
        return self._row[:n]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    start: int  # first position computed this step (== request.num_computed)
    num_tokens: int
    samples: bool  # the chunk ends at the last known token, so its logits row yields a new token
    num_draft: int = 0  # trailing draft placeholders (speculative decoding); each has a logits row


@dataclass
class ScheduledStep:
    inputs: StepInputs  # on CPU; page-table row b is seqs[b], logits row b is its last token
    seqs: list[ScheduledSeq]
    sample_rows: torch.Tensor  # [S] int64 logits rows to sample (sequences with samples=True): the
    # row of the last known token; a sequence with drafts has its draft rows right after it
    preempted: list[Request]  # requests sent back to waiting while building this step
    logit_starts: list[int] = field(default_factory=list)  # seqs[b]'s first logits row
    new_tokens: dict[str, list[int]] = field(default_factory=dict)  # update(): tokens appended per request

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def sampling_requests(self) -> list[Request]:
        return [s.request for s in self.seqs if s.samples]

    def sampling_args(self) -> dict:
        """Keyword arguments of sampling.sample() for ``logits[sample_rows]``; rows with penalties
        read their requests' token histories (kept on the device, O(new tokens) per step)."""
        reqs = self.sampling_requests
        return dict(params=[r.params for r in reqs], generators=[r.generator for r in reqs],
                    histories=[r.token_history() if r.params.needs_history else None for r in reqs])


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Sequence[int] = (),
        max_model_len_note: str = "",
        num_draft: int = 0,
        lookahead: int = 0,
    ) -> None:
        """max_num_tokens: token budget per step (when more requests decode than it allows, the
        oldest go first and the rest wait a step); eos_token_ids: ModelConfig.eos_token_id; max_model_len_note:
        where max_model_len comes from (the limits it is the min of), for the refusal message;
        num_draft: draft tokens verified per decoding step (speculative decoding; 0 = off);
        lookahead: positions past a verify step's tokens whose pages it reserves (the fused MTP
        step's recurrent draft passes write there, runtime/speculative.py)."""
        limits = dict(
            max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        for name, v in limits.items():
            if v < 1:
                raise ValueError(f"Scheduler: {name}={v} must be >= 1")
        if num_draft < 0 or max_num_tokens < 1 + num_draft:
            raise ValueError(f"Scheduler: num_draft={num_draft} needs max_num_tokens >= {1 + num_draft} "
                             f"(got {max_num_tokens}): one verify step holds 1 + num_draft tokens per sequence")
        self.num_draft, self.lookahead = num_draft, lookahead
        self.pool = pool
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_model_len_note = max_model_len_note
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival
        self._active: dict[str, Request] = {}
        self._arrivals = 0
        self._in_flight: ScheduledStep | None = None
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Request:
        """Queue a request; errors now (not mid-run) when it can never be served."""
        n = len(prompt_token_ids)
        if request_id in self._active:
            raise ValueError(f"request {request_id!r} is already active")
        if n == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if n + params.max_tokens > self.max_model_len:
            why = f" (the min of {self.max_model_len_note})" if self.max_model_len_note else ""
            raise ValueError(
                f"request {request_id!r}: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                f"{n + params.max_tokens} exceeds max_model_len {self.max_model_len}{why}; "
                f"shorten the prompt or lower max_tokens"
            )
        if pages_for(n) > self.pool.num_pages:
            raise ValueError(
                f"request {request_id!r}: prompt ({n} tokens) needs {pages_for(n)} pages of {PAGE_SIZE} "
                f"tokens but the whole cache pool has {self.pool.num_pages} ({self.pool.tokens_that_fit()} "
                f"tokens); give the cache more memory or shorten the prompt"
            )
        if params.seed is not None and generator is None:
            raise ValueError(f"request {request_id!r}: seed={params.seed} needs a generator (make_generator)")
        req = Request(request_id, list(prompt_token_ids), n, params, self._arrivals, generator)
        self._arrivals += 1
        self._active[request_id] = req
        self.waiting.append(req)
        return req

    def get(self, request_id: str) -> Request | None:
        return self._active.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._active)

    def finish(self, request_id: str, reason: str = "stop", stop_reason: int | str | None = None) -> Request:
        """End a request now (the hook for stop strings found by the detokenizer) and free its pages."""
        req = self._active.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not active")
        if req.state is RequestState.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.pool.free(req.pages)
        req.pages, req.page_keys, req.hidden, req.draft = [], [], None, None
        req.state, req.finish_reason, req.stop_reason = RequestState.FINISHED, reason, stop_reason
        return req

    def cancel(self, request_id: str) -> Request:
        return self.finish(request_id, "cancelled")

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledStep | None:
        """Decide the next step; None when no request is left. Call update() before the next one."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() of the previous step")
        if not self._active:
            return None
        budget = self.max_num_tokens
        plan: dict[Request, int] = {}  # insertion order = page-table row order
        preempted: list[Request] = []
        decoding = [r for r in self.running if len(r.token_ids) - r.num_computed == 1]
        prefilling = [r for r in self.running if len(r.token_ids) - r.num_computed > 1]
        drafts: dict[Request, int] = {}
        for req in decoding + prefilling:
            if req.state is not RequestState.RUNNING or budget == 0:
                continue  # preempted as a victim earlier in this loop, or no budget left
            d = self._drafts_for(req) if req in decoding else 0
            if d and budget < 1 + d:
                continue  # the verify step waits for budget (its draft count never depends on the batch)
            n = 1 + d if d else min(len(req.token_ids) - req.num_computed, budget)
            # a verify step's pages, and those its fused draft passes write ahead (never past what a
            # sequence can hold: num_computed + n <= max_model_len already); earlier ones may be held
            ahead = self.lookahead if d else 0
            need = max(0, pages_for(min(req.num_computed + n + ahead, self.max_model_len)) - len(req.pages))
            while not self.pool.can_allocate(need):
                victim = self.running[-1]  # most recently arrived
                budget += plan.pop(victim, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.state is RequestState.RUNNING:
                req.pages += self.pool.allocate(need)
                plan[req] = n
                drafts[req] = d
                budget -= n
        # No admissions after a preemption (they would only be preempted again), unless the step
        # would otherwise be empty.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and (not preempted or not plan):
            n = self._admit(self.waiting[0], budget)
            if n == 0:
                break  # FIFO: the head waits for pages rather than being overtaken
            plan[self.waiting.popleft()] = n
            budget -= n
        if not plan:
            raise RuntimeError(
                f"scheduler made no progress: {len(self.running)} running, {len(self.waiting)} waiting, "
                f"{self.pool.describe()}"
            )
        seqs = []
        for r, n in plan.items():
            d = drafts.get(r, 0)
            seqs.append(ScheduledSeq(r, r.num_computed, n, r.num_computed + n - d == len(r.token_ids), d))
        inputs = StepInputs.build(
            # draft placeholders: token 0 until the driver writes the drafted tokens (runtime/speculative.py)
            [(s.request.token_ids[s.start : s.start + s.num_tokens - s.num_draft] + [0] * s.num_draft, s.start,
              s.request.page_row()) for s in seqs],
        )
        starts, rows, logit_rows, end = [], [], [], 0
        for s in seqs:
            end += s.num_tokens
            starts.append(len(rows))
            rows.extend(range(end - 1 - s.num_draft, end))  # the last known token, then its drafts
        if any(s.num_draft for s in seqs):
            inputs.logits_indices = torch.tensor(rows, dtype=torch.int64)
        sample_rows = torch.tensor([starts[b] for b, s in enumerate(seqs) if s.samples], dtype=torch.int64)
        self._in_flight = ScheduledStep(inputs, seqs, sample_rows, preempted, starts)
        return self._in_flight

    def _drafts_for(self, req: Request) -> int:
        """Draft tokens for a decoding request: num_draft, fewer near max_tokens / max_model_len, none
        without an MTP state (the main hidden states of its last computed positions) or for a request
        with penalties (their logits depend on the drafted history). Never depends on the batch, so a
        seeded request draws the same random numbers whatever it is batched with."""
        if not self.num_draft or req.params.needs_history:
            return 0
        if req.hidden is None or req.mtp_computed + len(req.hidden) != req.num_computed:
            return 0
        room = min(req.params.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_computed - 1)
        return max(0, min(self.num_draft, room))

    def update(self, step: ScheduledStep, sampled_tokens: Sequence[int] | torch.Tensor) -> list[Request]:
        """Record a computed step: ``sampled_tokens[i]`` is the token for ``step.sample_rows[i]``.

        Returns the requests that received a token (some now finished); the caller detokenizes
        them, streams, and calls finish() on a stop string. Requests finished or cancelled while
        the step was in flight are skipped.
        """
        if step is not self._in_flight:
            raise RuntimeError("update() must get the step returned by the last schedule()")
        self._in_flight = None
        if isinstance(sampled_tokens, torch.Tensor):
            sampled_tokens = sampled_tokens.tolist()
        if len(sampled_tokens) != len(step.sample_rows):
            raise ValueError(f"{len(sampled_tokens)} sampled tokens for {len(step.sample_rows)} sample rows")
        tokens = iter(sampled_tokens)
        got: list[Request] = []
        for seq in step.seqs:
            req = seq.request
            toks = next(tokens) if seq.samples else None
            if toks is not None and not isinstance(toks, (list, tuple)):
                toks = [toks]
            if toks is not None and not 1 <= len(toks) <= 1 + seq.num_draft:
                raise ValueError(f"request {req.request_id!r}: {len(toks)} tokens for a step with "
                                 f"{seq.num_draft} drafts (1 to {1 + seq.num_draft})")
            if req.state is not RequestState.RUNNING:
                continue
            # rejected drafts are not computed: their slots are rewritten by later steps
            req.num_computed += seq.num_tokens - seq.num_draft + (len(toks) - 1 if toks else 0)
            self._cache_full_pages(req)
            if toks is None:
                continue
            got.append(req)
            appended = step.new_tokens.setdefault(req.request_id, [])
            for tok in toks:
                req.token_ids.append(tok)
                appended.append(tok)
                p = req.params
                if tok in p.stop_token_ids:
                    self.finish(req.request_id, "stop", tok)
                elif tok in self.eos_token_ids and not p.ignore_eos:
                    self.finish(req.request_id, "stop", tok)
                elif req.num_output_tokens >= p.max_tokens or pages_for(len(req.token_ids)) > self.pool.num_pages:
                    self.finish(req.request_id, "length")
                if req.finished:
                    break
        return got

    # ------------------------------------------------------------------ internals
    def _admit(self, req: Request, budget: int) -> int:
        """Start (or restart) a waiting request: reuse its cached prefix, allocate pages for the
        first chunk. Returns the chunk length, or 0 when the pages are not there."""
        total = len(req.token_ids)
        # Hit at most the full pages before the last token: the last token is always computed
        # (it gives the logits), and it never writes into a shared page.
        hit_pages, hit_keys = self.pool.match_prefix(req.token_ids[: (total - 1) // PAGE_SIZE * PAGE_SIZE])
        start = len(hit_pages) * PAGE_SIZE
        n = min(total - start, budget)
        need = pages_for(start + n) - len(hit_pages)
        reclaimed = sum(1 for p in hit_pages if self.pool.refcount(p) == 0)  # leave the LRU on hit
        if need > self.pool.num_allocatable - reclaimed:
            return 0
        self.pool.acquire(hit_pages)
        self.pool.record_lookup(total - 1, len(hit_pages))
        req.pages = hit_pages + self.pool.allocate(need)
        req.page_keys = hit_keys
        req.num_computed = req.num_cached_tokens = req.mtp_computed = start  # hit pages hold MTP entries too
        req.hidden = req.draft = None
        req.state = RequestState.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.arrival)
        return n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.pages)
        req.pages, req.page_keys, req.num_computed = [], [], 0
        req.mtp_computed, req.hidden, req.draft = 0, None, None
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # victims go newest first, so the oldest ends up at the front

    def _cache_full_pages(self, req: Request) -> None:
        """Publish pages that became full and computed this step in the prefix cache (with speculative
        decoding: also covered by the MTP layer's cache, whose entries lag the main layers by a step)."""
        done = min(req.num_computed, req.mtp_computed) if self.num_draft else req.num_computed
        done = min(done, len(req.token_ids))  # accepted drafts are computed before update() appends them
        for i in range(len(req.page_keys), done // PAGE_SIZE):
            parent = req.page_keys[-1] if req.page_keys else None
            key = page_key(parent, req.token_ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
            self.pool.cache_page(req.pages[i], key)
            req.page_keys.append(key)
