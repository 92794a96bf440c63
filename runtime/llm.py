"""`LLM(engine_dir).generate(prompts, params)`: the user-facing runtime API (docs/architecture.md §6).

One LLM drives one engine over the paged dual caches with continuous batching. ``step()`` runs
one engine step and returns the per-request deltas, which ``generate`` (batch, outputs in input
order), ``stream`` (a per-request iterator) and the Triton model build on. Thread-safe: requests
can be added or cancelled from other threads while one thread steps.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from dsa_trt.config import PAGE_SIZE
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import StepInputs, StepOutput

from . import knobs
from .engine import Engine
from .page_pool import PagePool
from .sampling import SamplingParams, make_generator, sample
from .scheduler import Request, Scheduler
from .speculative import MTPSpeculator, SpecStats, parse_speculative
from .step_inputs import DeviceIds, with_device_ids
from .tokenizer import TextDecoder, Tokenizer

DETERMINISTIC_TOKEN_BLOCK = 16  # rows per linear block in the deterministic mode (docs/architecture.md §8)
DEFAULT_CPU_PAGES = 512  # 32K tokens of cache on the CPU unless DSA_NUM_PAGES says otherwise


FINISH_REASONS = ("stop", "length", "cancelled", "error")  # stop: EOS / stop token / stop string


@dataclass
class CompletionOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # FINISH_REASONS; None while still running
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepDelta:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    output: CompletionOutput  # the request's state after this step


def _kernels_capturable() -> bool:
    """DSA_KERNELS=reference runs the plain-torch ops, whose host reads cannot be captured in a CUDA graph."""
    from dsa_trt.plugins import cuda_ops

    return cuda_ops.resolve_mode() != "reference"


class LLM:
    def __init__(self, engine: str | Path | Engine, num_pages: int | None = None,
                 cache_fraction: float | None = None, max_num_tokens: int | None = None, max_num_seqs: int = 256,
                 deterministic: bool | None = None, speculative: str | None = None):
        """deterministic (default: DSA_DETERMINISTIC): pad every step to a multiple of
        DETERMINISTIC_TOKEN_BLOCK tokens and run it under knobs.deterministic_kernels (the CUDA fp8
        linear and sparse MLA unsplit), so a request's logits are bitwise the same whatever it is
        batched with on the CPU engine (the default path already gives every row the same program
        and per-row kernels; their rounding may still depend on the step's row count; on CUDA so
        may cuBLAS's: docs/architecture.md §8).

        speculative: None (off), "mtp" or "mtp:N": draft N tokens per step (default 1) with the
        engine's MTP draft program and verify them in one target step (runtime/speculative.py); the
        MTP layer then gets its own cache pools on the same pages (one more layer of cache)."""
        knobs.validate_environment()  # a bad DSA_* value fails here, naming the variable
        self.deterministic = knobs.get("DSA_DETERMINISTIC") == "1" if deterministic is None else bool(deterministic)
        self.num_draft = parse_speculative(speculative)
        self.engine = engine if isinstance(engine, Engine) else Engine.load(engine, draft=self.num_draft > 0)
        cfg = self.engine.config
        if self.num_draft and not self.engine.has_draft:
            where = engine if not isinstance(engine, Engine) else "this engine"
            raise ValueError(
                f"speculative={speculative!r}: {where} has no MTP draft program (engine_config.json mtp_layers="
                f"{cfg.mtp_layers}); rebuild it from a checkpoint with an MTP layer (num_nextn_predict_layers >= 1) "
                "without --no-mtp, or run without speculative decoding")
        self.model_config = cfg.model
        if self.engine.tokenizer_path is None:
            raise ValueError("the engine has no tokenizer_path: load it with Engine.load(engine_dir)")
        self.tokenizer = _load_tokenizer(self.engine.tokenizer_path, cfg.model)
        self.device = self.engine.device
        pages = self._num_pages(num_pages, cache_fraction)
        self.pool = PagePool(pages)
        self.mla_pools, self.index_pools = allocate_pools(cfg.model, cfg.cache_mode, pages, self.device)
        # What one sequence can hold: positions, page-table width, and the whole pool (a request
        # longer than the pool could only be cut short). Requests beyond it are refused at add.
        self.limits = {
            "max_position_embeddings": cfg.model.max_position_embeddings,
            "max_pages_per_seq * 64": cfg.max_pages_per_seq * PAGE_SIZE,
            "cache pool tokens": pages * PAGE_SIZE,
        }
        self.max_model_len = min(self.limits.values())
        pad = DETERMINISTIC_TOKEN_BLOCK if self.deterministic else 1
        self.speculator = (MTPSpeculator(self.engine, self.num_draft, pages, pad, fused=knobs.get("DSA_MTP_FUSED") == "1",
                                         max_model_len=self.max_model_len)
                           if self.num_draft else None)
        self.graphs = None
        if self.device.type == "cuda" and knobs.get("DSA_CUDA_GRAPHS") == "1" and _kernels_capturable():
            from .cuda_graphs import CudaGraphRunner

            min_batch = DETERMINISTIC_TOKEN_BLOCK if self.deterministic else 1
            self.graphs = CudaGraphRunner(self.engine, self.mla_pools, self.index_pools, max_num_seqs,
                                          min_batch=min_batch)
            if self.speculator is not None:  # the draft passes replay graphs of the MTP program too
                self.speculator.graphs = CudaGraphRunner(self.engine, self.speculator.mla_pools,
                                                         self.speculator.index_pools, max_num_seqs,
                                                         min_batch=min_batch, draft=True)
                if self.speculator.fused:  # verify + the next draft pass in one graph
                    pools = (self.mla_pools, self.index_pools)
                    self.speculator.fused_graphs = CudaGraphRunner(
                        self.engine, *pools, max_num_seqs, min_batch=min_batch,
                        call=lambda st: self.speculator.fused_call(st, pools))
        self.scheduler = Scheduler(
            self.pool, max_num_tokens=min(max_num_tokens or cfg.max_num_tokens, cfg.max_num_tokens),
            max_num_seqs=min(max_num_seqs, cfg.max_batch), max_model_len=self.max_model_len,
            eos_token_ids=cfg.model.eos_token_id,
            max_model_len_note=", ".join(f"{k} {v}" for k, v in self.limits.items()),
            num_draft=self.num_draft,
            lookahead=self.speculator.lookahead if self.speculator is not None else 0,
        )
        self._outputs: dict[str, CompletionOutput] = {}
        self._decoders: dict[str, TextDecoder] = {}  # each running request's output text, incrementally
        self._ids = itertools.count()
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- sizing
    def _num_pages(self, num_pages: int | None, fraction: float | None) -> int:
        source = "num_pages"
        if num_pages is None and knobs.get("DSA_NUM_PAGES") is not None:
            num_pages, source = knobs.get("DSA_NUM_PAGES"), "DSA_NUM_PAGES"
        if num_pages is not None:
            if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
                raise ValueError(f"{source}={num_pages!r}: need an int >= 2 pages")
            self._check_fits(num_pages, source)
            return num_pages
        if self.device.type != "cuda":
            self._check_fits(DEFAULT_CPU_PAGES, f"the CPU default of {DEFAULT_CPU_PAGES} pages (DSA_NUM_PAGES)")
            return DEFAULT_CPU_PAGES
        if fraction is None:
            fraction = knobs.get("DSA_CACHE_FRACTION")
        elif not 0 < fraction < 1:
            raise ValueError(f"cache_fraction={fraction} must be in (0, 1)")
        free, _ = torch.cuda.mem_get_info(self.device)
        return PagePool.from_memory(free, fraction, self.cache_bytes_per_token).num_pages

    @property
    def cache_bytes_per_token(self) -> int:
        """Both caches of every layer, plus the MTP layer's with speculative decoding."""
        cfg = self.engine.config
        extra = cfg.cache_bytes_per_token // cfg.model.num_hidden_layers if self.num_draft else 0
        return cfg.cache_bytes_per_token + extra

    @property
    def spec_stats(self) -> SpecStats | None:
        """Drafted / accepted counts of speculative decoding (None when it is off)."""
        return self.speculator.stats if self.speculator is not None else None

    def _check_fits(self, num_pages: int, source: str) -> None:
        """Refuse a pool larger than the memory that could hold it, before allocating it."""
        need = num_pages * PAGE_SIZE * self.cache_bytes_per_token
        if self.device.type == "cuda":
            avail, where = torch.cuda.mem_get_info(self.device)[0], f"free on {self.device}"
        else:
            avail, where = available_host_memory(), "available host memory (MemAvailable)"
        if avail is not None and need > avail:
            raise ValueError(
                f"{source}: {num_pages:,} pages x {PAGE_SIZE} tokens x {self.cache_bytes_per_token:,} "
                f"B/token = {need / 2**30:,.2f} GiB of cache, but only {avail / 2**30:,.2f} GiB is {where}; "
                f"lower it (at most {avail // (PAGE_SIZE * self.cache_bytes_per_token):,} pages fit)"
            )

    @property
    def tokens_that_fit(self) -> int:
        return self.pool.num_pages * PAGE_SIZE

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if not ids or bad:
                raise ValueError(f"prompt token ids must be non-empty and in [0, {self.model_config.vocab_size}): {bad[:5]}")
            text = self.tokenizer.decode(ids)
        with self._lock:
            rid = request_id or f"req-{next(self._ids)}"
            if rid in self._outputs:
                raise ValueError(f"request id {rid!r} is already in use")
            gen = make_generator(params.seed, self.device)
            self.scheduler.add(rid, ids, params, generator=gen)
            self._outputs[rid] = CompletionOutput(rid, text, ids, logprobs=[] if params.logprobs is not None else None)
            self._decoders[rid] = self.tokenizer.decoder(self._outputs[rid].token_ids)  # appends to it
        return rid

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self.scheduler.get(request_id) is not None:
                self.scheduler.cancel(request_id)
            out = self._outputs.get(request_id)
            if out is not None and out.finish_reason is None:
                out.finish_reason = "cancelled"

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

    def pop_output(self, request_id: str) -> CompletionOutput:
        with self._lock:
            self._decoders.pop(request_id, None)
            return self._outputs.pop(request_id)

    # ---------------------------------------------------------------- one engine step
    def step(self) -> list[StepDelta]:
        with self._lock:
            step = self.scheduler.schedule()
            if step is None:
                return []
            try:
                # the deterministic mode's kernel plans for this step's launches and captures (knobs.py)
                with knobs.deterministic_kernels(self.deterministic):
                    # the MTP pass: drafts into step.inputs, greedy ones as device ids (no sync)
                    device_ids = self.speculator.propose(step) if self.speculator is not None else None
                    if self.speculator is not None and self.speculator.fuses(step):
                        out = self.speculator.run_fused(step.inputs, device_ids, (self.mla_pools, self.index_pools))
                    else:
                        out = self._run(step.inputs, device_ids)
                if self.speculator is not None:
                    sampled, logps = self.speculator.verify(step, out)
                else:
                    rows = step.sample_rows.to(self.device)
                    res = sample(out.logits[rows], **step.sampling_args())
                    sampled = [[t] for t in res.token_ids.tolist()]
                    logps = [[lp] for lp in res.logprobs.tolist()] if res.logprobs is not None else None
            except BaseException:
                self._abort_step(step)
                raise
            reqs = step.sampling_requests
            self.scheduler.update(step, sampled)
            # a request finished by a stop token keeps the tokens up to it (update's new_tokens)
            return [self._advance(r, step.new_tokens.get(r.request_id, toks), logps[i] if logps else None)
                    for i, (r, toks) in enumerate(zip(reqs, sampled))]

    def _run(self, inputs: StepInputs, device_ids: DeviceIds | None = None) -> StepOutput:
        """The target program on the scheduler's (host) step; ``device_ids``: the speculator's
        drafts still on the device (runtime/speculative.py DeviceIds)."""
        if self.graphs is not None:
            return self.graphs.run(inputs, device_ids=device_ids)  # pads its eager steps like the branch below
        if self.deterministic:
            inputs = inputs.pad_tokens(DETERMINISTIC_TOKEN_BLOCK)  # appends rows: token indices stay
        return self.engine.run(with_device_ids(inputs.to(self.device), device_ids), self.mla_pools, self.index_pools)

    def _abort_step(self, step) -> None:
        """A failed engine step: end its requests with finish_reason "error" (their caches may be
        half written) and close the step, so the scheduler keeps serving the others."""
        for s in step.seqs:
            if not s.request.finished:
                rid = s.request.request_id
                self.scheduler.finish(rid, "error")
                if rid in self._outputs:
                    self._outputs[rid].finish_reason = "error"
        self.scheduler.update(step, [[0]] * len(step.sample_rows))  # every request in it is finished: no-op

    def _advance(self, req: Request, tokens: list[int], logprobs: list[float] | None) -> StepDelta:
        """The step's tokens into the request's output: text by its incremental decoder (O(new
        tokens), not a decode of the whole output per token), stop strings searched where the new
        text could complete one. ``new_text``: the text this step made final (complete characters;
        on the last step everything left, or "" where a stop string cut text already handed out)."""
        o, dec = self._outputs[req.request_id], self._decoders[req.request_id]
        start = len(dec.committed)
        longest = max(map(len, req.params.stop), default=0)
        cut = None
        for i, token in enumerate(tokens):
            if o.logprobs is not None and logprobs is not None:
                o.logprobs.append(logprobs[i])
            searched = len(dec.committed)  # the text before it held no stop string
            dec.add(token)  # appends it to o.token_ids
            if longest:
                lo = max(0, searched - longest + 1)
                window = dec.committed[lo:] + dec.tail
                hit = next(((s, window.find(s)) for s in req.params.stop if s in window), None)
                if hit is not None:
                    cut = lo + hit[1]
                    if not req.finished:
                        self.scheduler.finish(req.request_id, "stop", stop_reason=hit[0])
                    break
        added = tokens[: i + 1] if tokens else []
        o.text = dec.text if cut is None else dec.text[:cut]
        if req.finished and cut is None and o.text != (full := self.tokenizer.decode(o.token_ids)):
            o.text = full  # a tokenizer whose windows decode otherwise (not byte-level BPE): the true text
        o.num_cached_tokens = req.num_cached_tokens
        if req.finished and o.finish_reason is None:
            o.finish_reason, o.stop_reason = req.finish_reason, req.stop_reason
        new_text = o.text[start:] if req.finished else dec.committed[start:]
        return StepDelta(req.request_id, added, new_text, o)

    # ---------------------------------------------------------------- batch and streaming APIs
    def generate(self, prompts: str | Sequence[str], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Outputs in the order of ``prompts``."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        pending = set(ids)
        while pending:
            if not self.step() and not self.has_unfinished():
                break
            pending = {i for i in pending if not self._outputs[i].finished}
        return [self.pop_output(i) for i in ids]

    def stream(self, prompt: str, params: SamplingParams | None = None) -> Iterator[StepDelta]:
        """Yields one delta per generated token of this request (drives the engine itself)."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for d in self.step():
                    if d.request_id == rid:
                        yield d
                out = self._outputs[rid]
                if out.finished:
                    return
        finally:
            self._outputs.pop(rid, None)
            self._decoders.pop(rid, None)


def available_host_memory() -> int | None:
    """Bytes the kernel reports as available (MemAvailable), or None where /proc/meminfo is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _load_tokenizer(path: Path, model) -> Tokenizer:
    try:
        return Tokenizer(path, model.bos_token_id, model.eos_token_id)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions for bad files
        raise ValueError(f"{path}: not a readable tokenizer.json ({e}); copy tokenizer.json from the "
                         "checkpoint and rebuild the engine") from None
