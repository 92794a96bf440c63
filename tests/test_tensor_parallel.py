"""Tensor parallelism (docs/architecture.md §7) on the CPU: two ranks over gloo equal one rank.

* The sharding table slices every checkpoint tensor so that the shards put back together are
  the full tensor, and each rank's network takes exactly its shards.
* Eager: the TP=2 network (one process per rank, torch.multiprocessing + gloo, dsa::all_reduce
  summing the row-parallel partials) gives the TP=1 logits for a sparse prefill (ragged, scattered
  pages), a decode step and a dense prefill; fp32 caches and the fp8 caches.
* Compiled: build_engine(tp=2) writes two AOTInductor program pairs; both ranks' packages, driven
  by runtime/distributed.py (rank 0 broadcasts each step), give the TP=1 logits, and greedy
  generation through LLM on rank 0 gives the TP=1 tokens.

Tolerances: fp32 caches 1e-4 (only the summation order of the all-reduce differs, measured ~1e-6);
fp8 caches 2e-2 (an fp32-order change can move a latent across an e4m3 rounding boundary, the
same bound as compiled-vs-eager in test_engine.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsa_trt.engine_config import EngineConfig
from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.program import build_network
from dsa_trt.export.sharding import local_experts, shard_dim, shard_tensor
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.step_inputs import StepInputs

from .helpers.ranks import join_group, rank_env, spawn

TP = 2
NUM_PAGES = 16
TOL = {"fp32": 1e-4, "fp8": 2e-2}
FP8_SCALES = [0.0114, 0.012, 0.0116]  # what calibration gives the tiny checkpoint (any fixed value would do)
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog because", "Once upon a time, in a small village"]
GREEDY_STEPS = 12


def _steps(cfg) -> list[StepInputs]:
    """A prefill (ragged, scattered pages, longer than top-k), a decode step, a short fresh prefill."""
    prefill = StepInputs.build([(list(range(2, 92)), 0, [7, 3]), (list(range(5, 35)), 0, [11])])
    decode = StepInputs.build([([17], 90, [7, 3]), ([9], 30, [11])])
    dense = StepInputs.build([(list(range(40, 52)), 0, [5]), (list(range(60, 65)), 0, [9])])
    return [prefill, decode, dense]


@torch.no_grad()
def _run_steps(forward, cfg, cache_mode) -> list[torch.Tensor]:
    pools = allocate_pools(cfg, cache_mode, NUM_PAGES)
    return [forward(step, pools) for step in _steps(cfg)]


def _eager_forward(net):
    def forward(step, pools):
        return net(*step.as_tuple(), *pools)

    return forward


# ---------------------------------------------------------------- the sharding table
def test_shards_reassemble_the_checkpoint(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    full = build_network(ckpt, "fp32", torch.float32).state_dict()
    ranks = [build_network(ckpt, "fp32", torch.float32, tp_rank=r, tp_size=TP).state_dict() for r in range(TP)]
    assert shard_dim("model.layers.0.self_attn.q_b_proj.weight") == 0
    assert shard_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert shard_dim("model.layers.1.mlp.shared_experts.down_proj.weight") == 1
    assert shard_dim("model.layers.0.self_attn.indexer.wq_b.weight") is None
    assert shard_dim("lm_head.weight") is None and shard_dim("model.embed_tokens.weight") is None
    for name, tensor in full.items():
        dim = shard_dim(name)
        if ".mlp.experts." in name:  # routed experts: whole, on the rank that owns the index
            e = int(name.split(".mlp.experts.")[1].split(".")[0])
            owners = [r for r in range(TP) if local_experts(cfg, r, TP)[0] <= e < local_experts(cfg, r, TP)[1]]
            assert [name in sd for sd in ranks] == [r in owners for r in range(TP)], name
            torch.testing.assert_close(ranks[owners[0]][name], tensor, rtol=0, atol=0)
        elif dim is None:
            for sd in ranks:
                torch.testing.assert_close(sd[name], tensor, rtol=0, atol=0, msg=name)
        else:
            torch.testing.assert_close(torch.cat([sd[name] for sd in ranks], dim=dim), tensor, rtol=0, atol=0,
                                       msg=name)
            assert shard_tensor(name, tensor, 1, TP).shape[dim] == tensor.shape[dim] // TP
    assert sum(len(sd) for sd in ranks) > len(full)  # replicated tensors on both ranks


def test_tp_must_divide_the_split_dims(tiny_ckpt):
    from dsa_trt.config import ConfigError

    with pytest.raises(ConfigError, match="tp=3 does not divide num_attention_heads = 4"):
        build_network(Checkpoint(tiny_ckpt), "fp32", torch.float32, tp_rank=0, tp_size=3)


# ---------------------------------------------------------------- eager TP=2 == TP=1
def _eager_worker(rank, world, port, out_dir, ckpt_dir):
    join_group(rank, world, port)
    ckpt = Checkpoint(ckpt_dir)
    result = {}
    for mode in ("fp32", "fp8"):
        scales = FP8_SCALES if mode == "fp8" else None
        net = build_network(ckpt, mode, torch.float32, scales, tp_rank=rank, tp_size=world)
        result[mode] = _run_steps(_eager_forward(net), ckpt.config, mode)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp1_logits(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    out = {}
    for mode in ("fp32", "fp8"):
        net = build_network(ckpt, mode, torch.float32, FP8_SCALES if mode == "fp8" else None)
        out[mode] = _run_steps(_eager_forward(net), ckpt.config, mode)
    return out


def _compare(got: list[torch.Tensor], want: list[torch.Tensor], tol: float, what: str) -> float:
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        err = (g - w).abs().max().item()
        assert err < tol, f"{what} step {i}: max |logit diff| vs TP=1 {err:.3g} (tol {tol})"
        worst = max(worst, err)
    return worst


def test_eager_tp2_equals_tp1(tiny_ckpt, tp1_logits, tmp_path):
    results = spawn(_eager_worker, TP, tmp_path, str(tiny_ckpt))
    for mode in ("fp32", "fp8"):
        for rank, res in enumerate(results):
            err = _compare(res[mode], tp1_logits[mode], TOL[mode], f"eager {mode} rank {rank}")
            print(f"[eager TP={TP}] {mode} caches, rank {rank}: max |logit diff| vs TP=1 {err:.2e}")
        torch.testing.assert_close(results[0][mode], results[1][mode], rtol=0, atol=0)  # same logits on every rank


# ---------------------------------------------------------------- compiled TP=2 engine == TP=1
def _compiled_worker(rank, world, port, out_dir, engine_dir):
    from dsa_trt.runtime.distributed import run_tensor_parallel
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.sampling import SamplingParams

    rank_env(rank, world, port)  # run_tensor_parallel joins the group

    def rank0(engine):
        cfg = engine.config
        logits = _run_steps(lambda step, pools: engine.forward(step, *pools), cfg.model, cfg.cache_mode)
        llm = LLM(engine, num_pages=2 * NUM_PAGES)  # another page count: the worker re-allocates its pools
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True))
        return {"logits": logits, "tokens": [o.token_ids for o in outs]}

    result = run_tensor_parallel(engine_dir, rank0, device="cpu")
    torch.save(result or {}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_compiled_tp2_engine_equals_tp1(tiny_ckpt, tp1_logits, tmp_path_factory):
    from dsa_trt.builder.build import build_engine
    from dsa_trt.runtime.engine import eager_engine
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.sampling import SamplingParams

    engine_dir = tmp_path_factory.mktemp("engines") / "tiny-tp2"
    build_engine(tiny_ckpt, engine_dir, tp=TP, cache_mode="fp32", compiler="aoti", device="cpu", dtype="float32")
    cfg = EngineConfig.load(engine_dir)
    assert cfg.tp_size == TP
    assert all((engine_dir / cfg.rank_file(r)).is_file() for r in range(TP))

    rank0, rank1 = spawn(_compiled_worker, TP, engine_dir.parent, str(engine_dir))
    assert rank1 == {}
    err = _compare(rank0["logits"], tp1_logits["fp32"], TOL["fp32"], "compiled TP=2")
    print(f"[compiled TP={TP}] fp32 caches: max |logit diff| vs TP=1 {err:.2e}")

    ckpt = Checkpoint(tiny_ckpt)
    ref = LLM(eager_engine(build_network(ckpt, "fp32", torch.float32), dataclasses.replace(cfg, tp_size=1), torch.device("cpu"),
                           engine_dir / cfg.tokenizer), num_pages=2 * NUM_PAGES)
    want = [o.token_ids for o in ref.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS,
                                                                       ignore_eos=True))]
    assert rank0["tokens"] == want, f"greedy tokens TP={TP} {rank0['tokens']} vs TP=1 {want}"
