"""Context-parallel prefill, interleaved (docs/architecture.md §7), on CPU processes over gloo.

A step's token i runs on rank i % p; the ranks all-gather the MLA latents and indexer keys before
the cache writes, so every rank's caches hold the whole step, and each rank's queries attend
over them; the rows whose logits are needed are assembled after the last layer. CP=2 and CP=4,
with every expert on every rank and with the expert-parallel exchange (CP x EP over the same
ranks), give the one-rank logits for: a ragged two-sequence prefill on scattered pages (longer
than top-k, so the indexer really selects), a decode step of both sequences, and a fresh prompt
of p - 1 tokens (shorter than p: some ranks hold only padding). After the steps, every rank's
MLA and indexer pools equal the one-rank pools.

Tolerances: fp32 network and caches: logits 1e-4, pools 1e-5 (only the GEMM row batches and
summation orders differ; measured 9e-6 / 2e-6); fp8 caches: logits 2e-2 (an fp32-order change
can move a latent across an e4m3 rounding boundary; the bound of test_tensor_parallel.py) and
pools are compared only through the logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsa_trt.export.checkpoint import Checkpoint
from dsa_trt.export.parallel import ParallelConfig, build_parallel_network
from dsa_trt.export.program import build_network
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.distributed import pad_step_tokens
from dsa_trt.runtime.step_inputs import StepInputs

from .helpers.ranks import join_group, spawn

NUM_PAGES = 16
FP8_SCALES = [0.0114, 0.012, 0.0116]  # what calibration gives the tiny checkpoint (any fixed value would do)
TOL = {"fp32": 1e-4, "fp8": 2e-2}
POOL_TOL = 1e-5


def _steps(world: int) -> list[StepInputs]:
    prefill = StepInputs.build([(list(range(2, 92)), 0, [7, 3]), (list(range(5, 35)), 0, [11])])
    decode = StepInputs.build([([17], 90, [7, 3]), ([9], 30, [11])])
    short = StepInputs.build([(list(range(60, 60 + world - 1)), 0, [5])])  # shorter than p
    return [prefill, decode, short]


def _padded(step: StepInputs, world: int) -> StepInputs:
    n = step.input_ids.shape[0]
    return pad_step_tokens(step, -(-n // world) * world)


@torch.no_grad()
def _run(net, steps, cfg, cache_mode):
    pools = allocate_pools(cfg, cache_mode, NUM_PAGES)
    logits = [net(*s.as_tuple(), *pools) for s in steps]
    return logits, pools


VARIANTS = (("fp32", False), ("fp32", True), ("fp8", True))  # (cache mode, expert parallel)


def _worker(rank, world, port, out_dir, ckpt_dir):
    join_group(rank, world, port)
    ckpt = Checkpoint(ckpt_dir)
    steps = [_padded(s, world) for s in _steps(world)]
    result = {}
    for mode, ep in VARIANTS:
        pc = ParallelConfig(size=world, rank=rank, expert_parallel=ep, context_parallel=True)
        net = build_parallel_network(ckpt, mode, torch.float32, pc, FP8_SCALES if mode == "fp8" else None)
        logits, pools = _run(net, steps, ckpt.config, mode)
        result[(mode, ep)] = {"logits": logits, "pools": pools if mode == "fp32" else None}
    dist.barrier()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    out = {}
    for world in (2, 4):
        for mode in ("fp32", "fp8"):
            net = build_network(ckpt, mode, torch.float32, FP8_SCALES if mode == "fp8" else None)
            out[(world, mode)] = _run(net, _steps(world), ckpt.config, mode)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_rank(tiny_ckpt, one_rank, tmp_path, world):
    results = spawn(_worker, world, tmp_path, str(tiny_ckpt))
    for mode, ep in VARIANTS:
        want_logits, want_pools = one_rank[(world, mode)]
        worst, worst_pool = 0.0, 0.0
        for rank, res in enumerate(results):
            got = res[(mode, ep)]
            what = f"CP={world} {'EP ' if ep else ''}{mode} rank {rank}"
            for i, (g, w) in enumerate(zip(got["logits"], want_logits)):
                assert g.shape == w.shape, f"{what} step {i}: logits {tuple(g.shape)} vs {tuple(w.shape)}"
                err = (g - w).abs().max().item()
                assert err < TOL[mode], f"{what} step {i}: max |logit diff| vs one rank {err:.3g} (tol {TOL[mode]})"
                worst = max(worst, err)
            if got["pools"] is not None:  # every rank holds the whole step in its caches
                for kind, gp, wp in zip(("mla", "index"), got["pools"], want_pools):
                    for layer, (g, w) in enumerate(zip(gp, wp)):
                        err = (g.float() - w.float()).abs().max().item()
                        assert err < POOL_TOL, f"{what}: {kind} pool of layer {layer} differs by {err:.3g}"
                        worst_pool = max(worst_pool, err)
        print(f"[CP={world}{' x EP' if ep else ''}] {mode} caches: max |logit diff| vs one rank {worst:.2e}, "
              f"max |pool diff| {worst_pool:.2e}")


def test_context_parallel_step_must_be_padded(tiny_ckpt):
    net = build_parallel_network(Checkpoint(tiny_ckpt), "fp32", torch.float32,
                                 ParallelConfig(size=2, rank=0, expert_parallel=False, context_parallel=True))
    step = _steps(2)[2]  # one token
    pools = allocate_pools(net.cfg, "fp32", NUM_PAGES)
    with pytest.raises(ValueError, match="must be a multiple of cp=2; pad it with"):
        net(*step.as_tuple(), *pools)


PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog because", "Once upon a time, in a small village"]
GREEDY_STEPS = 10


def _generate_worker(rank, world, port, out_dir, ckpt_dir):
    from dsa_trt.runtime.distributed import run_parallel
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.sampling import SamplingParams

    from .helpers.ranks import eager_parallel_engine

    join_group(rank, world, port)

    def load(rank, world, dev):
        return eager_parallel_engine(ckpt_dir, "fp32", ParallelConfig(size=world, rank=rank, context_parallel=True))

    def rank0(engine):
        llm = LLM(engine, num_pages=2 * NUM_PAGES)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True))
        return {"tokens": [o.token_ids for o in outs]}

    result = run_parallel(load, rank0, device="cpu", context_parallel=world)
    torch.save(result or {}, Path(out_dir) / f"rank{rank}.pt")


def test_context_parallel_generate_equals_one_rank(tiny_ckpt, tmp_path):
    """The runtime's CP mode: rank 0's LLM schedules, DistributedEngine pads each step to a
    multiple of p and broadcasts it, every rank's program takes its interleaved share (CP x EP,
    eager programs); greedy tokens equal one rank's."""
    from dsa_trt.runtime.llm import LLM
    from dsa_trt.runtime.sampling import SamplingParams

    from dsa_trt.engine_config import EngineConfig
    from dsa_trt.runtime.engine import eager_engine

    world = 2
    rank0, rank1 = spawn(_generate_worker, world, tmp_path, str(tiny_ckpt))
    assert rank1 == {}
    ckpt = Checkpoint(tiny_ckpt)
    cfg = EngineConfig(model=ckpt.config, cache_mode="fp32", dtype="float32", device="cpu", compiler="eager",
                       kv_scales=[1.0] * ckpt.config.num_hidden_layers)
    ref = LLM(eager_engine(build_network(ckpt, "fp32", torch.float32), cfg, torch.device("cpu"),
                           Path(tiny_ckpt) / "tokenizer.json"), num_pages=2 * NUM_PAGES)
    want = [o.token_ids for o in ref.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS,
                                                                       ignore_eos=True))]
    assert rank0["tokens"] == want, f"greedy tokens CP={world} {rank0['tokens']} vs one rank {want}"


