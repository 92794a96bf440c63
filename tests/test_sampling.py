"""SamplingParams validation and the batched sampler, against brute-force numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsa_trt.runtime.sampling import (
    SamplingParams,
    TokenHistory,
    apply_penalties,
    make_generator,
    sample,
    top_k_top_p_mask,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------- independent numpy references
def ref_allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[set[int], np.ndarray]:
    """Token ids that may be drawn and the renormalised distribution over the vocab (float64)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    k = top_k if top_k > 0 else len(z)
    head = order[:k]
    p = np.exp(z[head] - z[head].max())
    p /= p.sum()
    kept, mass = [], 0.0
    for tok, prob in zip(head, p):
        kept.append(int(tok))
        mass += prob
        if mass >= top_p:
            break
    probs = np.zeros(len(z))
    e = np.exp(z[kept] - z[kept].max())
    probs[kept] = e / e.sum()
    return set(kept), probs


def ref_penalties(logits: np.ndarray, prompt: list[int], output: list[int], rep: float, pres: float, freq: float):
    out = logits.astype(np.float64).copy()
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
    for tok in set(output):
        c = output.count(tok)
        out[tok] -= freq * c + pres
    return out


# ---------------------------------------------------------------- params validation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature=-0.5 must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_k=-1), "top_k=-1 must be an int >= 0"),
        (dict(top_k=2.5), "top_k=2.5"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_p=1.2), "top_p=1.2"),
        (dict(max_tokens=0), "max_tokens=0 must be an int >= 1"),
        (dict(seed=-3), "seed=-3 must be None or an int"),
        (dict(seed=True), "seed=True"),
        (dict(stop=["ok", ""]), "stop=\\['ok', ''\\] must be a list of non-empty strings"),
        (dict(stop_token_ids=[3, -1]), "stop_token_ids=\\[3, -1\\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be > 0"),
        (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3.0), "frequency_penalty=-3.0"),
        (dict(logprobs=-1), "logprobs=-1 must be None or an int >= 0"),
        (dict(ignore_eos=1), "ignore_eos=1 must be a bool"),
    ],
)
def test_bad_params_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_report_every_problem_and_normalise_stop():
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=-1, top_p=2)
    assert "temperature=-1" in str(e.value) and "top_p=2" in str(e.value)
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().needs_history


# ---------------------------------------------------------------- sampler
def test_greedy_is_argmax_and_tiny_temperature_is_greedy():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0)] * 4 + [SamplingParams(temperature=1e-7)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_token_ids is None


@pytest.mark.parametrize("vocab", [7, 64, 1000])
def test_top_k_top_p_mask_matches_bruteforce(vocab):
    g = torch.Generator().manual_seed(vocab)
    cases = [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (3, 0.6), (vocab, 0.99), (vocab + 5, 0.3), (0, 1e-6)]
    logits = torch.randn(len(cases), vocab, generator=g) * 3
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases])
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    keep = top_k_top_p_mask(sorted_logits, top_k, top_p)
    for i, (k, p) in enumerate(cases):
        want, _ = ref_allowed(logits[i].numpy(), 1.0, k, p)
        got = set(order[i][keep[i]].tolist())
        assert got == want, f"row {i}: top_k={k} top_p={p} vocab={vocab}: got {sorted(got)} want {sorted(want)}"


def test_sampling_distribution_matches_reference():
    vocab, draws = 12, 40000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1))
    for temperature, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.7)]:
        params = SamplingParams(temperature=temperature, top_k=k, top_p=p)
        torch.manual_seed(2)
        tokens = sample(logits.expand(draws, vocab), [params] * draws).token_ids.numpy()
        allowed, probs = ref_allowed(logits.numpy(), temperature, k, p)
        assert set(tokens.tolist()) <= allowed, f"T={temperature} k={k} p={p}: drew outside the kept set"
        freq = np.bincount(tokens, minlength=vocab) / draws
        # 4 standard errors of a binomial proportion at 40k draws is < 0.01
        assert np.abs(freq - probs).max() < 0.01, f"T={temperature} k={k} p={p}: {freq} vs {probs}"


