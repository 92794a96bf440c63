"""The incremental decoder of an output's text (dsa_trt/tokenizer.py TextDecoder) against a decode of
the whole output at every token, on the tiny checkpoint's byte-level BPE tokenizer (the shape of
DeepSeek's and GLM's), and the LLM's stop strings and streams on top of it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dsa_trt.export.tiny_checkpoint import CORPUS_PATH
from dsa_trt.tokenizer import UNDECODED, Tokenizer

MIXED = "naïve café — 日本語 🙂 end. Ünïcödé: ∑ x² ≤ ∞; emoji 👩‍💻 and 中文。"


@pytest.fixture(scope="module")
def tok(tiny_ckpt: Path) -> Tokenizer:
    return Tokenizer(tiny_ckpt / "tokenizer.json", 0, (1,))


def token_streams(tok: Tokenizer) -> dict[str, list[int]]:
    rng = random.Random(0)
    corpus = tok.encode(CORPUS_PATH.read_text(encoding="utf-8")[:4000], add_bos=False)
    mixed = tok.encode(MIXED * 3, add_bos=False)
    return {
        "corpus": corpus,
        "multibyte": mixed,  # characters split over byte tokens
        # any ids, the two special ones (skipped by decode) among them: invalid UTF-8 included
        "random": [rng.randrange(tok.vocab_size) for _ in range(600)],
        "specials": [t for c in corpus[:200] for t in (c, 1 if c % 7 == 0 else c)],
    }


def test_text_equals_a_whole_decode_at_every_token(tok):
    for name, ids in token_streams(tok).items():
        dec = tok.decoder()
        for i, t in enumerate(ids):
            committed = dec.committed
            dec.add(t)
            assert dec.text == tok.decode(ids[: i + 1]), f"{name}: token {i}"
            assert dec.committed.startswith(committed), f"{name}: committed text changed at token {i}"
            assert not dec.committed.endswith(UNDECODED) or name == "random", name
            assert dec.tail == "" or dec.tail.endswith(UNDECODED), f"{name}: {dec.tail!r}"


def test_a_split_character_is_committed_when_complete(tok):
    ids = tok.encode("é", add_bos=False)
    assert len(ids) >= 2, "the tiny tokenizer splits é over byte tokens (else this test tests nothing)"
    dec = tok.decoder()
    assert [dec.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1) and dec.tail.endswith(UNDECODED)
    assert dec.add(ids[-1]) == "é" and dec.text == "é"


class CountingTokenizer(Tokenizer):
    """Records the length of every id list decoded."""

    def __init__(self, path: Path):
        super().__init__(path, 0, (1,))
        self.lengths: list[int] = []

    def decode(self, ids):
        self.lengths.append(len(ids))
        return super().decode(ids)


def test_each_token_decodes_a_window_not_the_output(tiny_ckpt):
    """O(1) per token: over a 4,000-token output no decode call sees more than a few tokens."""
    tok = CountingTokenizer(tiny_ckpt / "tokenizer.json")
    ids = tok.encode((CORPUS_PATH.read_text(encoding="utf-8") + MIXED) * 2, add_bos=False)[:4000]
    tok.lengths.clear()
    dec = tok.decoder()
    for t in ids:
        dec.add(t)
    assert len(tok.lengths) == 2 * len(ids)
    assert max(tok.lengths) <= 8, max(tok.lengths)  # a 4-byte character over single-byte tokens: 5
    assert dec.text == Tokenizer(tiny_ckpt / "tokenizer.json", 0, (1,)).decode(ids)


# ------------------------------------------------------------------ the LLM on top of it
@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    """The eager reference network over the random tiny checkpoint (its text is mostly byte tokens:
    split and invalid UTF-8 throughout)."""
    import torch

    from dsa_trt.engine_config import EngineConfig
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network
    from dsa_trt.runtime.engine import eager_engine
    from dsa_trt.runtime.llm import LLM

    ckpt = Checkpoint(tiny_ckpt)
    cfg = EngineConfig(model=ckpt.config, cache_mode="fp32", dtype="float32", device="cpu", compiler="eager",
                       kv_scales=[1.0] * ckpt.config.num_hidden_layers)
    net = build_network(ckpt, "fp32", torch.float32, cfg.kv_scales)
    return LLM(eager_engine(net, cfg, torch.device("cpu"), ckpt.tokenizer_path), num_pages=16)


def test_stop_strings_and_streams_match_a_whole_decode(llm):
    """Greedy outputs cut by stop strings (found in the output of a run without them) equal the cut of
    a whole decode, and each request's streamed new_text concatenates to its final text."""
    from dsa_trt.runtime.sampling import SamplingParams

    prompts = ["The cat", "A long time ago", "Numbers: 1 2 3", "é"]
    free = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, free):
        assert out.text == llm.tokenizer.decode(out.token_ids)
        text = out.text
        for stop in {text[3:5], text[10:13], text[-4:-1]} - {""}:
            sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "\x00never"])
            streamed = "".join(d.new_text for d in llm.stream(p, sp))
            got = llm.generate([p], [sp])[0]
            assert got.finish_reason == "stop" and got.stop_reason == stop
            assert got.text == text[: text.find(stop)], (p, stop)
            assert got.text == llm.tokenizer.decode(got.token_ids)[: text.find(stop)]
            assert streamed.startswith(got.text), (p, stop)  # a cut may take back streamed text
