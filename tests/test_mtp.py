"""MTP speculative decoding: the acceptance rule, greedy identity and sampling distribution through
a real compiled engine (CPU AOTInductor, the trained tiny checkpoint so drafts are accepted), bad input.

One engine (main + draft program, exact fp32 caches) is built per module and shared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from dsa_trt.runtime.sampling import SamplingParams
from dsa_trt.runtime.speculative import MAX_DRAFT_TOKENS, accept_drafts, parse_speculative, processed_probs

ALPHA = 0.01  # chi-square tests must not reject at 1%


# ---------------------------------------------------------------- the acceptance rule alone
def _random_dist(g: torch.Generator, vocab: int) -> torch.Tensor:
    w = torch.rand(vocab, generator=g) ** 3  # uneven, with small entries
    w[torch.randint(vocab, (1,), generator=g)] = 0.0  # a token the distribution never gives
    return w / w.sum()


@pytest.mark.parametrize("n", [1, 3])
def test_rejection_sampling_keeps_the_target_distribution(n):
    """Drafts from q, accepted by accept_drafts: the first emitted token is distributed as p_0 and,
    where the first draft was accepted, the second as p_1 (p and q differ, also in their support)."""
    g = torch.Generator().manual_seed(1234 + n)
    vocab, samples = 7, 200_000
    p = torch.stack([_random_dist(g, vocab) for _ in range(n + 1)])  # [n+1, V]
    q = torch.stack([_random_dist(g, vocab) for _ in range(n)])  # [n, V]
    drafts = torch.stack([torch.multinomial(q[j], samples, replacement=True, generator=g) for j in range(n)], 1)
    u = torch.rand(samples, n + 1, generator=g)
    accepted, tokens = accept_drafts(p.expand(samples, -1, -1), q.expand(samples, -1, -1), drafts, u[:, :n], u[:, n])
    assert 0 < accepted.float().mean() < n  # both branches are exercised
    first = np.bincount(tokens[:, 0].numpy(), minlength=vocab)
    _chi_square_fits(first, p[0].numpy(), "token 0")
    if n > 1:
        two = tokens[accepted >= 1, 1]
        _chi_square_fits(np.bincount(two.numpy(), minlength=vocab), p[1].numpy(), "token 1 | draft 0 accepted")


def _chi_square_fits(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    assert counts[probs == 0].sum() == 0, f"{what}: emitted a token of probability 0: {counts}"
    keep = probs > 0
    p64 = probs[keep].astype(np.float64)
    expected = p64 / p64.sum() * counts[keep].sum()  # the sums must agree to 1e-8
    stat, pvalue = stats.chisquare(counts[keep], expected)
    assert pvalue > ALPHA, f"{what}: chi-square p={pvalue:.2g} (stat {stat:.1f}); counts {counts}, expected {expected}"


def test_processed_probs_is_the_sampler_distribution():
    """processed_probs (q and p of the acceptance rule) equals what sample() draws from: top-k / top-p
    keep the same tokens, the same temperature."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=g) * 3
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.8), SamplingParams(temperature=1.3)]
    probs = processed_probs(logits, params)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert int((probs[0] > 0).sum()) == 5
    assert torch.equal(probs[0] > 0, torch.zeros(50, dtype=torch.bool).scatter(0, logits[0].topk(5).indices, True))
    want = torch.softmax(logits[2] / 1.3, -1)
    assert torch.allclose(probs[2], want, atol=1e-6)


@pytest.mark.parametrize("spec,n", [(None, 0), ("mtp", 1), ("mtp:3", 3), (f"mtp:{MAX_DRAFT_TOKENS}", MAX_DRAFT_TOKENS)])
def test_parse_speculative(spec, n):
    assert parse_speculative(spec) == n


@pytest.mark.parametrize("spec", ["mtp:0", f"mtp:{MAX_DRAFT_TOKENS + 1}", "mtp:x", "eagle", "mtp:-1"])
def test_parse_speculative_refuses(spec):
    with pytest.raises(ValueError, match="speculative="):
        parse_speculative(spec)


# ---------------------------------------------------------------- through the compiled engine
@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    from dsa_trt.export.tiny_checkpoint import write_trained_checkpoint

    return write_trained_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-v32-trained")


@pytest.fixture(scope="module")
def mtp_engine(trained_ckpt, tmp_path_factory):
    """CPU AOTInductor engine with its MTP draft program, fp32 caches (exact mode)."""
    from dsa_trt.builder.build import build_engine

    out = tmp_path_factory.mktemp("engines") / "tiny-trained-fp32"
    cfg = build_engine(trained_ckpt, out, cache_mode="fp32", compiler="aoti", device="cpu", dtype="float32")
    assert cfg.mtp_layers == 1 and (out / cfg.draft_file(0)).is_file()
    return out