def test_seeded_rows_do_not_depend_on_batch_composition():
    vocab, steps = 50, 20
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    g = torch.Generator().manual_seed(3)
    stream = [torch.randn(vocab, generator=g) for _ in range(steps)]

    def run(batch_size: int, position: int, others: list[SamplingParams]) -> list[int]:
        gen = make_generator(seeded.seed, "cpu")
        other_gens = [make_generator(p.seed, "cpu") for p in others]
        got = []
        for logits in stream:
            batch = torch.randn(batch_size, vocab, generator=g)
            batch[position] = logits
            params = others[:position] + [seeded] + others[position:]
            gens = other_gens[:position] + [gen] + other_gens[position:]
            got.append(int(sample(batch, params, gens).token_ids[position]))
        return got

    alone = run(1, 0, [])
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=3), SamplingParams(seed=7)]
    assert run(4, 2, mixed) == alone
    assert run(4, 0, mixed) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_seeded_row_without_generator_is_an_error():
    with pytest.raises(ValueError, match="seed=5 but no generator"):
        sample(torch.randn(1, 10), [SamplingParams(seed=5)])


def test_penalties_match_reference():
    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4)) * 2
    prompt = [[1, 2, 3, 3], [], [5]]
    output = [[3, 4, 4, 4, 7], [0, 0, 9], []]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0, frequency_penalty=1.5),
        SamplingParams(temperature=0),  # neutral row in a penalised batch stays argmax of raw logits
    ]
    out = sample(logits, params, prev_tokens=output, prompt_tokens=prompt)
    for i, p in enumerate(params):
        ref = ref_penalties(
            logits[i].numpy(), prompt[i], output[i], p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        )
        assert int(out.token_ids[i]) == int(np.argmax(ref)), f"row {i}"
    got = apply_penalties(logits, params, output, prompt)
    for i, p in enumerate(params):
        ref = ref_penalties(
            logits[i].numpy(), prompt[i], output[i], p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        )
        np.testing.assert_allclose(got[i].numpy(), ref, rtol=1e-6, atol=1e-6, err_msg=f"row {i}")
    assert torch.equal(got[2], logits[2])  # bit for bit


class Seq:
    """What TokenHistory reads of a request: token_ids (prompt then generated) and the prompt length."""

    def __init__(self, prompt: list[int]):
        self.token_ids, self.num_prompt_tokens = list(prompt), len(prompt)


def test_token_histories_equal_the_id_lists_bit_for_bit():
    """The runtime's incremental histories (synced a few tokens per step) give the penalised
    logits of a rebuild from the id lists, every step, for rows with and without penalties."""
    vocab, rng = 50, torch.Generator().manual_seed(5)
    seqs = [Seq(torch.randint(vocab, (n,), generator=rng).tolist()) for n in (7, 0, 3)]
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(temperature=0, frequency_penalty=1.5), SamplingParams(temperature=0)]
    histories = [TokenHistory(seqs[0]), TokenHistory(seqs[1]), None]
    for step in range(40):
        logits = torch.randn(3, vocab, generator=rng) * 2
        want = apply_penalties(logits, params, [s.token_ids[s.num_prompt_tokens :] for s in seqs[:2]] + [[]],
                               [s.token_ids[: s.num_prompt_tokens] for s in seqs[:2]] + [[]])
        got = apply_penalties(logits, params, None, None, histories)
        assert torch.equal(got, want), step
        assert torch.equal(got[2], logits[2])
        for s in seqs:  # 0 to 3 new tokens per step (a verify step appends several)
            s.token_ids += torch.randint(vocab, (step % 4,), generator=rng).tolist()
    counts, seen = histories[0].rows(vocab, torch.device("cpu"))  # synced to the last tokens too
    assert int(counts.sum()) == len(seqs[0].token_ids) - 7 and int(seen.sum()) == len(set(seqs[0].token_ids))


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    assert int(sample(logits, params, prev_tokens=[[1]], prompt_tokens=[[]]).token_ids[0]) == 2


def test_logprobs_chosen_and_top_alternatives():
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(seed=1, logprobs=0), SamplingParams()]
    gens = [None, make_generator(1, "cpu"), None]
    out = sample(logits, params, gens)
    ref = torch.log_softmax(logits.double(), -1).numpy()
    for i in range(3):
        np.testing.assert_allclose(float(out.logprobs[i]), ref[i, int(out.token_ids[i])], rtol=1e-5)
    assert out.top_token_ids.shape == (3, 3)
    assert out.top_token_ids[0].tolist() == np.argsort(-ref[0])[:3].tolist()
    np.testing.assert_allclose(out.top_logprobs[0].numpy(), np.sort(ref[0])[::-1][:3], rtol=1e-5)
    assert float(out.logprobs[0]) == pytest.approx(float(out.top_logprobs[0, 0]))  # greedy = top-1
