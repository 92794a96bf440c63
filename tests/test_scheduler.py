"""Scheduler: continuous batching, chunked prefill, prefix sharing, preemption, finish/cancel.

End-to-end cases drive the scheduler with FakeEngine, a deterministic stand-in for the model that
really goes through the paged cache: it writes each step's token ids at ``slot_mapping`` and
computes every logits row from the sequence's WHOLE history read back through ``page_table``.
So a wrong page id, a wrong slot, a bad prefix hit or a write into a shared page changes the
generated tokens, and "same tokens with and without memory pressure" checks all the bookkeeping.
"""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
import torch

from dsa_trt.config import PAGE_SIZE
from dsa_trt.runtime.page_pool import PagePool
from dsa_trt.runtime.sampling import SamplingParams, make_generator, sample
from dsa_trt.runtime.scheduler import Request, RequestState, Scheduler
from dsa_trt.runtime.step_inputs import StepInputs

VOCAB = 40


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class FakeEngine:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.cache = torch.full((pool.num_pages * PAGE_SIZE,), -1, dtype=torch.int64)  # token id per slot

    def forward(self, step: StepInputs) -> torch.Tensor:
        written_pages = set((step.slot_mapping // PAGE_SIZE).tolist())
        assert not any(self.pool.is_cached(p) for p in written_pages), "write into a cached (shared) page"
        self.cache[step.slot_mapping] = step.input_ids
        rows = []
        for t in step.logits_indices.tolist():
            b, pos = int(step.req_idx[t]), int(step.positions[t])
            p = torch.arange(pos + 1)
            history = self.cache[step.page_table[b, p // PAGE_SIZE].long() * PAGE_SIZE + p % PAGE_SIZE].tolist()
            assert -1 not in history, "read of a slot never written"
            digest = hashlib.blake2b(struct.pack(f"<{len(history)}q", *history), digest_size=8).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
            rows.append(torch.randn(VOCAB, generator=g) * 3)
        return torch.stack(rows)  # [N, VOCAB]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def make(num_pages: int, max_num_tokens: int = 256, max_num_seqs: int = 8, **kw) -> Scheduler:
    return Scheduler(PagePool(num_pages), max_num_tokens, max_num_seqs, max_model_len=1024, **kw)


def check_refcounts(sched: Scheduler) -> None:
    holders = [0] * sched.pool.num_pages
    for req in sched.running:
        for p in req.pages:
            holders[p] += 1
    assert holders == [sched.pool.refcount(p) for p in range(sched.pool.num_pages)]
    assert sched.pool.num_allocatable + sum(h > 0 for h in holders) == sched.pool.num_pages
    assert all(not r.pages for r in sched.waiting)
    for req in sched.running:  # the step's page-table rows (StepInputs.build) mirror the page lists
        assert req.page_row().tolist() == req.pages


def run_step(sched: Scheduler, engine: FakeEngine) -> list[Request]:
    step = sched.schedule()
    logits = engine.forward(step.inputs)
    out = sample(logits[step.sample_rows], **step.sampling_args())
    got = sched.update(step, out.token_ids)
    check_refcounts(sched)
    return got


def run_all(
    sched: Scheduler,
    requests: list[tuple[str, list[int], SamplingParams]],
    late: int = 0,
    engine: FakeEngine | None = None,
) -> dict:
    """Add the requests (the last ``late`` of them after three steps) and run to completion."""
    engine = engine or FakeEngine(sched.pool)
    early = requests[: len(requests) - late]
    for rid, toks, params in early:
        sched.add(rid, toks, params, make_generator(params.seed, "cpu"))
    done, steps = {}, 0
    while sched.has_unfinished():
        if steps == 3:
            for rid, toks, params in requests[len(early) :]:
                sched.add(rid, toks, params, make_generator(params.seed, "cpu"))
        done.update({r.request_id: r for r in run_step(sched, engine) if r.finished})
        steps += 1
    assert sched.schedule() is None
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in done.items()}


def test_page_row_mirrors_pages_grown_and_replaced():
    req = Request("r", [1, 2, 3], 3, SamplingParams(), 0)
    assert req.page_row().tolist() == []
    rng = random.Random(0)
    for step in range(300):
        if step % 97 == 50:
            req.pages = [rng.randrange(999) for _ in range(rng.randrange(4))]  # admission / preemption
        else:
            req.pages += [rng.randrange(999) for _ in range(rng.choice([0, 0, 1, 3]))]
        row = req.page_row()
        assert row.dtype == torch.int32 and row.tolist() == req.pages
    grown = req.page_row()
    assert grown.shape[0] == len(req.pages) > 16  # past the first buffer


def test_build_takes_page_rows_as_lists_or_tensors():
    rng = random.Random(1)
    for _ in range(50):
        seqs = []
        for _ in range(rng.randint(1, 6)):
            start, n = rng.randint(0, 300), rng.randint(1, 70)
            pages = [rng.randrange(500) for _ in range(-(-(start + n) // PAGE_SIZE) + rng.randint(0, 2))]
            seqs.append(([rng.randrange(VOCAB) for _ in range(n)], start, pages))
        for logits_for in ("all", "last"):
            a = StepInputs.build(seqs, logits_for=logits_for)
            b = StepInputs.build([(t, s, torch.tensor(p, dtype=torch.int32)) for t, s, p in seqs], logits_for=logits_for)
            for x, y in zip(a.as_tuple(), b.as_tuple()):
                assert x.dtype == y.dtype and torch.equal(x, y)
            # the slots: page p // 64 of the sequence's row, offset p % 64
            for t in range(a.input_ids.shape[0]):
                toks, start, pages = seqs[int(a.req_idx[t])]
                pos = int(a.positions[t])
                assert int(a.slot_mapping[t]) == pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE


# ---------------------------------------------------------------- end to end
def workload(seeded: bool) -> list[tuple[str, list[int], SamplingParams]]:
    shared = prompt(PAGE_SIZE + 20, 100)
    reqs = []
    for i in range(6):
        toks = shared + prompt(30 + 17 * i, i) if i % 2 else prompt(50 + 23 * i, i)
        penalties = dict(repetition_penalty=1.3, frequency_penalty=0.5) if i == 5 else {}  # reads history
        temperature = dict(temperature=0.8, seed=i) if seeded else dict(temperature=0)
        reqs.append((f"r{i}", toks, SamplingParams(max_tokens=40 + 9 * i, **temperature, **penalties)))
    return reqs


@pytest.mark.parametrize("num_pages, budget", [(6, 96), (5, 32)])  # 32: every prompt is chunked
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_preemption_gives_the_same_tokens_as_no_pressure(seeded, num_pages, budget):
    reqs = workload(seeded)
    roomy = make(num_pages=64)
    want = run_all(roomy, reqs, late=2)
    assert roomy.num_preemptions == 0
    tight = make(num_pages=num_pages, max_num_tokens=budget)  # one request alone fits; six do not
    got = run_all(tight, reqs, late=2)
    assert tight.num_preemptions > 0
    assert got == want
    assert all(reason == "length" for _, reason in got.values())
    assert sorted(got) == [rid for rid, _, _ in reqs]  # nothing dropped


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    sched = make(num_pages=16, max_num_tokens=128)
    engine = FakeEngine(sched.pool)
    sched.add("long", prompt(300, 1), SamplingParams(temperature=0, max_tokens=5))
    sizes = []
    for _ in range(3):
        step = sched.schedule()
        sizes.append([(s.start, s.num_tokens, s.samples) for s in step.seqs])
        logits = engine.forward(step.inputs)
        sched.update(step, sample(logits[step.sample_rows], **step.sampling_args()).token_ids)
    assert sizes == [[(0, 128, False)], [(128, 128, False)], [(256, 44, True)]]
    # Decode tokens go first, then the new prompt's chunk takes the remaining budget.
    sched.add("next", prompt(200, 2), SamplingParams(temperature=0, max_tokens=5))
    step = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in step.seqs] == [("long", 1), ("next", 127)]
    assert step.num_tokens == 128 and step.sample_rows.tolist() == [0]


def test_shared_prefix_pages_are_shared_with_refcount_two():
    sched = make(num_pages=16)
    engine = FakeEngine(sched.pool)
    common = prompt(2 * PAGE_SIZE, 3)
    a = sched.add("a", common + prompt(10, 4), SamplingParams(temperature=0, max_tokens=50))
    run_step(sched, engine)  # a's prefill: pages 0 and 1 become full and cached
    b = sched.add("b", common + prompt(5, 5), SamplingParams(temperature=0, max_tokens=50))
    step = sched.schedule()
    (seq_b,) = [s for s in step.seqs if s.request is b]
    assert b.num_cached_tokens == 2 * PAGE_SIZE and seq_b.start == 2 * PAGE_SIZE and seq_b.num_tokens == 5
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    assert [sched.pool.refcount(p) for p in a.pages[:2]] == [2, 2]
    sched.update(step, sample(engine.forward(step.inputs)[step.sample_rows], **step.sampling_args()).token_ids)
    sched.cancel("a")
    assert [sched.pool.refcount(p) for p in b.pages[:2]] == [1, 1]


def test_prefix_is_reused_after_the_first_request_finishes_but_never_the_whole_prompt():
    sched = make(num_pages=16)
    engine = FakeEngine(sched.pool)  # one engine: its cache contents persist like the real pools
    p = prompt(2 * PAGE_SIZE, 6)
    first = run_all(sched, [("a", p, SamplingParams(temperature=0, max_tokens=3))], engine=engine)
    assert sched.pool.num_evictable_pages == 2  # prompt pages stay cached after a finished
    second = run_all(sched, [("b", p, SamplingParams(temperature=0, max_tokens=3))], engine=engine)
    assert second["b"] == first["a"]
    # 128-token prompt: only page 0 is a hit; the last token (in page 1) is recomputed for logits.
    assert sched.pool.stats.hit_pages == 1


def test_cancel_frees_pages_running_waiting_and_in_flight():
    sched = make(num_pages=8, max_num_seqs=1)
    engine = FakeEngine(sched.pool)
    sched.add("run", prompt(100, 7), SamplingParams(temperature=0, max_tokens=20))
    sched.add("wait", prompt(10, 8), SamplingParams(temperature=0, max_tokens=20))
    run_step(sched, engine)
    assert [r.request_id for r in sched.waiting] == ["wait"]  # max_num_seqs = 1
    assert sched.cancel("wait").finish_reason == "cancelled"
    step = sched.schedule()
    sched.cancel("run")  # while its step is in flight
    assert sched.update(step, torch.tensor([3])) == []
    assert sched.pool.num_allocatable == 8 and not sched.has_unfinished()
    with pytest.raises(KeyError, match="'run' is not active"):
        sched.cancel("run")


def test_finish_reasons_stop_tokens_eos_and_stop_string_hook():
    def first_tokens(toks: list[int]) -> list[int]:
        sched = make(num_pages=8)
        return run_all(sched, [("x", toks, SamplingParams(temperature=0, max_tokens=6))])["x"][0]

    toks = prompt(20, 9)
    ref = first_tokens(toks)
    stop_tok = ref[2]
    cut = ref.index(stop_tok) + 1
    sched = make(num_pages=8)
    out = run_all(sched, [("x", toks, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_tok]))])
    assert out["x"] == (ref[:cut], "stop")
    sched = make(num_pages=8, eos_token_ids=[stop_tok])
    assert run_all(sched, [("x", toks, SamplingParams(temperature=0, max_tokens=6))])["x"] == (ref[:cut], "stop")
    sched = make(num_pages=8, eos_token_ids=[stop_tok])
    out = run_all(sched, [("x", toks, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))])
    assert out["x"] == (ref, "length")
    # Stop strings: the caller finds them in the text and ends the request through finish().
    sched = make(num_pages=8)
    engine = FakeEngine(sched.pool)
    sched.add("x", toks, SamplingParams(temperature=0, max_tokens=6, stop=["</s>"]))
    (req,) = run_step(sched, engine)
    sched.finish("x", "stop", "</s>")
    assert (req.finish_reason, req.stop_reason, req.output_token_ids) == ("stop", "</s>", ref[:1])
    assert sched.pool.num_allocatable == 8


def test_request_that_outgrows_the_whole_pool_finishes_with_length():
    sched = make(num_pages=2)
    out = run_all(sched, [("big", prompt(100, 10), SamplingParams(temperature=0, max_tokens=500))])
    assert out["big"][1] == "length" and len(out["big"][0]) == 2 * PAGE_SIZE - 100 + 1


def test_add_rejects_requests_that_can_never_be_served():
    sched = make(num_pages=2)
    with pytest.raises(ValueError, match=r"prompt \(1000 tokens\) \+ max_tokens \(100\) = 1100 exceeds max_model_len"):
        sched.add("a", prompt(1000, 0), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="needs 3 pages of 64 tokens but the whole cache pool has 2"):
        sched.add("b", prompt(129, 0), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add("c", [], SamplingParams())
    with pytest.raises(ValueError, match="needs a generator"):
        sched.add("d", [1], SamplingParams(seed=3))
    sched.add("e", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="'e' is already active"):
        sched.add("e", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="max_num_tokens=0"):
        Scheduler(PagePool(4), 0, 8, 1024)


def test_preempted_request_goes_to_the_front_and_reuses_its_cached_pages():
    sched = make(num_pages=6, max_num_tokens=512)
    engine = FakeEngine(sched.pool)
    old = sched.add("old", prompt(2 * PAGE_SIZE + 1, 11), SamplingParams(temperature=0, max_tokens=100))
    new = sched.add("new", prompt(PAGE_SIZE + 1, 12), SamplingParams(temperature=0, max_tokens=100))
    pages_of_new = []
    while not new.num_preemptions:  # both cross a page boundary in the same step; old goes first
        pages_of_new = list(new.pages)
        run_step(sched, engine)
    assert old.num_preemptions == 0 and new.pages == [] and len(old.pages) == 4
    assert new.num_output_tokens == PAGE_SIZE and all(sched.pool.is_cached(p) for p in pages_of_new[:2])
    sched.add("later", prompt(10, 13), SamplingParams(temperature=0, max_tokens=5))
    assert [r.request_id for r in sched.waiting] == ["new", "later"]
    while not old.finished:
        run_step(sched, engine)  # new waits at the head (FIFO), later may not overtake it
        assert new.state is sched.get("later").state is RequestState.WAITING
    run_step(sched, engine)
    assert new.num_cached_tokens == 2 * PAGE_SIZE and new.pages[:2] == pages_of_new[:2]


def test_more_decoding_requests_than_the_budget_take_turns_oldest_first():
    sched = make(num_pages=16, max_num_tokens=3, max_num_seqs=5)
    reqs = [(f"r{i}", prompt(2, 20 + i), SamplingParams(temperature=0, max_tokens=4)) for i in range(5)]
    want = run_all(make(num_pages=16), reqs)
    assert run_all(sched, reqs) == want


@pytest.mark.parametrize("lookahead,pages", [(0, 1), (2, 2)])
def test_verify_step_reserves_the_fused_drafts_lookahead(lookahead, pages):
    """A fused MTP step (runtime/speculative.py) writes the MTP cache up to num_draft - 1 positions
    past its verify rows: the scheduler allocates their pages with the step's own."""
    sched = make(num_pages=8, num_draft=3, lookahead=lookahead)
    req = sched.add("a", prompt(59, 0), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    sched.update(sched.schedule(), [5])  # the prompt: 59 positions computed, 60 tokens known
    req.hidden = torch.zeros(req.num_computed - req.mtp_computed, 4)  # its MTP state (the pass's input)
    step = sched.schedule()
    (seq,) = step.seqs
    assert (seq.start, seq.num_tokens, seq.num_draft) == (59, 4, 3)
    # verify rows 59..62 lie in page 0; the recurrent passes write positions 63 and 64
    assert len(req.pages) == pages
