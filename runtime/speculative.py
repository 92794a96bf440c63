"""MTP speculative decoding: draft with the engine's MTP layer, verify in one target step (docs/architecture.md §6).

Per step of the LLM (runtime/llm.py), around the one target call the scheduler planned:

1. ``propose``: the MTP pass. Every scheduled request whose main hidden states of positions
   [mtp_computed, num_computed) are pending (runtime/scheduler.py Request.hidden) gets them run
   through the draft program with the NEXT tokens (t_{i+1} at position i): that writes the MTP
   layer's cache entries of those positions, and the last row drafts d_1 for a decoding request.
   d_2..d_n reuse the layer recurrently (input d_j at position L + j - 1, hidden = the layer's own
   output z of the previous draft step). Sampled rows' drafts are written into the step's
   placeholders; greedy rows' (an argmax) stay on the device and are written over them there
   (runtime/step_inputs.py DeviceIds), so the host queues the target step while the draft runs.
2. The target step verifies: the last known token and the n drafts of each decoding request are
   n + 1 query tokens of one sequence, each with a logits row.
3. ``verify`` (the step's one device sync for greedy rows: the target's argmax and the drafts
   together): greedy rows accept the longest prefix of drafts equal to the target's argmax, then
   take the target's token at the first mismatch (or the bonus token after the last draft).
   Sampled rows use rejection sampling, which keeps the target distribution exactly: draft x_j
   (drawn from q_j, the MTP distribution after the same temperature / top-k / top-p) is accepted
   with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from
   normalise(max(p_j - q_j, 0)); if every draft is accepted the bonus token is drawn from p_n.
   The accepted positions' hidden states become the request's pending MTP input for the next step.

With ``DSA_MTP_FUSED=1`` (the default) a step in which every sequence verifies its n greedy drafts also runs
step 1 of the NEXT step (``fused_call``): the MTP pass over this step's own rows, their next tokens
the target's argmax, the next first draft taken from each sequence's last accepted row on the
device, then the n - 1 recurrent passes from there. The next step then has no draft pass of its
own (one host round, one CUDA graph per step). The recurrent passes write the MTP cache up to
n - 1 positions past the step's last row, so the scheduler reserves pages that far ahead
(``lookahead``).

Every random number of a seeded request comes from its own generator in a fixed order (d draft
uniforms, then d acceptance uniforms and one final uniform per verify step), and the draft count
of a step depends only on the request (runtime/scheduler.py ``_drafts_for``): a seeded request's
tokens do not depend on its batch neighbours. Rejected positions are not counted as computed by
the scheduler: their slots in both pools are rewritten by later steps.

Sampling with penalties (repetition / presence / frequency) is not speculated: those requests
decode one token per step in the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsa_trt.cache_layout import PAGE_SIZE
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import StepInputs, StepOutput

from .sampling import SamplingParams, sample, top_k_top_p_mask
from .step_inputs import DeviceIds, with_device_ids

METHOD = "mtp"
MAX_DRAFT_TOKENS = 8  # n of "mtp:n": more drafts than this only lowers throughput at any real acceptance


def parse_speculative(spec: str | None) -> int:
    """``None`` / "" -> 0 (off), "mtp" -> 1, "mtp:n" -> n (1 <= n <= MAX_DRAFT_TOKENS)."""
    if spec is None or spec == "":
        return 0
    if not isinstance(spec, str):
        raise ValueError(f"speculative={spec!r}: give 'mtp' or 'mtp:N' (N draft tokens per step)")
    method, _, n = spec.strip().partition(":")
    if method != METHOD:
        raise ValueError(f"speculative={spec!r}: the only method is 'mtp' (the checkpoint's MTP layer); "
                         f"give 'mtp' or 'mtp:N'")
    if not n:
        return 1
    if not n.isdigit() or not 1 <= int(n) <= MAX_DRAFT_TOKENS:
        raise ValueError(f"speculative={spec!r}: the draft count N of 'mtp:N' must be an integer in "
                         f"[1, {MAX_DRAFT_TOKENS}]")
    return int(n)


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    verify_steps: int = 0  # (sequence, step) pairs that verified at least one draft

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields per sequence: accepted drafts + the target's own token."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


# ---------------------------------------------------------------- the distributions and the acceptance rule
def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution sampling.sample() draws a sampled row from: softmax over the temperature-
    scaled logits kept by top-k / top-p, in vocabulary order. logits [R, V] -> probs [R, V] fp32."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)[:, None]
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    sorted_logits, order = torch.sort(logits.float() / temp, dim=-1, descending=True, stable=True)
    keep = top_k_top_p_mask(sorted_logits, top_k, top_p)
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row: probs [R, V] (any non-negative weights), u [R] in [0, 1)."""
    cdf = torch.cumsum(probs, dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    last = (probs > 0).long().cumsum(-1).argmax(-1, keepdim=True)  # the last token with weight (rounding guard)
    return torch.minimum(pick, last)[:, 0]


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                  u_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling, batched.

    p [B, n+1, V]: the target distributions at the n drafts and after the last; q [B, n, V]: the
    draft distributions the drafts [B, n] were drawn from; u_accept [B, n], u_final [B] uniforms.
    Returns (accepted [B]: the length k of the accepted draft prefix, tokens [B, n+1]: row b's
    emitted tokens are tokens[b, :k+1], the k accepted drafts then the corrected / bonus token)."""
    batch, n, _ = q.shape
    px = p[:, :n].gather(-1, drafts[..., None])[..., 0]  # [B, n]
    qx = q.gather(-1, drafts[..., None])[..., 0]
    ok = u_accept * qx < px  # u < p/q, i.e. accept with probability min(1, p/q)
    accepted = ok.long().cumprod(-1).sum(-1)  # [B] the first rejection, or n
    rows = torch.arange(batch, device=p.device)
    p_k = p[rows, accepted]  # [B, V]
    q_k = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, accepted]  # zero after the last draft: p_n itself
    residual = (p_k - q_k).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_k)  # p == q: never rejected anyway
    tokens = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)
    tokens[rows, accepted] = sample_from_probs(residual, u_final)
    return accepted, tokens


def _uniform(params: SamplingParams, generator: torch.Generator | None, n: int, dev: torch.device) -> torch.Tensor:
    if params.seed is not None:
        return torch.rand(n, generator=generator, device=dev)
    return torch.rand(n, device=dev)


# ---------------------------------------------------------------- the runtime hook
class MTPSpeculator:
    """The draft side of speculative decoding for one LLM: the MTP layer's pools (one layer, on the
    same page ids as the main pools) and the propose / verify hooks around each target step."""

    def __init__(self, engine, num_draft: int, num_pages: int, pad_to: int = 1, fused: bool = False,
                 max_model_len: int | None = None):
        cfg = engine.config
        if not engine.has_draft:
            raise ValueError("speculative decoding needs the engine's MTP draft program (Engine.load(..., draft=True))")
        self.engine, self.num_draft, self.pad_to = engine, num_draft, pad_to
        # fused: a greedy verify step runs the next step's draft passes in the same call
        # (fused_call), so the next step needs no draft pass of its own (DSA_MTP_FUSED)
        self.fused = fused
        # positions at or past this are never written by a fused step's recurrent passes (their
        # pages may not exist): the sequence cannot reach them
        self.max_model_len = max_model_len if max_model_len is not None else cfg.max_pages_per_seq * PAGE_SIZE
        self.fused_graphs = None  # a CudaGraphRunner over fused_call (set by the LLM on a GPU)
        self.fused_steps = 0
        self.device = engine.device
        self.mla_pools, self.index_pools = allocate_pools(cfg.model, cfg.cache_mode, num_pages, self.device,
                                                          num_layers=1)
        self.stats = SpecStats()
        self.graphs = None  # a CudaGraphRunner over the draft program and these pools (set by the LLM on a GPU)
        self._drafts: dict[int, tuple[list[int], torch.Tensor | None]] = {}  # seq index -> (drafts, q [d, V])
        self._greedy: torch.Tensor | None = None  # the step's greedy drafts, on the device (propose's device ids)

    def _draft_call(self, inputs: StepInputs, hidden: torch.Tensor, device_ids: DeviceIds | None = None) -> StepOutput:
        """The draft program on a host step; ``hidden`` on the device, ``device_ids``: token ids that
        are still on the device (written over the host step's placeholders)."""
        if self.graphs is not None:
            return self.graphs.run(inputs, hidden, device_ids)  # pads like the branch below where it runs eagerly
        # the deterministic mode's row blocks (runtime/llm.py), hidden padded alike
        return self._draft_padded(with_device_ids(inputs.to(self.device), device_ids), hidden)

    def _pick(self, seq, logits_row: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A sampled row's draft token, drawn from q (the MTP logits [V] after its sampling params), and q."""
        req = seq.request
        q = processed_probs(logits_row[None], [req.params])[0]
        u = _uniform(req.params, req.generator, 1, q.device)
        return int(sample_from_probs(q[None], u)[0]), q

    @torch.no_grad()
    def propose(self, step) -> DeviceIds | None:
        """The MTP pass over the pending positions, then the drafts into the target step.

        Sampled rows' drafts are written into ``step.inputs.input_ids``. Greedy rows' drafts (an
        argmax) never leave the device: the host goes on to the target step while the draft
        program runs, and the returned (token indices of ``step.inputs``, device ids) are written
        over the placeholders on the device; verify() reads them with the target's argmax, in the
        step's one device sync."""
        self._drafts, self._greedy = {}, None
        drafts: dict[int, list] = {}  # host ints (sampled rows), device 0-d tensors (greedy)
        for b, s in enumerate(step.seqs):  # drafted by the previous, fused step: nothing to run
            r = s.request
            if r.hidden is not None and len(r.hidden) == 0:
                if s.num_draft:  # r.draft [num_draft] on the device; fewer may be scheduled
                    drafts[b] = list(r.draft[: s.num_draft].unbind(0))
                r.hidden = r.draft = None
        pending = [(b, s) for b, s in enumerate(step.seqs) if s.request.hidden is not None]
        if not pending and not drafts:
            return None
        qs = self._draft_pass(step, pending, drafts) if pending else {}
        return self._placeholders(step, drafts, qs)

    def _draft_pass(self, step, pending, drafts: dict[int, list]) -> dict[int, list[torch.Tensor]]:
        """The MTP pass over the pending positions of ``pending`` (seq index, seq): the drafts of
        those that decode in this step go into ``drafts``; returns the sampled rows' q per draft."""
        packed, hidden, last = [], [], []
        for _, s in pending:
            r = s.request
            m, end = r.mtp_computed, r.num_computed
            packed.append((r.token_ids[m + 1 : end + 1], m, r.page_row()))  # the next token of each position
            hidden.append(r.hidden)
            last.append((last[-1] if last else -1) + end - m)
        out = self._draft_call(StepInputs.build(packed), torch.cat(hidden))
        state = {}  # seq index -> (logits row, z of its last position)
        for i, (b, s) in enumerate(pending):
            s.request.mtp_computed, s.request.hidden = s.request.num_computed, None
            if s.num_draft:
                state[b] = (out.logits[i], out.hidden[last[i]])
        drafts.update({b: [] for b in state})
        qs: dict[int, list[torch.Tensor]] = {b: [] for b in state}
        for j in range(self.num_draft):
            active = [b for b in state if step.seqs[b].num_draft > j]
            greedy = [b for b in active if step.seqs[b].request.params.greedy]
            if greedy:  # one argmax for every greedy row, left on the device
                picks = torch.stack([state[b][0] for b in greedy]).argmax(-1)
                for i, b in enumerate(greedy):
                    drafts[b].append(picks[i])
            for b in active:
                if not step.seqs[b].request.params.greedy:
                    tok, q = self._pick(step.seqs[b], state[b][0])
                    drafts[b].append(tok)
                    qs[b].append(q)
            more = [b for b in state if step.seqs[b].num_draft > j + 1]
            if not more:
                break
            # the next draft: input d_{j+1} at position L + j, hidden = the layer's previous output
            seqs = [step.seqs[b] for b in more]
            inputs = StepInputs.build([([0], s.request.num_computed + j, s.request.page_row()) for s in seqs])
            out = self._draft_call(inputs, torch.stack([state[b][1] for b in more]), self._device_ids(
                [(i, drafts[b][-1]) for i, b in enumerate(more)], inputs))
            state.update({b: (out.logits[i], out.hidden[i]) for i, b in enumerate(more)})
        return qs

    def _placeholders(self, step, drafts: dict[int, list], qs: dict[int, list[torch.Tensor]]) -> DeviceIds | None:
        """Every decoding sequence's drafts into the target step: host ones into step.inputs, device
        ones as the returned DeviceIds; records what verify() needs."""
        end, placeholders = 0, []
        for b, s in enumerate(step.seqs):
            end += s.num_tokens
            if s.num_draft:
                if b not in drafts or len(drafts[b]) != s.num_draft:
                    raise RuntimeError(f"request {s.request.request_id!r}: scheduled {s.num_draft} drafts without "
                                       "an MTP state (scheduler and speculator disagree)")
                placeholders += [(end - s.num_draft + j, d) for j, d in enumerate(drafts[b])]
                self._drafts[b] = (drafts[b], torch.stack(qs[b]) if qs.get(b) else None)
        device_ids = self._device_ids(placeholders, step.inputs)
        if device_ids is not None:
            self._greedy = device_ids[1]
            # verify's view of the drafts: greedy rows' as indices into self._greedy, until it reads them
            k = 0
            for b, (ds, q) in self._drafts.items():
                if ds and isinstance(ds[0], torch.Tensor):
                    self._drafts[b] = (list(range(k, k + len(ds))), q)
                    k += len(ds)
        return device_ids

    @staticmethod
    def _device_ids(tokens: list[tuple[int, object]], inputs: StepInputs) -> DeviceIds | None:
        """Host ints of (token index, id) go into ``inputs.input_ids``; device ones into the
        returned (indices, ids) pair, or None when there are none."""
        rows, values = [], []
        for i, t in tokens:
            if isinstance(t, torch.Tensor):
                rows.append(i)
                values.append(t)
            else:
                inputs.input_ids[i] = t
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.int64), torch.stack(values)

    # ------------------------------------------------------------ the fused verify + draft step
    @property
    def lookahead(self) -> int:
        """Positions past a verify step's last row that its fused draft passes write (the
        scheduler reserves their pages): the recurrent passes of the next step's drafts 2..n."""
        return self.num_draft - 1 if self.fused else 0

    def fuses(self, step) -> bool:
        """Whether the target step runs fused: every sequence a greedy decode with all n drafts
        (n + 1 query tokens, each with a logits row), so the MTP pass of the next step covers
        exactly this step's positions with the target's argmax as their next tokens."""
        n = self.num_draft
        return self.fused and bool(step.seqs) and all(
            s.num_draft == n and s.num_tokens == n + 1 and s.samples and s.request.params.greedy for s in step.seqs)

    def fused_call(self, step: StepInputs, main_pools) -> StepOutput:
        """The target program, then the MTP program on the same rows: at position i (rows
        (n + 1) b + j of sequence b) the next token t_{i+1} is the target's argmax there (the draft
        was that token when accepted, the correction when not), the hidden state the target's.
        Sequence b accepted k_b drafts (the longest prefix equal to the target's argmax), so its
        next first draft comes from row k_b, and drafts 2..n from the recurrent passes after it
        (input d_j at position p + j, p = the position after row k_b, hidden = the layer's own
        previous output), each over one row per sequence. Rejected rows' MTP cache entries, and the
        recurrent passes', are rewritten by the next step, like the main caches'. Device work
        only: graph capturable. ``drafts`` [B, n]."""
        n, w = self.num_draft, self.num_draft + 1
        out = self.engine.run(step, *main_pools)
        target = out.logits.argmax(-1)  # every row has a logits row, in token order
        mtp_step = StepInputs(target, step.positions, step.req_idx, step.page_table, step.slot_mapping,
                              step.logits_indices)
        mtp = self.engine.draft(mtp_step, out.hidden, self.mla_pools, self.index_pools)
        pairs = step.page_table.shape[0]
        ids, target, nxt = (t[: w * pairs].view(pairs, w) for t in (step.input_ids, target, mtp.logits.argmax(-1)))
        accepted = (ids[:, 1:] == target[:, :-1]).long().cumprod(1).sum(1, keepdim=True)  # [B, 1]
        drafts = [nxt.gather(1, accepted)[:, 0]]
        if n > 1:
            z = mtp.hidden[: w * pairs].view(pairs, w, -1)
            z = z.gather(1, accepted[..., None].expand(-1, 1, z.shape[-1]))[:, 0]
            pos = step.positions[: w * pairs].view(pairs, w).gather(1, accepted)[:, 0] + 1
            real = step.slot_mapping[: w * pairs].view(pairs, w)[:, 0] >= 0  # padding sequences write nowhere
            rows = torch.arange(pairs, device=pos.device)
            req_idx, logit_rows = rows.to(step.req_idx.dtype), rows.to(step.logits_indices.dtype)
            width = step.page_table.shape[1]
            for _ in range(n - 1):
                page = step.page_table.gather(1, (pos // PAGE_SIZE).clamp(max=width - 1)[:, None])[:, 0]
                slots = torch.where(real & (pos < self.max_model_len), page.long() * PAGE_SIZE + pos % PAGE_SIZE, -1)
                nxt_step = StepInputs(drafts[-1], pos, req_idx, step.page_table, slots, logit_rows)
                o = self._draft_padded(nxt_step, z)
                drafts.append(o.logits[:pairs].argmax(-1))
                z, pos = o.hidden[:pairs], pos + 1
        return StepOutput(out.logits, out.hidden, torch.stack(drafts, 1))

    def _draft_padded(self, inputs: StepInputs, hidden: torch.Tensor) -> StepOutput:
        """The draft program on a device step, padded to the deterministic mode's row blocks."""
        if self.pad_to > 1:
            inputs = inputs.pad_tokens(self.pad_to)
            extra = inputs.input_ids.shape[0] - hidden.shape[0]
            if extra:
                hidden = torch.cat([hidden, hidden.new_zeros(extra, hidden.shape[1])])
        return self.engine.draft(inputs, hidden, self.mla_pools, self.index_pools)

    def run_fused(self, inputs: StepInputs, device_ids: DeviceIds | None, main_pools) -> StepOutput:
        """fused_call on a host step: replayed from a CUDA graph where one is set, else eagerly."""
        self.fused_steps += 1
        if self.fused_graphs is not None:
            return self.fused_graphs.run(inputs, device_ids=device_ids)
        real = inputs.logits_indices.shape[0]
        if self.pad_to > 1:
            inputs = inputs.pad_tokens(self.pad_to)  # appends rows: the real pairs stay first
        out = self.fused_call(with_device_ids(inputs.to(self.device), device_ids), main_pools)
        return StepOutput(out.logits[:real], out.hidden, out.drafts)

    @torch.no_grad()
    def verify(self, step, out: StepOutput) -> tuple[list[list[int]], list[list[float]] | None]:
        """Tokens (accepted drafts + one) and their logprobs per sampling sequence; stores the accepted
        positions' hidden states as each request's pending MTP input."""
        logits, dev = out.logits, out.logits.device
        sampling = [(b, s) for b, s in enumerate(step.seqs) if s.samples]
        tokens: dict[int, list[int]] = {}
        # rows without drafts: the plain sampler (penalties and history included)
        plain = [(b, s) for b, s in sampling if not s.num_draft]
        if plain:
            reqs = [s.request for _, s in plain]
            rows = torch.tensor([step.logit_starts[b] for b, _ in plain], dtype=torch.int64, device=dev)
            res = sample(logits[rows], [r.params for r in reqs], [r.generator for r in reqs],
                         histories=[r.token_history() if r.params.needs_history else None for r in reqs])
            tokens.update({b: [t] for (b, _), t in zip(plain, res.token_ids.tolist())})
        # the target's argmax of every row and the greedy drafts at once (one device sync)
        argmax = greedy = None
        if any(s.num_draft and s.request.params.greedy for _, s in sampling):
            both = logits.argmax(-1)
            if self._greedy is not None:
                both = torch.cat([both, self._greedy.to(both.device)])
            both = both.tolist()
            argmax, greedy = both[: logits.shape[0]], both[logits.shape[0]:]
        for b, s in sampling:
            if not s.num_draft:
                continue
            d, (drafts, q) = s.num_draft, self._drafts[b]
            start = step.logit_starts[b]
            rows = logits[start : start + d + 1]  # [d+1, V]
            params = s.request.params
            if params.greedy:
                drafts = [greedy[i] for i in drafts]  # indices into the step's device drafts
                target = argmax[start : start + d + 1]
                k = next((j for j in range(d) if drafts[j] != target[j]), d)
                toks = drafts[:k] + [target[k]]
            else:
                p = processed_probs(rows, [params] * (d + 1))
                u = _uniform(params, s.request.generator, d + 1, dev)
                acc, t = accept_drafts(p[None], q[None], torch.tensor([drafts], device=dev), u[None, :d], u[d:])
                k = int(acc[0])
                toks = t[0, : k + 1].tolist()
            tokens[b] = toks
            self.stats.drafted += d
            self.stats.accepted += k
            self.stats.verify_steps += 1
        if out.drafts is not None:  # fused: the MTP layer already covers the accepted positions
            empty, drafts = out.hidden[:0], out.drafts.clone()  # a graph replay overwrites its outputs
            for b, s in enumerate(step.seqs):
                r = s.request
                r.mtp_computed, r.hidden, r.draft = s.start + len(tokens[b]), empty, drafts[b]
        else:
            self._store_hidden(step, out, tokens)
        order = [b for b, _ in sampling]
        logps = None
        if any(s.request.params.logprobs is not None for _, s in sampling):
            logp = torch.log_softmax(logits.float(), dim=-1)
            logps = [[float(logp[step.logit_starts[b] + j, t]) for j, t in enumerate(tokens[b])] for b in order]
        return [tokens[b] for b in order], logps

    def _store_hidden(self, step, out: StepOutput, tokens: dict[int, list[int]]) -> None:
        if out.hidden is None:
            raise RuntimeError("the target program returns no hidden states: rebuild the engine with its MTP layer")
        start, hidden = 0, None
        for b, s in enumerate(step.seqs):
            valid = s.num_tokens - s.num_draft + (len(tokens[b]) - 1 if b in tokens else 0)
            if s.request.hidden is None and s.request.mtp_computed == s.start:
                if hidden is None:  # one copy for the step: a CUDA-graph replay overwrites its output buffers
                    hidden = out.hidden.clone()
                s.request.hidden = hidden[start : start + valid]  # positions [s.start, s.start + valid)
            start += s.num_tokens
