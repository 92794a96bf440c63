"""The real-dims slice across p ranks (issue 28): equality to one rank, decode split into compute and
exchange, context-parallel prefill against one rank.

    python3 benchmarks/bench_parallel.py --ranks 8 [--layers 4 --experts 256] [--batches 32 128]
        [--context 32768] [--prefill 32768 131072] [--device cuda|cpu] [--tiny] [--json OUT]

One command starts everything (torch.multiprocessing spawn, no torchrun): first ONE process, the
reference (the plain one-rank network on GPU 0, or the CPU), then p rank processes (rank r on GPU r,
NCCL with NVLink multicast off, runtime/distributed.py launch_env; gloo on the CPU), which print
the tables (rank 0, markdown) as their rows are measured. The reference runs first and alone so that
it can hold the whole slice (4 layers x 256 experts: ~34 GB of e4m3 experts) on GPU 0 and its timings
see an idle machine; the ranks read what it saved. Every collective of the ranks times out after
DSA_DIST_TIMEOUT_S (default here 180 s: the knob's 600 s would outlast a 10-minute device call), and
spawn stops the other processes when one exits with an error: a failed rank ends the run, it does
not hang it. A shape that OOMs or overflows the expert exchange prints its row as such on every rank
(the ranks agree over a gloo side group) and the sweep goes on; a failure on some ranks only, inside
a collective, ends the run at the timeout (the rows printed so far stand).

Network: the one of bench_realdims.py (V3.2's per-layer dims, bf16 activations, fp8 caches, W8A8
e4m3 Linears, the routed experts as one dsa::moe_experts call), as export/parallel.py's
ParallelDSAForCausalLM on the ranks: expert parallel (E/p routed experts per rank, dsa::ep_all_to_all
dispatch and combine) with data-parallel attention for decode, and context parallel x expert parallel
(token i on rank i % p) for prefill; ``--tiny`` the tiny model's widths (export/tiny_checkpoint.py
TINY_CONFIG) in the same V3.2 config, for the CPU.

Weights: random, made on the device, and **seeded per tensor name and, for the stacked experts, per
global expert index** (``tensor_seed``). A rank under expert parallelism therefore generates only
its own experts' slices, bit-identical to the one-rank network's, with no whole-model temporary and
no checkpoint on disk (a real-dims checkpoint is ~37 GB to write and read per run). The values follow
bench_realdims.random_network (e4m3 ~N(0, 64) with power-of-two 2^-12 block scales, unit norms, zero
biases, other weights N(0, 0.02)), whose single generator stream cannot be split by expert, except
the lm_head: std 0.3 x sqrt(256 / hidden) as the checkpoint generators use (logits of std ~5), so
the greedy check does not sit on near-ties.

Tables (rank 0):

1. Equality: the p-rank networks against the reference on the same steps, the reference's greedy
   tokens fed to both (teacher forcing), so every step compares logits of identical inputs. "EP=p"
   rows: each rank's own ``--eq-batch`` sequences of ``--eq-prompt`` tokens (longer than index_topk:
   the indexer selects) and ``--eq-steps`` decode steps; "CP=p x EP=p": one ``--eq-cp-prompt``-token
   prompt (padded to a multiple of p) and its decode steps. Reported, not asserted: max |logit
   diff|, relative L2, argmaxes that agree with the reference's greedy token (all agree <=> the
   p-rank greedy tokens equal one rank's), and the reference's smallest top-2 margin among the
   disagreements. Expected: relative L2 ~1e-3 or below and disagreements only where that margin is
   of the order of the max |diff| (bf16 activations: the p-rank GEMMs and expert kernels see other
   row batches; the fp8 cache rows are quantised from the same bf16 rows; tests/test_expert_parallel.py
   and test_context_parallel.py hold the fp32 bounds).
2. Decode per layer at B sequences per rank (``--batches``) of ``--context`` cached tokens (random
   finite e4m3 cache bytes, pages scattered): "eager": RegionClock cuts (CUDA events; CPU wall
   clock) at every layer boundary and around every dsa:: collective call; "exchange" is the time
   inside the collectives (dispatch and combine, the count all-gather and host sync of the eager
   exchange included), "compute" the rest of the MoE layer. "graph" (CUDA): the whole step captured
   into one CUDA graph (bench_realdims.capture_step; under capture the exchange sends its whole
   static [p, C, W] buffers), step µs = median of ``--replays`` replays; the per-layer split from
   bench_realdims.profiled_replays / split_replays (torch.profiler, each GPU activity charged from
   the previous one's end to its own end and tagged with its layer), exchange = the activities
   whose names start with "nccl". A capture that fails prints its row with the reason (eager stays).
   Both include waiting for the slowest peer. Values: the mean over ranks of each rank's median.
   Bytes: those this rank sends to its peers per MoE layer (eager: the real pairs; graph:
   export/parallel.exchange_bytes' whole buffers less the own block); GB/s over the exchange µs;
   rooflines: compute = bench_realdims.layer_roofline of the rank's MoE layer (its E/p experts all
   touched, FLOPs of the B*k pairs it receives), exchange = bytes / NVLINK_BPS (realdims_model).
3. Context-parallel prefill of S tokens (``--prefill``): CP=p x EP=p on the ranks (the same prompt on
   every rank) against the reference's prefill of that prompt; ms = median of ``--iters`` after
   ``--warmup``; exchange = time in the collectives (latents / indexer keys all-gather, expert
   exchange, final all-reduce). Its exchange capacity C is ``--prefill-capacity-factor`` x the mean
   pairs per destination (default 2; 0 = the never-overflowing worst case T*k, whose [p*C, D] fp32
   combine buffers alone are S*k*28 KB, ~30 GB at 128K). Roofline: the reference network's
   layer_roofline summed over the layers (every expert touched); "/ ideal" = p-rank ms over
   roofline / p.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsa_trt.config import ModelConfig
from dsa_trt.export.network import DSAForCausalLM
from dsa_trt.export.parallel import ParallelConfig, ParallelDSAForCausalLM, exchange_bytes
from dsa_trt.export.program import derived_buffers, set_tensor
from dsa_trt.plugins.collectives import EPCapacityError
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.runtime.distributed import launch_env, pad_step_tokens
from dsa_trt.step import StepInputs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_realdims, realdims_model beside this file
from bench_realdims import (  # noqa: E402
    PROFILED_REPLAYS,
    RegionClock,
    capture_step,
    decode_step,
    layer_roofline,
    median_step_us,
    prefill_step,
    profiled_replays,
    real_config,
    roofline_us,
    split_replays,
)
from realdims_model import NVLINK_BPS, REAL_CONFIG, tokens_label  # noqa: E402
from timing import layer_hooks, patched_ops, time_wall_us, timed_op  # noqa: E402

COLLECTIVES = ("ep_all_to_all", "all_gather", "all_reduce")  # the dsa:: ops of export/parallel.py
EXCHANGE = "exchange"  # RegionClock category of the time inside a collective
E4M3_STD, E4M3_MAX, SCALE = 64.0, 448.0, 2.0 ** -12  # bench_realdims.random_network's values
WEIGHT_STD = 0.02
DEFAULT_TIMEOUT_S = 180
CACHE_BYTE_HIGH = 120  # random cache bytes in [0, 120): finite e4m3 (bench_realdims)


# ------------------------------------------------------------------------------------------ network
def bench_config(tiny: bool, layers: int, experts: int, vocab: int | None) -> ModelConfig:
    """real_config's slice, or (tiny) the same V3.2 config at TINY_CONFIG's widths, heads and vocabulary."""
    if not tiny:
        return real_config(layers, experts, vocab or 129280)
    from dsa_trt.export.real_dims import router_groups
    from dsa_trt.export.tiny_checkpoint import TINY_CONFIG

    d = json.loads(REAL_CONFIG.read_text())
    d.update({k: v for k, v in TINY_CONFIG.items() if k in d})
    top_k = min(TINY_CONFIG["num_experts_per_tok"], experts)
    n_group, topk_group = router_groups(experts, top_k)
    d.update(num_hidden_layers=layers, first_k_dense_replace=min(1, layers), n_routed_experts=experts,
             num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, num_nextn_predict_layers=0,
             vocab_size=vocab or TINY_CONFIG["vocab_size"])
    return ModelConfig.from_hf_dict(d)


def tensor_seed(name: str, expert: int | None = None) -> int:
    """The seed of one tensor (or one global expert's slice of a stacked tensor): any rank, any layout."""
    key = name if expert is None else f"{name}[expert {expert}]"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def seeded_tensor(name: str, shape, dtype: torch.dtype, device, cfg: ModelConfig,
                  expert: int | None = None) -> torch.Tensor:
    if name.endswith(("scale_inv", "_scale")):
        return torch.full(shape, SCALE, dtype=dtype, device=device)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(tensor_seed(name, expert))
    x = torch.randn(shape, generator=gen, device=device)
    if dtype == torch.float8_e4m3fn:
        return (x * E4M3_STD).clamp_(-E4M3_MAX, E4M3_MAX).to(dtype)
    if name == "lm_head.weight":
        from dsa_trt.export.tiny_checkpoint import LM_HEAD_STD, TINY_CONFIG

        return (x * LM_HEAD_STD * math.sqrt(TINY_CONFIG["hidden_size"] / cfg.hidden_size)).to(dtype)
    return (x * WEIGHT_STD).to(dtype)


def _skeleton(cfg: ModelConfig, parallel: ParallelConfig | None) -> DSAForCausalLM:
    kw = dict(cache_mode="fp8", dtype=torch.bfloat16, expert_op=True, weight_format="fp8")
    with torch.device("meta"):
        return ParallelDSAForCausalLM(cfg, parallel=parallel, **kw) if parallel else DSAForCausalLM(cfg, **kw)


def seeded_network(cfg: ModelConfig, device, parallel: ParallelConfig | None = None) -> DSAForCausalLM:
    """The one-rank network (parallel None) or rank ``parallel.rank``'s, weights per tensor_seed."""
    net = _skeleton(cfg, parallel)
    state = {}
    for name, p in net.state_dict().items():
        if ".stacked_experts." in name:  # [E_rank, ...]: global expert expert_offset + j
            lo = net.get_submodule(name.rsplit(".", 1)[0]).expert_offset
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            for j in range(p.shape[0]):  # one expert at a time: no fp32 temporary of the layer
                t[j] = seeded_tensor(name, p.shape[1:], p.dtype, device, cfg, expert=lo + j)
        else:
            t = seeded_tensor(name, p.shape, p.dtype, device, cfg)
        state[name] = t
    net.load_state_dict(state, strict=True, assign=True)
    for name, t in derived_buffers(net).items():
        set_tensor(net, name, t.to(device))
    return net.eval()


def sharing_network(src: DSAForCausalLM, parallel: ParallelConfig) -> ParallelDSAForCausalLM:
    """Another ParallelConfig over ``src``'s tensors (no copy): e.g. the CP x EP prefill network of
    the EP decode network (the same experts per rank), or another exchange capacity."""
    net = _skeleton(src.cfg, parallel)
    net.load_state_dict(src.state_dict(), strict=True, assign=True)
    for name in derived_buffers(net):
        set_tensor(net, name, src.get_buffer(name))
    return net.eval()


def cache_pools(cfg: ModelConfig, num_pages: int, device, fill: bool):
    pools = allocate_pools(cfg, "fp8", num_pages, device=device)
    if fill:  # synthetic context: random finite e4m3 bytes
        for p in pools[0] + pools[1]:
            p.random_(0, CACHE_BYTE_HIGH)
    return pools


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ timing
@contextmanager
def exchange_clock(net: DSAForCausalLM, clock: RegionClock, calls: list):
    """RegionClock cuts at the layer boundaries and around each dsa:: collective: (layer, "rest") is
    compute, (layer, EXCHANGE) the collectives. ``calls`` gets (op, bytes of its input, row bytes and
    row counts of an exchange) per collective call."""
    def record(op):
        def on_call(a):
            x = a[0]  # not kept: a prefill's exchange buffers are GBs
            row = x.shape[-1] * x.element_size() if op == "ep_all_to_all" else 0
            calls.append((op, x.numel() * x.element_size(), row, a[1] if op == "ep_all_to_all" else None))
        return on_call

    with layer_hooks(net, clock), \
            patched_ops(COLLECTIVES, lambda op, packet: timed_op(clock, EXCHANGE, packet, record(op))):
        yield


def bytes_to_peers(calls: list, p: int) -> float:
    """Bytes this rank sent to the other ranks in the collective calls of exchange_clock: the
    exchange its real rows to other ranks (the buffer is [p, C, W]); a ring all-gather (p-1) x its
    block; a ring all-reduce 2 (p-1) / p x its tensor."""
    me, total = dist.get_rank(), 0.0
    for op, nbytes, row_bytes, counts in calls:
        if op == "ep_all_to_all":
            rows = counts.tolist()
            total += (sum(rows) - rows[me]) * row_bytes
        elif op == "all_gather":
            total += (p - 1) * nbytes
        else:
            total += 2 * (p - 1) / p * nbytes
    return total


def eager_runs(net, step, pools, iters: int, warmup: int, device, p: int) -> list[dict]:
    """``iters`` clocked forwards (after ``warmup``), the ranks aligned by a barrier before each ->
    [{"step", "layers": {layer: (total, exchange)}, "exchange", "sent"}] (µs, bytes to peers)."""
    args = (*step.as_tuple(), *pools)
    out = []
    with torch.no_grad():
        for _ in range(warmup):
            net(*args)
        for _ in range(iters):
            dist.barrier()
            clock, calls = RegionClock(device), []
            with exchange_clock(net, clock, calls):
                clock.push(category="outside")
                net(*args)
                clock.pop()
            totals = clock.totals_us()
            layers = {}
            for (layer, cat), us in totals.items():
                if layer is not None:
                    tot, ex = layers.get(layer, (0.0, 0.0))
                    layers[layer] = (tot + us, ex + (us if cat == EXCHANGE else 0.0))
            out.append({"step": sum(totals.values()), "layers": layers, "sent": bytes_to_peers(calls, p),
                        "exchange": sum(us for (_, cat), us in totals.items() if cat == EXCHANGE)})
    return out


def moe_layer_split(layers_per_run: list[dict], moe: list[int]) -> tuple[float, float]:
    """[{layer: (total, exchange)}] per run -> (median over runs of the mean MoE layer total, of its exchange)."""
    tot = statistics.median(sum(r[i][0] for i in moe) / len(moe) for r in layers_per_run)
    ex = statistics.median(sum(r[i][1] for i in moe) / len(moe) for r in layers_per_run)
    return tot, ex


def graph_runs(net, step, pools, replays: int, g: "Ranks") -> dict:
    """The decode step as one CUDA graph: {"step": median replay µs, "layers": [{layer: (total,
    nccl)} per profiled replay]} (module docstring, table 2). The ranks agree that every capture
    worked before any replays (a lone replay would wait in NCCL for the timeout)."""
    graph = out = None
    why = None
    try:
        graph, out = capture_step(net, step, pools)
    except Exception as e:  # noqa: BLE001 - every rank hears of it below
        why = f"rank {g.rank}: {_failure(e)}"
    failed = [w for w in g.gather(why) if w]
    if failed:
        del graph, out
        raise GraphCaptureError("; ".join(failed))
    try:
        graph.replay()  # uploads the graph
        torch.cuda.synchronize()
        dist.barrier()
        step_us = median_step_us(graph.replay, replays)
        dist.barrier()
        cpu, gpu, _ = profiled_replays(net, step, pools, graph, PROFILED_REPLAYS)
        kernels: list = []
        split_replays(cpu, gpu, kernels)
        layers = []
        for k in kernels:
            per: dict = {}
            for (layer, _region, name), us in k.items():
                if layer is not None:
                    tot, ex = per.get(layer, (0.0, 0.0))
                    per[layer] = (tot + us, ex + (us if name.startswith("nccl") else 0.0))
            layers.append(per)
        return {"step": step_us, "layers": layers}
    finally:
        del graph, out
        torch.cuda.synchronize()


class GraphCaptureError(RuntimeError):
    """A rank could not capture the decode step (the message names the ranks and why)."""


def moe_roofline_us(net, batch: int, context: int, p: int) -> float:
    """One MoE layer of a rank under EP: its own B decode tokens' attention, dense parts and shared
    expert, all its E/p routed experts read, and the ~B*k pairs it receives computed."""
    cfg = net.cfg
    b, f8, bf = layer_roofline(net, "MoE", batch, [(1, context)] * batch, cfg.n_routed_experts)
    moe = next(la.mlp for la in net.model.layers if not la.dense_mlp)
    routed = sum(t.numel() for t in (moe.stacked_experts.w13, moe.stacked_experts.w2))
    # layer_roofline counts 2 T k routed / E for a network holding every expert; a rank holds E/p
    f8 += 2 * batch * cfg.num_experts_per_tok * routed * (p - 1) / cfg.n_routed_experts
    return roofline_us(b, f8, bf)


def prefill_roofline_us(net, tokens: int) -> float:
    cfg, total = net.cfg, 0.0
    for layer in net.model.layers:
        kind = "dense" if layer.dense_mlp else "MoE"
        total += roofline_us(*layer_roofline(net, kind, tokens, [(tokens, tokens)], cfg.n_routed_experts))
    return total


# ------------------------------------------------------------------------------------------ steps
def equality_prompts(cfg, rank: int, a) -> tuple[list[list[int]], list[list[int]], int]:
    """Rank ``rank``'s equality sequences: (prompts, pages, pool pages); the pages scattered."""
    rng = random.Random(f"equality rank {rank}")
    ppd = -(-(a.eq_prompt + a.eq_steps + 1) // 64)
    num_pages = a.eq_batch * ppd + 1
    pages = rng.sample(range(num_pages), a.eq_batch * ppd)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(a.eq_prompt)] for _ in range(a.eq_batch)]
    return prompts, [pages[i * ppd:(i + 1) * ppd] for i in range(a.eq_batch)], num_pages