def _compiled_worker(rank, world, port, out_dir, ckpt_dir):
    from dsa_trt.builder.aoti import compile_package
    from dsa_trt.export.parallel import export_parallel_program

    join_group(rank, world, port)
    ckpt = Checkpoint(ckpt_dir)
    pc = ParallelConfig(size=world, rank=rank, context_parallel=True)  # CP x EP: every collective op
    net = build_parallel_network(ckpt, "fp32", torch.float32, pc)
    package = compile_package(export_parallel_program(net, max_num_tokens=512, max_batch=16, max_pages_per_seq=64),
                              Path(out_dir) / f"cp{world}-rank{rank}.pt2")
    program = torch._inductor.aoti_load_package(str(package))
    dist.barrier()  # both programs compiled: the steps' collectives meet
    steps = [_padded(s, world) for s in _steps(world)]
    logits, _ = _run(program, steps, ckpt.config, "fp32")
    torch.save({"logits": logits}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_cp_ep_programs_equal_one_rank(tiny_ckpt, one_rank, tmp_path):
    """AOTInductor programs of a CP x EP=2 group (dsa::all_gather, dsa::ep_all_to_all and
    dsa::all_reduce compiled as nodes, the token count a symbolic multiple of p): the one-rank
    logits within the fp32 tolerance."""
    world = 2
    results = spawn(_compiled_worker, world, tmp_path, str(tiny_ckpt))
    want, _ = one_rank[(world, "fp32")]
    worst = 0.0
    for rank, res in enumerate(results):
        for i, (g, w) in enumerate(zip(res["logits"], want)):
            err = (g - w).abs().max().item()
            assert err < TOL["fp32"], f"compiled CP x EP={world} rank {rank} step {i}: max |logit diff| {err:.3g}"
            worst = max(worst, err)
    print(f"[compiled CP x EP={world}] fp32 caches: max |logit diff| vs one rank {worst:.2e}")


def _nccl_worker(rank, world, port, out_dir, ckpt_dir):
    from .helpers.ranks import ref_all_to_all

    join_group(rank, world, port, backend="nccl")
    dev = torch.device("cuda", rank)
    gen = torch.Generator().manual_seed(7)
    bufs = [torch.randn(world, 4, 6, generator=gen) for _ in range(world)]
    counts = [torch.tensor([r % 5, (r + 2) % 5][:world] + [1] * (world - 2)) for r in range(world)]
    for b, c in zip(bufs, counts):
        for d in range(world):
            b[d, int(c[d]):] = 0
    got = torch.ops.dsa.ep_all_to_all(bufs[rank].to(dev), counts[rank].to(dev), world).cpu()
    ckpt = Checkpoint(ckpt_dir)
    net = build_parallel_network(ckpt, "fp32", torch.float32,
                                 ParallelConfig(size=world, rank=rank, context_parallel=True), device=dev)
    steps = [_padded(s, world).to(dev) for s in _steps(world)]
    pools = allocate_pools(ckpt.config, "fp32", NUM_PAGES, dev)
    with torch.no_grad():
        logits = [net(*s.as_tuple(), *pools).cpu() for s in steps]
    torch.save({"a2a": (got, ref_all_to_all(bufs, counts)[rank]), "logits": logits}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_cp_ep_equals_one_rank(tiny_ckpt, one_rank, tmp_path):
    """The same ops over NCCL on 2 GPUs: the exchange equals the reference bitwise; CP x EP=2
    logits (reference kernels on CUDA tensors unless DSA_KERNELS loads ours) equal the CPU one-rank
    logits within the fp32 tolerance."""
    world = 2
    results = spawn(_nccl_worker, world, tmp_path, str(tiny_ckpt))
    want, _ = one_rank[(world, "fp32")]
    for rank, res in enumerate(results):
        torch.testing.assert_close(*res["a2a"], rtol=0, atol=0, msg=f"NCCL ep_all_to_all rank {rank}")
        for i, (g, w) in enumerate(zip(res["logits"], want)):
            err = (g - w).abs().max().item()
            assert err < TOL["fp32"], f"NCCL CP x EP rank {rank} step {i}: max |logit diff| vs one rank {err:.3g}"
