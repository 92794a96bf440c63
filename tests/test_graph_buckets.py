"""CUDA-graph buckets (runtime/cuda_graphs.py) compute what the unpadded step computes, on CPU.

A graph replays the step padded into its bucket (q rows per sequence, real tokens last, contract
padding elsewhere). Whether a padded step gives the real rows the same logits, hidden states and
cache writes as the step itself does not need a GPU: both run eagerly here on the tiny
checkpoint's network (fp32, exact caches) and its MTP draft network, after a prefill that puts
some sequences past index_topk (sparse attention) and leaves one below it (dense). The capture
itself runs on the H200 (tests/test_gpu_engine.py).
"""

from __future__ import annotations

import pytest
import torch

from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.mtp import build_mtp_network
from dsa_trt.export.program import build_network
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.cuda_graphs import MIN_WIDTH, pad_uniform, uniform_shape
from dsa_trt.step import StepInputs

NUM_PAGES = 16
PROMPTS = (70, 5, 40)  # tokens already cached per sequence (index_topk of the tiny model: 16)
PAGES = ([3, 9], [5], [12, 1])
# fp32 everywhere; only the row count of the matmuls differs between the two runs
REL = 1e-5


@pytest.fixture(scope="module")
def nets(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt, include_mtp=True)
    assert ckpt.config.index_topk < max(PROMPTS) and ckpt.config.index_topk > min(PROMPTS)
    layers = ckpt.config.num_hidden_layers
    main = build_network(ckpt, "fp32", torch.float32, [1.0] * layers)
    main.return_hidden = True
    return ckpt.config, main, build_mtp_network(ckpt, "fp32", torch.float32)


def _prefilled(cfg, net, num_layers=None):
    pools = allocate_pools(cfg, "fp32", NUM_PAGES, num_layers=num_layers)
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist(), 0, p) for n, p in zip(PROMPTS, PAGES)]
    step = StepInputs.build(seqs)
    args = step.as_tuple()
    if num_layers is not None:  # the draft network also takes hidden states
        args = (*args, torch.randn(step.input_ids.shape[0], cfg.hidden_size, generator=g))
    with torch.no_grad():
        net(*args, *pools)
    return pools


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run_both(cfg, net, step, hidden=None, num_layers=None):
    """(unpadded outputs, padded outputs at the real rows, unpadded pools, padded pools)."""
    shape = uniform_shape(step)
    assert shape is not None
    batch, width = step.page_table.shape[0] + 3, max(MIN_WIDTH, step.page_table.shape[1])
    padded, dst = pad_uniform(step, shape, batch, width)
    pools = [_prefilled(cfg, net, num_layers) for _ in range(2)]
    with torch.no_grad():
        extra = () if hidden is None else (hidden,)
        want = net(*step.as_tuple(), *extra, *pools[0])
        if hidden is not None:
            big = torch.zeros(batch * shape.q, cfg.hidden_size)
            big[dst] = hidden
            extra = (big,)
        got = net(*padded.as_tuple(), *extra, *pools[1])
    return want, (got[0][: want[0].shape[0]], got[1][dst]), pools[0], pools[1]


def _same(want, got, pools_a, pools_b):
    for a, b, what in zip(want, got, ("logits", "hidden")):
        assert a.shape == b.shape and _rel(b, a) < REL, what
    for a, b in zip(pools_a[0] + pools_a[1], pools_b[0] + pools_b[1]):
        assert _rel(b, a) < REL  # padding rows wrote nowhere, real rows wrote the same


def test_verify_bucket_equals_the_step(nets):
    """The MTP verify step (last token + 2 drafts per sequence, every row a logits row) in a
    bigger bucket, through the main network."""
    cfg, main, _ = nets
    seqs = [([7 + i, 8 + i, 9 + i], n, p) for i, (n, p) in enumerate(zip(PROMPTS, PAGES))]
    step = StepInputs.build(seqs, logits_for="all")
    assert uniform_shape(step).q == 3
    _same(*_run_both(cfg, main, step))


def test_decode_bucket_equals_the_step(nets):
    cfg, main, _ = nets
    step = StepInputs.build([([11 + i], n, p) for i, (n, p) in enumerate(zip(PROMPTS, PAGES))])
    _same(*_run_both(cfg, main, step))


def test_draft_bucket_equals_the_step(nets):
    """The MTP draft pass over pending positions of different counts (1-3 per sequence), only the
    last row of each a logits row, through the draft network with its hidden-state input."""
    cfg, _, draft = nets
    seqs = [(list(range(20, 20 + k)), n - k, p) for k, n, p in zip((3, 1, 2), PROMPTS, PAGES)]
    step = StepInputs.build(seqs)
    shape = uniform_shape(step)
    assert shape.q == 3 and not shape.all_logits
    hidden = torch.randn(step.input_ids.shape[0], cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    _same(*_run_both(cfg, draft, step, hidden, num_layers=1))


def test_steps_that_are_not_uniform_run_eagerly():
    mixed = StepInputs.build([([1, 2, 3], 10, [1]), ([4], 70, [2, 3])], logits_for="all")
    assert uniform_shape(mixed) is None  # every row a logits row but 3 + 1 tokens
    chunk = StepInputs.build([(list(range(2, 40)), 0, [1]), ([4], 70, [2, 3])])
    assert uniform_shape(chunk).q == 38  # last-row logits: uniform, but past MAX_Q (the runner's check)