def _corpus_prompts(n: int, lengths: list[int]) -> list[list[int]]:
    """Held-out corpus lines cut to the given token lengths (BOS first)."""
    from dsa_trt.export.tiny_checkpoint import train_tokenizer
    from dsa_trt.export.train_tiny import corpus_split

    tok = train_tokenizer()
    _, lines = corpus_split()
    ids = [tok.encode(" ".join(lines[i:i + 4])).ids for i in range(0, 4 * n, 4)]
    return [x[:k] for x, k in zip(ids, lengths)]


@pytest.mark.parametrize("spec,fused", [("mtp", "0"), ("mtp", "1"), ("mtp:2", "0"), ("mtp:3", "1")])
def test_greedy_output_equals_plain_decoding(mtp_engine, spec, fused, one_thread, monkeypatch):
    """A batch of prompts (T <= index_topk = 16 and T >> 16), two of them sharing a 64-token prefix
    (a prefix-cache hit), on a pool small enough to preempt: MTP greedy output == plain greedy output,
    token for token, and drafts are accepted; also with the fused verify + draft step (DSA_MTP_FUSED),
    whose recurrent passes (mtp:3) write the MTP cache past the step's rows (reserved pages)."""
    from dsa_trt.runtime.llm import LLM

    monkeypatch.setenv("DSA_MTP_FUSED", fused)

    prompts = _corpus_prompts(5, [9, 60, 50, 100, 90])
    prompts.append(prompts[3][:70] + prompts[1][:6])  # shares the first page of prompt 3 (prefix hit)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # 4 pages = 256 tokens for 6 requests that need 11 pages at their ends: the 60- and 50-token prompts
    # are admitted on one page each and both cross into a second one while generating
    plain = LLM(mtp_engine, num_pages=4, deterministic=True)
    spec_llm = LLM(mtp_engine, num_pages=4, deterministic=True, speculative=spec)
    for llm in (plain, spec_llm):  # prompt 3 alone first: its full first page is then in the prefix cache
        llm.generate([prompts[3]], params)
    want = plain.generate(prompts, params)
    got = spec_llm.generate(prompts, params)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.token_ids == w.token_ids, f"prompt {i} ({len(prompts[i])} tokens): {g.token_ids} != {w.token_ids}"
    st = spec_llm.spec_stats
    assert st.drafted > 0 and 0 < st.accepted < st.drafted, st
    if fused == "1":
        assert spec_llm.speculator.fused_steps > 0, "no step ran fused"
    assert spec_llm.pool.stats.hit_pages > 0, "no prefix-cache hit in the batch"
    assert spec_llm.scheduler.num_preemptions > 0, "no preemption: make the pool smaller"
    # every page is back once the requests are done (accepted or rolled back, none leaked)
    assert spec_llm.pool.num_allocatable == spec_llm.pool.num_pages


def test_fused_drafts_equal_the_separate_passes(mtp_engine, one_thread, monkeypatch):
    """The fused step's recurrent draft passes (mtp:3: drafts 2 and 3 from the layer's own output,
    at the positions after each sequence's accepted row) draft what the separate passes draft:
    the same tokens accepted, step for step (deterministic mode)."""
    from dsa_trt.runtime.llm import LLM

    prompts = _corpus_prompts(3, [9, 40, 100])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    stats, outs = [], []
    for fused in ("0", "1"):
        monkeypatch.setenv("DSA_MTP_FUSED", fused)
        llm = LLM(mtp_engine, num_pages=16, deterministic=True, speculative="mtp:3")
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        stats.append((llm.spec_stats.drafted, llm.spec_stats.accepted, llm.spec_stats.verify_steps))
        assert (llm.speculator.fused_steps > 0) == (fused == "1")
    assert outs[0] == outs[1]
    assert stats[0] == stats[1], f"separate passes (drafted, accepted, steps) {stats[0]} != fused {stats[1]}"
    assert stats[1][1] > 0