def cp_equality_prompt(cfg, a) -> tuple[list[list[int]], list[list[int]], int]:
    rng = random.Random("equality cp")
    ppd = -(-(a.eq_cp_prompt + a.eq_steps + 1) // 64)
    return [[rng.randrange(2, cfg.vocab_size) for _ in range(a.eq_cp_prompt)]], [rng.sample(range(ppd + 1), ppd)], ppd + 1


@torch.no_grad()
def greedy_reference(net, prompts, pages, num_pages, steps: int, device) -> dict:
    """One rank's greedy run: {"steps": [StepInputs on the CPU], "logits": [fp32 CPU]} (prefill + ``steps``)."""
    pools = cache_pools(net.cfg, num_pages, device, fill=False)
    step = StepInputs.build([(pr, 0, pg) for pr, pg in zip(prompts, pages)])
    out = {"steps": [], "logits": []}
    for i in range(steps + 1):
        logits = net(*step.to(device).as_tuple(), *pools).float().cpu()
        out["steps"].append(step)
        out["logits"].append(logits)
        tokens = logits.argmax(-1).tolist()
        step = StepInputs.build([([t], len(pr) + i, pg) for t, pr, pg in zip(tokens, prompts, pages)])
    return out


def compare(got: list[torch.Tensor], ref: dict) -> dict:
    """p-rank logits against the reference's on the same steps (sums, so ranks merge exactly)."""
    m = {"max_abs": 0.0, "diff_sq": 0.0, "ref_sq": 0.0, "agree": 0, "total": 0, "min_margin": None}
    for g, w in zip(got, ref["logits"]):
        d = (g - w).double()
        m["max_abs"] = max(m["max_abs"], d.abs().max().item())
        m["diff_sq"] += d.pow(2).sum().item()
        m["ref_sq"] += w.double().pow(2).sum().item()
        top2 = w.topk(2, dim=-1).values
        ok = g.argmax(-1) == w.argmax(-1)
        m["agree"] += int(ok.sum())
        m["total"] += ok.numel()
        if not bool(ok.all()):
            margin = (top2[:, 0] - top2[:, 1])[~ok].min().item()
            m["min_margin"] = margin if m["min_margin"] is None else min(m["min_margin"], margin)
    return m


def merge(ms: list[dict]) -> dict:
    margins = [m["min_margin"] for m in ms if m["min_margin"] is not None]
    out = {"max_abs": max(m["max_abs"] for m in ms), "agree": sum(m["agree"] for m in ms),
           "total": sum(m["total"] for m in ms), "min_margin": min(margins) if margins else None}
    out["rel_l2"] = math.sqrt(sum(m["diff_sq"] for m in ms) / max(sum(m["ref_sq"] for m in ms), 1e-30))
    return out


# ------------------------------------------------------------------------------------------ processes
def _device(a, rank: int) -> torch.device:
    if a.device == "cuda":
        torch.cuda.set_device(rank)
        from dsa_trt.plugins import cuda_ops

        cuda_ops.load("cuda")
        return torch.device("cuda", rank)
    torch.set_num_threads(1)  # the ranks (and the reference, for a like-for-like CPU) one core each
    return torch.device("cpu")


def _median_us(run, iters: int, warmup: int, device) -> float:
    if device.type != "cuda":
        return time_wall_us(run, iters, warmup)
    for _ in range(warmup):
        run()
    return median_step_us(run, iters)


def _failure(e: BaseException) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    if isinstance(e, EPCapacityError):
        return f"EP CAPACITY ({str(e).splitlines()[0][:200]})"
    traceback.print_exc(file=sys.stderr)
    return f"FAILED ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"


def _reference_main(_index: int, a, out_dir: str) -> None:
    """The one-rank process: the greedy equality references and the one-rank prefills -> reference.pt."""
    device = _device(a, 0)
    cfg = bench_config(a.tiny, a.layers, a.experts, a.vocab_size)
    t0 = time.perf_counter()
    net = seeded_network(cfg, device)
    sync(device)
    print(f"reference: one-rank network ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts, hidden "
          f"{cfg.hidden_size}) on {device}, built in {time.perf_counter() - t0:.1f} s", flush=True)
    ref = {"ep": [greedy_reference(net, *equality_prompts(cfg, r, a), a.eq_steps, device) for r in range(a.ranks)],
           "cp": greedy_reference(net, *cp_equality_prompt(cfg, a), a.eq_steps, device), "prefill": {}}
    for s in a.prefill:
        got = {"roofline_us": prefill_roofline_us(net, s)}
        pools = None
        try:
            pools = cache_pools(cfg, -(-s // 64) + 2, device, fill=False)
            step = prefill_step(cfg, s, -(-s // 64) + 2, random.Random(f"prefill {s}"), device)
            with torch.no_grad():
                got["us"] = _median_us(lambda: net(*step.as_tuple(), *pools), a.iters, a.warmup, device)
        except Exception as e:  # noqa: BLE001 - the row says what failed, the sweep goes on
            got["error"] = _failure(e)
        finally:
            del pools
            if device.type == "cuda":
                torch.cuda.empty_cache()
        ref["prefill"][s] = got
        took = got["error"] if "error" in got else f"{got['us'] / 1e3:.1f} ms"
        print(f"reference: prefill {tokens_label(s)}: {took}", flush=True)
    torch.save(ref, Path(out_dir) / "reference.pt")


class Ranks:
    """This rank's view of the group: the gloo side group for agreeing and gathering (it works
    whatever state the NCCL communicator is in), and rank 0's printing."""

    def __init__(self, rank: int, world: int, timeout: timedelta):
        self.rank, self.world = rank, world
        self.side = dist.new_group(backend="gloo", timeout=timeout)

    def gather(self, obj) -> list:
        every: list = [None] * self.world
        dist.all_gather_object(every, obj, group=self.side)
        return every

    def print(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)


def _rank_main(rank: int, world: int, port: int, a, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    device = _device(a, rank)
    timeout = timedelta(seconds=a.timeout_s)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world, timeout=timeout)
    g = Ranks(rank, world, timeout)
    cfg = bench_config(a.tiny, a.layers, a.experts, a.vocab_size)
    ref = torch.load(Path(out_dir) / "reference.pt", weights_only=False)
    t0 = time.perf_counter()
    net = seeded_network(cfg, device, ParallelConfig(size=world, rank=rank))
    sync(device)
    g.print(f"ranks: {world} x {device.type} ({'NCCL' if device.type == 'cuda' else 'gloo'}), EP={world}: "
            f"{cfg.n_routed_experts // world} routed experts per rank; networks built in "
            f"{time.perf_counter() - t0:.1f} s")
    results = {"equality": equality_table(net, ref, g, a, device),
               "decode": decode_table(net, g, a, device),
               "prefill": prefill_table(net, ref, g, a, device)}
    dist.barrier(group=g.side)
    if rank == 0 and a.json:
        Path(a.json).write_text(json.dumps({"ranks": world, "device": device.type, "config": {
            "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts, "hidden": cfg.hidden_size}, **results},
            indent=1))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ tables
def equality_table(net, ref: dict, g: Ranks, a, device) -> list[dict]:
    p, r = g.world, g.rank
    g.print(f"\n### equality: {p} ranks against one rank on the same steps (the reference's greedy tokens fed to "
            "both; bf16 activations, fp8 caches; expected rel L2 <~1e-3, flips only at margins ~ max |diff|)\n")
    g.print("| network | sequences | steps | logit rows | max abs diff | rel L2 | argmax agree | greedy tokens equal "
            "| smallest top-2 margin where they disagree |")
    g.print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    cp = sharing_network(net, ParallelConfig(size=p, rank=r, context_parallel=True))
    cases = [(f"EP={p}, DP attention", f"{a.eq_batch} per rank x {a.eq_prompt} tokens", net, ref["ep"][r],
              [max(x["steps"][i].input_ids.shape[0] for x in ref["ep"]) for i in range(a.eq_steps + 1)]),
             (f"CP={p} x EP={p}", f"1 x {a.eq_cp_prompt} tokens", cp, ref["cp"],
              [-(-s.input_ids.shape[0] // p) * p for s in ref["cp"]["steps"]])]
    rows = []
    for label, seqs, model, mine, sizes in cases:
        try:
            pools = cache_pools(net.cfg, mine["steps"][0].page_table.max().item() + 1, device, fill=False)
            with torch.no_grad():
                got = [model(*pad_step_tokens(s, n).to(device).as_tuple(), *pools).float().cpu()
                       for s, n in zip(mine["steps"], sizes)]
            m = compare(got, mine)
        except Exception as e:  # noqa: BLE001
            m = {"error": _failure(e)}
        every = g.gather(m)
        bad = next((x["error"] for x in every if "error" in x), None)
        row = {"network": label, "error": bad} if bad else {"network": label, **merge(every)}
        rows.append(row)
        if bad:
            g.print(f"| {label} | {seqs} | {a.eq_steps + 1} | — | {bad} | | | | |")
            continue
        margin = "—" if row["min_margin"] is None else f"{row['min_margin']:.3g}"
        g.print(f"| {label} | {seqs} | prefill + {a.eq_steps} | {row['total']} | {row['max_abs']:.3g} | "
                f"{row['rel_l2']:.2e} | {row['agree']}/{row['total']} | {'yes' if row['agree'] == row['total'] else 'no'}"
                f" | {margin} |")
    return rows


DECODE_COLS = ("B / rank", "mode", "step µs", "MoE layer µs", "of it exchange µs", "exchange %", "compute µs",
               "compute roofline µs", "compute / roofline", "MB to peers / layer", "exchange GB/s",
               "exchange / NVLink roofline", "step µs over ranks")


def decode_table(net, g: Ranks, a, device) -> list[dict]:
    cfg, p = net.cfg, g.world
    moe = [i for i, la in enumerate(net.model.layers) if not la.dense_mlp]
    g.print(f"\n### decode, EP={p} with data-parallel attention, context {tokens_label(a.context)}: per MoE layer "
            f"(mean of {len(moe)}), mean over ranks of each rank's median; exchange = inside the dsa:: collectives "
            f"(eager) / the nccl kernels (graph), waiting for the slowest peer included\n")
    g.print("| " + " | ".join(DECODE_COLS) + " |")
    g.print("|---:|---|" + "---:|" * (len(DECODE_COLS) - 2))
    rows = []
    for b in a.batches:
        pages = b * -(-(a.context + 1) // 64) + 2
        pools = step = None
        modes = {}
        try:
            pools = cache_pools(cfg, pages, device, fill=True)
            step = decode_step(cfg, b, a.context, pages, random.Random(f"decode rank {g.rank} B={b}"), device)
            runs = eager_runs(net, step, pools, a.iters, a.warmup, device, p)
            tot, ex = moe_layer_split([x["layers"] for x in runs], moe)
            modes["eager"] = {"step": statistics.median(x["step"] for x in runs), "layer": tot, "exchange": ex,
                              "sent": statistics.median(x["sent"] for x in runs) / len(moe)}
        except Exception as e:  # noqa: BLE001
            modes["eager"] = {"error": _failure(e)}
        eager_ok = all(g.gather("error" not in modes["eager"]))  # a graph on some ranks only would hang
        if device.type == "cuda" and not a.no_graphs and eager_ok:
            try:
                got = graph_runs(net, step, pools, a.replays, g)
                tot, ex = moe_layer_split(got["layers"], moe)
                eb = exchange_bytes(b, cfg, p, None)  # whole buffers: send + receive of each direction
                modes["graph"] = {"step": got["step"], "layer": tot, "exchange": ex,
                                  "sent": (eb["dispatch"] + eb["combine"]) / 2 * (p - 1) / p}
            except GraphCaptureError as e:  # the row says why; the eager row stands
                modes["graph"] = {"error": f"CAPTURE FAILED ({e})"}
            except Exception as e:  # noqa: BLE001
                modes["graph"] = {"error": f"REPLAY / PROFILE {_failure(e)}"}
        del pools, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
        roof = moe_roofline_us(net, b, a.context, p)
        every = g.gather(modes)
        for mode in modes:
            got = [x[mode] for x in every]
            bad = next((x["error"] for x in got if "error" in x), None)
            row = {"batch": b, "mode": mode}
            if bad:
                row["error"] = bad
                g.print(f"| {b} | {mode} | {bad} |" + " |" * (len(DECODE_COLS) - 3))
            else:
                row.update({k: statistics.mean(x[k] for x in got) for k in ("step", "layer", "exchange", "sent")})
                row.update(compute=row["layer"] - row["exchange"], roofline=roof,
                           step_min=min(x["step"] for x in got), step_max=max(x["step"] for x in got))
                ex, sent = row["exchange"], row["sent"]
                g.print(f"| {b} | {mode} | {row['step']:.1f} | {row['layer']:.1f} | {ex:.1f} | "
                        f"{100 * ex / row['layer']:.0f}% | {row['compute']:.1f} | {roof:.1f} | "
                        f"{row['compute'] / roof:.2f} | {sent / 1e6:.2f} | "
                        f"{sent / ex / 1e3 if ex > 0 else float('nan'):.1f} | "
                        f"{ex / (sent / NVLINK_BPS * 1e6) if sent > 0 else float('nan'):.2f} | "
                        f"{row['step_min']:.0f}-{row['step_max']:.0f} |")
            rows.append(row)
    return rows


def prefill_capacity(tokens: int, cfg: ModelConfig, p: int, factor: float) -> int | None:
    """C of a CP x EP prefill of ``tokens`` (padded) tokens: factor x the mean pairs per destination,
    at most the worst case (None when factor is 0 or reaches it)."""
    local = tokens // p
    worst = local * min(cfg.num_experts_per_tok, cfg.n_routed_experts // p)
    cap = math.ceil(factor * local * cfg.num_experts_per_tok / p)
    return None if factor <= 0 or cap >= worst else cap


PREFILL_COLS = ("S tokens", "p ranks ms", "of it exchange ms", "exchange %", "1 rank ms", "speed-up",
                "1-rank roofline ms", "p ranks / (roofline / p)", "exchange capacity C")


def prefill_table(net, ref: dict, g: Ranks, a, device) -> list[dict]:
    cfg, p, r = net.cfg, g.world, g.rank
    g.print(f"\n### context-parallel prefill: CP={p} x EP={p} against one rank, the same prompt; median of "
            f"{a.iters} after {a.warmup} warm-up; exchange = inside the dsa:: collectives\n")
    g.print("| " + " | ".join(PREFILL_COLS).replace("p ranks", f"{p} ranks") + " |")
    g.print("|" + "---:|" * len(PREFILL_COLS))
    rows = []
    for s in a.prefill:
        n = -(-s // p) * p
        cap = prefill_capacity(n, cfg, p, a.prefill_capacity_factor)
        one = ref["prefill"][s]
        pools = step = None
        try:
            model = sharing_network(net, ParallelConfig(size=p, rank=r, context_parallel=True, ep_capacity=cap))
            pools = cache_pools(cfg, -(-s // 64) + 2, device, fill=False)
            step = pad_step_tokens(prefill_step(cfg, s, -(-s // 64) + 2, random.Random(f"prefill {s}"), device), n)
            runs = eager_runs(model, step, pools, a.iters, a.warmup, device, p)
            mine = {"us": statistics.median(x["step"] for x in runs),
                    "exchange": statistics.median(x["exchange"] for x in runs)}
        except Exception as e:  # noqa: BLE001
            mine = {"error": _failure(e)}
        del pools, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
        every = g.gather(mine)
        bad = next((x["error"] for x in every if "error" in x), None)
        row = {"tokens": s, "one_rank_us": one.get("us"), "one_rank_error": one.get("error"),
               "roofline_us": one["roofline_us"], "capacity": cap}
        one_ms = f"{one['us'] / 1e3:.1f}" if "us" in one else one["error"]
        roof = f"{one['roofline_us'] / 1e3:.1f}"
        cap_s = "worst case" if cap is None else str(cap)
        if bad:
            row["error"] = bad
            g.print(f"| {tokens_label(s)} | {bad} | | | {one_ms} | — | {roof} | — | {cap_s} |")
        else:
            row.update(us=max(x["us"] for x in every), exchange_us=statistics.mean(x["exchange"] for x in every))
            speed = f"{one['us'] / row['us']:.2f}" if "us" in one else "—"
            g.print(f"| {tokens_label(s)} | {row['us'] / 1e3:.1f} | {row['exchange_us'] / 1e3:.1f} | "
                    f"{100 * row['exchange_us'] / row['us']:.0f}% | {one_ms} | {speed} | {roof} | "
                    f"{row['us'] / (one['roofline_us'] / p):.2f} | {cap_s} |")
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=torch.cuda.device_count() if torch.cuda.is_available() else 2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny model's widths (the CPU; default there)")
    ap.add_argument("--layers", type=int, default=None, help="default 4 (tiny 3); layer 0 dense")
    ap.add_argument("--experts", type=int, default=None, help="default 256 (tiny 8)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default 129280 (tiny 512)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="decode sequences per rank (default 32 128; tiny 2 4)")
    ap.add_argument("--context", type=int, default=None, help="cached tokens per decode sequence (default 32768; tiny 512)")
    ap.add_argument("--prefill", type=int, nargs="*", default=None,
                    help="prefill tokens (default 32768 131072; tiny 256 1024; none: skip)")
    ap.add_argument("--prefill-capacity-factor", type=float, default=2.0,
                    help="CP x EP prefill exchange capacity: this x the mean pairs per destination (0: worst case)")
    ap.add_argument("--iters", type=int, default=5, help="timed eager forwards per shape (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--replays", type=int, default=50, help="timed CUDA-graph replays per decode shape (median)")
    ap.add_argument("--no-graphs", action="store_true", help="decode eager only")
    ap.add_argument("--eq-batch", type=int, default=4, help="equality: sequences per rank")
    ap.add_argument("--eq-prompt", type=int, default=None, help="equality: prompt tokens (default index_topk + 256)")
    ap.add_argument("--eq-cp-prompt", type=int, default=None,
                    help="equality: the CP prompt's tokens (default 2 index_topk + 1: padded, the indexer selects)")
    ap.add_argument("--eq-steps", type=int, default=8, help="equality: greedy decode steps after the prefill")
    ap.add_argument("--timeout-s", type=int, default=int(os.environ.get("DSA_DIST_TIMEOUT_S") or DEFAULT_TIMEOUT_S),
                    help=f"collective timeout (DSA_DIST_TIMEOUT_S; default {DEFAULT_TIMEOUT_S})")
    ap.add_argument("--json", default=None, help="also write the tables' numbers to this file")
    a = ap.parse_args(argv)
    a.tiny = a.tiny or a.device == "cpu"
    a.layers = a.layers or (3 if a.tiny else 4)
    a.experts = a.experts or (8 if a.tiny else 256)
    # the tiny widths run on 2 CPU cores: the plain-torch indexer of a 32K prefill would need 256 GB
    a.batches = a.batches or ([2, 4] if a.tiny else [32, 128])
    a.context = a.context or (512 if a.tiny else 32768)
    a.prefill = a.prefill if a.prefill is not None else ([256, 1024] if a.tiny else [32768, 131072])
    if a.ranks < 2:
        ap.error("--ranks must be >= 2 (the one-rank network is the reference)")
    if a.experts % a.ranks:
        ap.error(f"--ranks {a.ranks} must divide --experts {a.experts} (expert parallelism)")
    if a.device == "cuda" and torch.cuda.device_count() < a.ranks:
        ap.error(f"--ranks {a.ranks}: only {torch.cuda.device_count()} GPUs visible")
    topk = bench_config(a.tiny, a.layers, a.experts, a.vocab_size).index_topk
    a.eq_prompt = a.eq_prompt or topk + 256
    a.eq_cp_prompt = a.eq_cp_prompt or 2 * topk + 1
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.update(launch_env())  # the ranks inherit it: NVLink multicast off, NCCL errors tear down
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_parallel.") as out_dir:
        mp.spawn(_reference_main, args=(a, out_dir), nprocs=1, join=True)
        mp.spawn(_rank_main, args=(a.ranks, _free_port(), a, out_dir), nprocs=a.ranks, join=True)
    print(f"\nbench_parallel: {a.ranks} ranks on {a.device}, {time.perf_counter() - t0:.0f} s in all", flush=True)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