def test_sampling_distribution_end_to_end(mtp_engine, one_thread):
    """One prompt, 240 seeds each with and without MTP (temperature 1): the second generated token
    (the first one a verify step decides) has the same distribution (two-sample chi-square)."""
    from dsa_trt.runtime.llm import LLM

    prompt = _corpus_prompts(1, [20])[0]
    n = 240
    runs = {}
    for spec in (None, "mtp"):
        llm = LLM(mtp_engine, num_pages=64, speculative=spec)
        # 3 tokens: with one left to generate nothing is drafted (a draft + bonus would overshoot)
        params = [SamplingParams(temperature=1.0, max_tokens=3, seed=10_000 * (spec is None) + i, ignore_eos=True)
                  for i in range(n)]
        outs = llm.generate([prompt] * n, params)
        runs[spec] = [o.token_ids[1] for o in outs]
        if spec:
            assert llm.spec_stats.drafted >= n // 2 and llm.spec_stats.accepted > 0
    a, b = runs[None], runs["mtp"]
    common = [t for t, c in zip(*np.unique(a + b, return_counts=True)) if c >= 10]  # bins with enough mass
    def hist(xs):
        return [sum(x == t for x in xs) for t in common] + [sum(x not in common for x in xs)]
    table = np.array([hist(a), hist(b)])
    table = table[:, table.sum(0) > 0]
    _, pvalue, _, _ = stats.chi2_contingency(table)
    assert pvalue > ALPHA, f"MTP sampling differs from plain sampling: p={pvalue:.2g}\n{table}"


def test_seeded_sampling_reproducible(mtp_engine, one_thread):
    """Seeded MTP sampling: the same tokens alone and batched with other requests."""
    from dsa_trt.runtime.llm import LLM

    prompts = _corpus_prompts(3, [12, 30, 50])
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=7, ignore_eos=True)
    llm = LLM(mtp_engine, num_pages=32, deterministic=True, speculative="mtp:2")
    alone = llm.generate([prompts[1]], sp)[0].token_ids
    batched = llm.generate(prompts, [SamplingParams(max_tokens=9, seed=3), sp, SamplingParams(temperature=0)])
    assert batched[1].token_ids == alone


def test_speculative_needs_a_draft_program(mtp_engine):
    """--speculative on an engine without an MTP program, or n out of range: clear errors. (An engine
    loaded without its draft program is what an engine built with --no-mtp, or from a checkpoint
    without an MTP layer, gives the runtime.)"""
    from dsa_trt.runtime.cli import main
    from dsa_trt.runtime.engine import Engine
    from dsa_trt.runtime.llm import LLM

    with pytest.raises(ValueError, match=r"'mtp:N' must be an integer in \[1, 8\]"):
        LLM(mtp_engine, num_pages=8, speculative="mtp:9")
    assert main(["generate", "--engine", str(mtp_engine), "--speculative", "mtp:0", "--max-tokens", "2"]) == 2
    assert main(["generate", "--engine", str(mtp_engine), "--speculative", "eagle", "--max-tokens", "2"]) == 2
    bare = Engine.load(mtp_engine, draft=False)
    with pytest.raises(ValueError, match="has no MTP draft program .*rebuild it from a checkpoint with an MTP layer"):
        LLM(bare, num_pages=8, speculative="mtp")
    LLM(bare, num_pages=8).generate([[0, 5, 6]], SamplingParams(max_tokens=2))  # without speculation it serves


def test_bench_reports_speculation_on_text_prompts(mtp_engine, tmp_path, capsys):
    """`dsa-trt bench --prompt-file`: the file's lines (cycled, cut to --prompt-len tokens) are the
    prompts; with --speculative the acceptance line is printed. A missing or empty file: exit 2 and
    a message naming the flag."""
    from dsa_trt.runtime.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The sea was calm that morning\n\nBread is made of four things\n", encoding="utf-8")
    args = ["bench", "--engine", str(mtp_engine), "--num-prompts", "3", "--max-tokens", "6", "--temperature", "0",
            "--prompt-len", "4", "--prompt-file", str(prompts)]
    assert main(args + ["--speculative", "mtp"]) == 0
    out = capsys.readouterr().out
    assert f"3 prompts x the lines of {prompts}, <= 4 tokens -> 6 tokens each" in out, out
    assert "18 tokens in" in out and "speculative (MTP): acceptance rate" in out, out
    # --max-num-seqs 1: batch size 1 over every prompt, one after another
    assert main(args + ["--speculative", "mtp", "--max-num-seqs", "1"]) == 0
    assert "18 tokens in" in capsys.readouterr().out
    assert main(args + ["--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs 0: must be >= 1" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    for bad, why in ((tmp_path / "missing.txt", "no such file"), (tmp_path / "empty.txt", "no non-empty line")):
        assert main(args[:-1] + [str(bad)]) == 2
        assert f"--prompt-file {bad}: {why}" in capsys.readouterr().err
