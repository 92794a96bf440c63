"""Per-layer time of a real-dims V3.2 slice against its roofline, and a modelled 8xH200 decode (issue 25 item 7).

    python benchmarks/bench_realdims.py [--checkpoint DIR] [--layers 4] [--experts 256] [--quick] [--no-graphs]
        [--compile] [--top-kernels N] [--mtp [N ...]] [--mtp-acceptance A [A ...]]

The network: DSAForCausalLM with V3.2's real per-layer dims (export/real_dims.py), bf16 activations,
fp8 caches, every e4m3 Linear kept W8A8 (weight_format="fp8") and the routed experts as one
dsa::moe_experts call (expert_op). ``--checkpoint`` loads a generated real-dims checkpoint with
build_network (``python -m dsa_trt.export.tiny_checkpoint OUT --preset v32-real-dims --layers 4
--experts 256``); without it the same modules get random weights on the device (e4m3 values with
power-of-two block scales, std ~0.02 like the generator), which skips writing ~37 GB to disk: the
timings depend on shapes, not on weight values (the router's random weights spread the tokens
over the experts about evenly, as the generator's do). The caches are filled with random finite
e4m3 bytes (synthetic context), pages scattered.

Eager timing (every shape): eager forwards, the stream cut at every region boundary (CUDA events;
on the CPU the wall clock after each synchronous op): DSA attention, in two columns =
indexer_k_cache_write + indexer_logits + topk_translate | mla_cache_write + sparse_mla; linears =
every Fp8Linear / nn.Linear call (the shared expert's too); MoE = router + dsa::moe_experts; rest =
everything else in the layer (norms, RoPE, Hadamard, the absorbed einsums, quantisation, residuals)
and the launch gaps of the eager stream. Median of the timed forwards, per layer kind (layer 0
dense; the MoE layers averaged). The decode rows are host bound this way (launch gaps in "rest").

CUDA-graph timing (decode shapes, as the runtime serves them; skipped with ``--no-graphs`` and off
CUDA), a second sweep after the eager one: per decode shape, a step and pools built as for its eager
rows (fresh random tokens, pages and context), the network's whole forward of that step warmed up
twice on a side stream and captured into one torch.cuda.CUDAGraph, as runtime/cuda_graphs.py's
_Graph does. "graph µs/step": median of ``--replays`` replays, CUDA events around each. "eager
µs/step": median of as many eager forwards of the shape without the region hooks, CUDA events around
each, timed in the eager sweep (before any profiler session). The per-layer, per-region split inside
the graph comes from torch.profiler (CPU + CUDA activities) over one eager forward and then
PROFILED_REPLAYS replays, each replay alone on the GPU (synchronised before and after):
- In the eager forward every GPU activity (kernel, memcpy, memset) gets the (layer, region) of the
  innermost profiler range open when its launch ran (linked by correlation id); the ranges are the
  eager table's cuts (the same hooks), so the columns mean what they mean there.
- A replay runs the captured launches in capture order on one stream, so its k-th activity (by
  start time) is the eager forward's k-th: the two name sequences are aligned with difflib
  (autojunk off); an activity with no same-name partner takes the tag of the activity before it,
  and the shape's line says how many did.
- Each activity is charged from the previous activity's end (the first: its own start) to its own
  end: the charges tile the replay's span exactly, each gap between graph nodes going to the node
  after it. "rest" is then the graph's norms, RoPE, quantisation... and its node gaps.
- Per layer kind: median over the replays of the mean over the layers of that kind. "of it outside
  the layers": the charges outside any layer (embedding, final norm, the fp32 lm_head), median.
The split's replays run under CUPTI, the step column without it; the shape's line prints both. The
graph rows' experts touched (and their roofline's routed bytes) are the tagged eager forward's: the
graph's own step. A shape whose capture, replay or split fails says so in its graph row (with what
was measured) and the sweep goes on.

Roofline per layer: max(bytes / 4.2 TB/s, fp8 FLOPs / 1377 TFLOP/s + bf16 FLOPs / 758 TFLOP/s),
bytes = weights touched (every weight of the layer but the routed experts, plus the routed
experts the router picked in that forward) + cache bytes read (decode: each sequence's indexer
keys, 132 B x context, and its top-k MLA rows, 576 B x min(context, 2048); prefill: each pool row
once); FLOPs = linears 2 x tokens x weights (fp8; the routed ones x top-k), indexer logits 2 x 64
heads x 128 x keys per query (fp8), sparse MLA 2 x 128 heads x (576 + 512) x selected keys and the
absorbed einsums (bf16).

The modelled 61-layer decode on 8 H200s (TP8 + EP8, attention-DP + EP8, and the latter with MTP) is
benchmarks/realdims_model.py: arithmetic over the per-layer numbers measured here.
"""

from __future__ import annotations

import argparse
import bisect
import difflib
import json
import random
import statistics
import sys
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from dsa_trt.config import ModelConfig
from dsa_trt.export.layers import Fp8Linear, Router, StackedExperts, hadamard_buffers
from dsa_trt.export.network import DSAForCausalLM
from dsa_trt.plugins.pools import allocate_pools
from dsa_trt.step import StepInputs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # realdims_model, timing beside this file
from realdims_model import REAL_CONFIG, WORLD, model_8gpu, model_8gpu_dp, tokens_label  # noqa: E402
from timing import layer_hooks, patched_ops, timed_op  # noqa: E402

HBM_BPS = 4.2e12
FP8_FLOPS, BF16_FLOPS = 1377e12, 758e12
INDEXER_OPS = ("indexer_k_cache_write", "indexer_logits", "topk_translate")
MLA_OPS = ("mla_cache_write", "sparse_mla")
CATEGORIES = ("DSA indexer + top-k", "DSA sparse MLA", "linears", "MoE", "rest")
OUTSIDE = (None, "outside")  # (layer, region) of what runs outside every layer
PROFILED_REPLAYS = 3  # graph replays under the profiler per shape (the split is their median)
GRAPH_WARMUPS = 2  # eager forwards on a side stream before capture (runtime/cuda_graphs.py _Graph)
EAGER_RANGE, REPLAY_RANGE, TAG = "bench:eager", "bench:replay", "bench:region:"  # profiler range names


# ------------------------------------------------------------------------------------------ network
def real_config(layers: int, experts: int, vocab: int) -> ModelConfig:
    """V3.2's config.json (tests/data, spec/MODEL.md §1.1) with the preset's overrides: the layer
    count (layer 0 dense), the expert count and its router groups, the vocabulary. Read from the
    file rather than through transformers, whose version on a GPU machine may predate V3.2."""
    from dsa_trt.export.real_dims import router_groups

    d = json.loads(REAL_CONFIG.read_text())
    top_k = min(d["num_experts_per_tok"], experts)
    n_group, topk_group = router_groups(experts, top_k)
    d.update(num_hidden_layers=layers, first_k_dense_replace=min(1, layers), n_routed_experts=experts,
             num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, vocab_size=vocab,
             num_nextn_predict_layers=0)
    return ModelConfig.from_hf_dict(d)


def random_network(cfg: ModelConfig, device: str) -> DSAForCausalLM:
    """The real-dims network with random weights made on the device (see the module docstring)."""
    with torch.device("meta"):
        net = DSAForCausalLM(cfg, cache_mode="fp8", dtype=torch.bfloat16, expert_op=True, weight_format="fp8")
    gen = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, p in net.state_dict().items():
        if p.dtype == torch.float8_e4m3fn:  # values ~N(0, 64) in e4m3, scale 2^-12: std ~0.016
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            for part in (t if t.dim() == 3 else [t]):  # one expert at a time: no 30 GB fp32 temporary
                part.copy_((torch.randn(part.shape, generator=gen, device=device) * 64).clamp_(-448, 448))
        elif name.endswith(("scale_inv", "_scale")):
            t = torch.full(p.shape, 2.0 ** -12, device=device)  # power of two, ~0.02 / 64 (ue8m0 scales)
        elif name.endswith("layernorm.weight") or name.endswith("norm.weight") or name.endswith("k_norm.weight"):
            t = torch.ones(p.shape, dtype=p.dtype, device=device)
        elif name.endswith("bias"):
            t = torch.zeros(p.shape, dtype=p.dtype, device=device)
        else:
            t = (torch.randn(p.shape, generator=gen, device=device) * 0.02).to(p.dtype)
        state[name] = t
    net.load_state_dict(state, strict=True, assign=True)
    net.inv_freq = cfg.rope_inv_freq().to(device)
    for layer in net.model.layers:
        for name, t in hadamard_buffers(cfg.index_head_dim).items():
            setattr(layer.self_attn.indexer, name, t.to(device))
    left = [name for name, t in list(net.named_parameters()) + list(net.named_buffers()) if t.is_meta]
    if left:  # a meta tensor would turn its op's output meta and skip the kernels it feeds
        raise RuntimeError(f"random_network: {', '.join(left[:4])} still on the meta device")
    return net.eval()


def checkpoint_network(path: str, device: str) -> DSAForCausalLM:
    from dsa_trt.export.checkpoint import Checkpoint
    from dsa_trt.export.program import build_network

    return build_network(Checkpoint(path), "fp8", torch.bfloat16, device=device, expert_op=True, weight_format="fp8")


# ------------------------------------------------------------------------------------------ timing
class RegionClock:
    """Cuts the stream at every region boundary; the time between two cuts goes to the region
    open in between. CUDA: events (read after a synchronise); CPU: wall clock (ops are synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []  # (event or time, (layer, category) open from here on)
        self.stack: list[tuple[int | None, str]] = [(None, "outside")]
        self.layer: int | None = None

    def _mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
        else:
            e = time.perf_counter()
        self.marks.append((e, self.stack[-1]))

    def push(self, category: str | None = None, layer: int | None = None) -> None:
        if layer is not None:
            self.layer = layer
        self.stack.append((self.layer, category or self.stack[-1][1] if layer is None else "rest"))
        self._mark()

    def pop(self, end_layer: bool = False) -> None:
        self.stack.pop()
        if end_layer:
            self.layer = None
        self._mark()

    def totals_us(self) -> dict[tuple[int | None, str], float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict = defaultdict(float)
        for (a, where), (b, _) in zip(self.marks, self.marks[1:]):
            out[where] += (a.elapsed_time(b) * 1e3) if self.cuda else (b - a) * 1e6
        return out


@contextmanager
def regions(net: DSAForCausalLM, clock: RegionClock, touched: list):
    """Hooks on the layers, the linears, the MoE, and the dsa ops of the DSA path (restored after)."""
    def scoped(module, **kw):
        handles.append(module.register_forward_pre_hook(lambda m, a: clock.push(**kw)))
        handles.append(module.register_forward_hook(lambda m, a, o: clock.pop(end_layer="layer" in kw)))

    def category(op):
        return CATEGORIES[0] if op in INDEXER_OPS else CATEGORIES[1]

    with layer_hooks(net, clock) as handles, \
            patched_ops(INDEXER_OPS + MLA_OPS, lambda op, packet: timed_op(clock, category(op), packet)):
        for m in net.modules():
            if isinstance(m, (Fp8Linear, torch.nn.Linear)):
                scoped(m, category="linears")
            elif isinstance(m, StackedExperts):
                scoped(m, category="MoE")
            elif isinstance(m, Router):
                orig = m.select

                def select(x, _orig=orig):
                    clock.push(category="MoE")
                    idx, w = _orig(x)
                    touched.append(idx)  # counted after the forward: unique() here would sync the stream
                    clock.pop()
                    return idx, w

                m.select = select
        try:
            yield
        finally:
            for m in net.modules():
                if isinstance(m, Router) and "select" in vars(m):
                    del m.select


class RangeTagger(RegionClock):
    """RegionClock's cuts as profiler ranges: every region it would time is a record_function range
    named TAG + "<layer>:<region>", open while the region is (nested like the regions)."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.open: list = []

    def _mark(self) -> None:
        pass

    def push(self, category: str | None = None, layer: int | None = None) -> None:
        super().push(category, layer)
        where, region = self.stack[-1]
        rf = record_function(f"{TAG}{where}:{region}")
        rf.__enter__()
        self.open.append(rf)

    def pop(self, end_layer: bool = False) -> None:
        super().pop(end_layer)
        self.open.pop().__exit__(None, None, None)


def per_kind_medians(net, runs: list[dict]) -> dict[str, dict[str, float]]:
    """runs: one {(layer, region): µs} per forward -> per layer kind and region: the median over the
    forwards of the mean over the layers of that kind (layer 0 dense, the MoE layers)."""
    dense = [i for i, layer in enumerate(net.model.layers) if layer.dense_mlp]
    moe = [i for i, layer in enumerate(net.model.layers) if not layer.dense_mlp]
    return {kind: {c: statistics.median(sum(r.get((i, c), 0.0) for i in ids) / len(ids) for r in runs)
                   for c in CATEGORIES}
            for kind, ids in (("dense", dense), ("MoE", moe)) if ids}


def per_kind_kernels(net, runs: list[dict]) -> dict[tuple[str, str], list[tuple[str, float]]]:
    """runs: one {(layer, region, kernel): µs} per replay -> {(layer kind, region): [(kernel, µs per
    layer of the kind: median over the replays)] longest first}."""
    kinds = {i: "dense" if layer.dense_mlp else "MoE" for i, layer in enumerate(net.model.layers)}
    count = defaultdict(int)
    for k in kinds.values():
        count[k] += 1
    per: dict = defaultdict(lambda: defaultdict(list))
    for r in runs:
        acc: dict = defaultdict(float)
        for (layer, region, name), us in r.items():
            if layer in kinds:
                acc[(kinds[layer], region, name)] += us / count[kinds[layer]]
        for (kind, region, name), us in acc.items():
            per[(kind, region)][name].append(us)
    return {key: sorted(((n, statistics.median(v + [0.0] * (len(runs) - len(v)))) for n, v in names.items()),
                        key=lambda r: -r[1])
            for key, names in per.items()}


def print_top_kernels(label: str, got: dict, top: int) -> None:
    """The `top` longest kernels of every (layer kind, region) of one graph shape, µs per layer."""
    for (kind, region), rows in sorted(got.get("kernels", {}).items()):
        shown = rows[:top]
        rest = sum(us for _, us in rows[top:])
        print(f"  {label} | {kind} | {region}: " + "; ".join(f"{n[:70]} {us:.1f}" for n, us in shown)
              + (f"; {len(rows) - top} more {rest:.1f}" if rows[top:] else ""), flush=True)


def timed_forward(net, step, pools, iters: int, warmup: int = 1) -> tuple[dict, float, float]:
    """-> (per layer kind and category: median µs, median routed experts touched per MoE layer, whole forward µs)."""
    runs, touched, walls = [], [], []
    with torch.no_grad():
        for _ in range(warmup):  # kernel attributes, allocator
            net(*step.as_tuple(), *pools)
        for _ in range(iters):
            clock = RegionClock(step.input_ids.device)
            got = []
            with regions(net, clock, got):
                clock.push(category="outside")
                net(*step.as_tuple(), *pools)
                clock.pop()
            totals = clock.totals_us()
            runs.append(totals)
            walls.append(sum(totals.values()))
            touched.extend(idx.unique().numel() for idx in got)
    return per_kind_medians(net, runs), statistics.median(touched) if touched else 0, statistics.median(walls)


def median_step_us(run, iters: int) -> float:
    """Median µs of ``run()`` on the current CUDA stream, CUDA events around each call."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in pairs:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in pairs)


def eager_step_us(net, step, pools, iters: int) -> float:
    """Whole eager forwards without the region hooks (the graph rows' "eager µs/step")."""
    with torch.no_grad():
        return median_step_us(lambda: net(*step.as_tuple(), *pools), iters)


# ------------------------------------------------------------------------------------------ CUDA graphs
class GraphSplitError(RuntimeError):
    """The profiler's record of the replays cannot be split by layer (the reason in the message)."""


def capture_step(net, step, pools) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The whole forward of ``step`` captured into one graph (outputs: the graph's logits buffer).
    net: the network, or its torch.compile'd forward (--compile)."""
    args = (*step.as_tuple(), *pools)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            for _ in range(GRAPH_WARMUPS):  # lazy init, workspaces, allocations outside the graph
                net(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = net(*args)
    return graph, out


def profiled_replays(net, step, pools, graph, replays: int) -> tuple[list, list, list[int]]:
    """One tagged eager forward and ``replays`` lone replays under torch.profiler ->
    (CPU events, GPU activities, routed experts touched per MoE layer), events as
    (name, start ns, end ns, correlation id)."""
    tagger, got = RangeTagger(), []
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.no_grad(), profile(activities=acts) as prof:
        with regions(net, tagger, got), record_function(EAGER_RANGE):
            net(*step.as_tuple(), *pools)
        torch.cuda.synchronize()
        for _ in range(replays):
            with record_function(REPLAY_RANGE):
                graph.replay()
            torch.cuda.synchronize()  # replays apart: each one's activities lie between its range and the next
    cpu, gpu = [], []
    for e in prof.profiler.kineto_results.events():
        row = (e.name(), e.start_ns(), e.end_ns(), getattr(e, "correlation_id", lambda: 0)())  # absent: no split
        if e.device_type() == DeviceType.CPU:
            cpu.append(row)
        elif e.device_type() == DeviceType.CUDA and not e.name().startswith("bench:"):  # not our ranges' GPU mirror
            gpu.append(row)
    return cpu, gpu, [idx.unique().numel() for idx in got]


def _tag(name: str) -> tuple[int | None, str]:
    layer, region = name[len(TAG):].split(":", 1)
    return (None if layer == "None" else int(layer)), region


def split_replays(cpu: list, gpu: list, kernels: list | None = None,
                  unmatched_rest: bool = False) -> tuple[list[dict], int, int]:
    """Events of profiled_replays -> ([{(layer, region): µs} per replay], the fewest activities of a
    replay matched by name to the eager forward's, the most activities of a replay) (method: module
    docstring). kernels: gets one {(layer, region, activity name): µs} per replay, the same split.
    unmatched_rest: an activity without a same-name partner goes to the layer of the activity
    before it but to "rest" (the compiled graph: Inductor's fused kernels are the norms, RoPE,
    quantisation... that eager runs as separate kernels)."""
    eager = next(((s, f) for n, s, f, _ in cpu if n == EAGER_RANGE), None)
    starts = sorted(s for n, s, _, _ in cpu if n == REPLAY_RANGE)
    if eager is None or not starts:
        raise GraphSplitError("the profiler recorded no eager forward or no replay range")
    tags = [(s, f, _tag(n)) for n, s, f, _ in cpu if n.startswith(TAG)]
    # CUDA runtime calls (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync...) of the eager forward
    launch = {c: s for n, s, _, c in cpu if c and n.startswith("cu") and eager[0] <= s <= eager[1]}

    def tag_at(t: int) -> tuple[int | None, str]:
        inside = [(s, f, w) for s, f, w in tags if s <= t <= f]
        return max(inside, key=lambda r: (r[0], -r[1]))[2] if inside else OUTSIDE

    ref = sorted(((s, n, tag_at(launch[c])) for n, s, _, c in gpu if c in launch), key=lambda r: r[0])
    if not ref:
        raise GraphSplitError("no GPU activity correlated with the eager forward's launches")
    ref_names, ref_tags = [n for _, n, _ in ref], [w for _, _, w in ref]
    per_replay: list[list] = [[] for _ in starts]
    for n, s, f, c in gpu:
        if c not in launch and s >= starts[0]:
            per_replay[bisect.bisect_right(starts, s) - 1].append((s, f, n))
    runs, matched, most = [], len(ref), 0
    for r, acts in enumerate(per_replay):
        if not acts:
            raise GraphSplitError(f"replay {r} has no GPU activity in the profile (graph kernels not traced)")
        acts.sort()
        names = [n for _, _, n in acts]
        src: list[int | None] = list(range(len(ref))) if names == ref_names else [None] * len(names)
        if names != ref_names:
            sm = difflib.SequenceMatcher(None, ref_names, names, autojunk=False)
            for op, i1, i2, j1, j2 in sm.get_opcodes():
                if op == "equal":
                    src[j1:j2] = range(i1, i2)
        matched, most = min(matched, sum(i is not None for i in src)), max(most, len(acts))
        first = next((i for i in src if i is not None), 0)
        totals: dict = defaultdict(float)
        by_name: dict = defaultdict(float)
        cursor, last = acts[0][0], first
        for (s, f, n), i in zip(acts, src):
            last = last if i is None else i  # no same-name partner: the tag of the activity before
            where = ref_tags[last]
            if i is None and unmatched_rest and where != OUTSIDE:
                where = (where[0], "rest")
            totals[where] += max(0, f - cursor) / 1e3
            by_name[(*where, n)] += max(0, f - cursor) / 1e3
            cursor = max(cursor, f)
        runs.append(totals)
        if kernels is not None:
            kernels.append(by_name)
    return runs, matched, most


def graph_shape(net, build, pages_needed, replays: int, device, compiled=None) -> dict:
    """One decode shape under CUDA graphs -> {"step_us", "per_kind", "outside", "touched", "split_us",
    "matched", "activities"}; a failure: {"error": "OOM" | "SPLIT UNAVAILABLE" | "<stage> FAILED",
    "why": ...} (with "step_us" where it was measured). compiled: the forward to capture instead of
    the eager network's (the tagged reference forward stays eager)."""
    cfg, got, pools, graph, out = net.cfg, {}, None, None, None
    stage = "setup"
    try:
        pools = allocate_pools(cfg, "fp8", pages_needed + 2, device=device)
        for p in pools[0] + pools[1]:
            p.random_(0, 120)
        step = build(pages_needed + 2)
        stage = "CAPTURE"
        graph, out = capture_step(compiled if compiled is not None else net, step, pools)
        stage = "REPLAY"
        graph.replay()  # first replay (uploads the graph) untimed
        got["step_us"] = median_step_us(graph.replay, replays)
        stage = "PROFILE"
        cpu, gpu, touched = profiled_replays(net, step, pools, graph, PROFILED_REPLAYS)
        kernels: list = []
        runs, matched, activities = split_replays(cpu, gpu, kernels, unmatched_rest=compiled is not None)
        got.update(kernels=per_kind_kernels(net, kernels), per_kind=per_kind_medians(net, runs),
                   outside=statistics.median(r[OUTSIDE] for r in runs),
                   split_us=statistics.median(sum(r.values()) for r in runs), matched=matched,
                   activities=activities, touched=statistics.median(touched) if touched else 0)
    except torch.OutOfMemoryError as e:
        got.update(error="OOM", why=f"{stage}: {str(e).splitlines()[0][:120]}")
    except GraphSplitError as e:
        got.update(error="SPLIT UNAVAILABLE", why=str(e))
    except Exception as e:  # noqa: BLE001 - e.g. an op that syncs while the stream is captured: the row says which
        traceback.print_exc(file=sys.stderr)  # the row keeps one line; the whole story goes to stderr
        got.update(error=f"{stage} FAILED", why=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    finally:
        del graph, out, pools
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:  # a sticky error: every later shape will say so in its row too
            got.setdefault("error", "CUDA ERROR")
            got.setdefault("why", f"after the shape: {str(e).splitlines()[0][:160]}")
        torch.cuda.empty_cache()
    return got


# ------------------------------------------------------------------------------------------ roofline
def layer_roofline(net, kind: str, tokens: int, seqs: list[tuple[int, int]],
                   experts_touched: float) -> tuple[float, float, float]:
    """-> (bytes, fp8 FLOPs, bf16 FLOPs) of one layer of that kind. seqs: (query tokens, context) per sequence."""
    cfg = net.cfg
    layer = next(la for la in net.model.layers if la.dense_mlp == (kind == "dense"))
    weight_bytes, fp8_w, routed_bytes, routed_w = 0, 0, 0, 0
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        if t.device.type == "meta" or name.endswith("hadamard"):
            continue
        nbytes = t.numel() * t.element_size()
        if ".stacked_experts." in name:
            routed_bytes += nbytes
            routed_w += t.numel() if t.dtype == torch.float8_e4m3fn else 0
        else:
            weight_bytes += nbytes
            fp8_w += t.numel() if t.dtype == torch.float8_e4m3fn else 0
    e = cfg.n_routed_experts
    weight_bytes += routed_bytes * min(experts_touched, e) / e if kind == "MoE" else 0
    topk, h = cfg.index_topk, cfg.num_attention_heads
    # each sequence's indexer keys once; its queries' top-k MLA rows, at most every row once
    # (decode / verify: ctx = the sequence's length after its q new tokens; prefill: every row)
    cache = sum(ctx * 132 + min(q * min(ctx, topk), ctx) * 576 for q, ctx in seqs)
    # keys each query token sees: decode the context; a prefill chunk causal 1..ctx
    keys = sum(ctx if q == 1 else q * (2 * ctx - q + 1) / 2 for q, ctx in seqs)
    selected = sum(min(ctx, topk) if q == 1 else sum(min(ctx - q + j + 1, topk) for j in range(q)) for q, ctx in seqs)
    fp8 = 2 * tokens * fp8_w + 2 * cfg.index_n_heads * cfg.index_head_dim * keys
    if kind == "MoE":
        fp8 += 2 * tokens * cfg.num_experts_per_tok * routed_w / e
    absorbed = 2 * tokens * h * cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # the two einsums
    bf16 = 2 * h * (576 + 512) * selected + absorbed + 2 * tokens * cfg.hidden_size * cfg.index_n_heads
    return weight_bytes + cache, fp8, bf16




def roofline_us(bytes_, fp8, bf16) -> float:
    return max(bytes_ / HBM_BPS, fp8 / FP8_FLOPS + bf16 / BF16_FLOPS) * 1e6


# ------------------------------------------------------------------------------------------ shapes
def decode_step(cfg, batch: int, context: int, num_pages: int, rng: random.Random, device,
                query: int = 1) -> StepInputs:
    """``batch`` sequences of ``context`` cached tokens, each with ``query`` new tokens (1: decode; N + 1:
    the verify step of N MTP drafts)."""
    ppd = -(-(context + query) // 64)
    pages = rng.sample(range(num_pages), batch * ppd)
    return StepInputs.build([([rng.randrange(2, cfg.vocab_size) for _ in range(query)], context,
                              pages[i * ppd:(i + 1) * ppd]) for i in range(batch)], device=device)


def prefill_step(cfg, tokens: int, num_pages: int, rng: random.Random, device) -> StepInputs:
    pages = rng.sample(range(num_pages), -(-tokens // 64))
    return StepInputs.build([([rng.randrange(2, cfg.vocab_size) for _ in range(tokens)], 0, pages)], device=device)


def print_row(label, kind, cats, total, roof, b, fl, touched, extra: tuple[str, ...] = ()) -> None:
    print(f"| {label} | {kind} | " + " | ".join(f"{cats[c]:.1f}" for c in CATEGORIES) +
          f" | {total:.1f} | {roof:.1f} | {total / roof:.2f} | {b / 1e6:,.1f} | {fl / 1e9:,.1f} | "
          f"{b / total / 1e6:.2f} | {fl / total / 1e6:.1f} | {touched if kind == 'MoE' else '—'} |" +
          "".join(f" {x} |" for x in extra), flush=True)


def print_failed(label, what, why, extra: tuple[str, ...] = ()) -> None:
    """A row that did not run: its label, what failed, empty cells, then ``extra`` and the reason."""
    print(f"| {label} | — | {what} |" + " |" * (len(CATEGORIES) + 7) + "".join(f" {x} |" for x in extra) +
          f" ({why})", flush=True)


def table_header(extra: tuple[str, ...] = ()) -> None:
    cols = ("shape", "layer", *CATEGORIES, "layer total", "roofline", "total / roofline", "MB touched", "GFLOP",
            "TB/s", "TFLOP/s", "experts touched", *extra)
    print("| " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * (len(cols) - 2), flush=True)


def run_shape(net, label, build, pages_needed, seqs, tokens, iters, device, warmup=1, step_iters=0):
    """The eager rows of one shape -> (per layer kind, experts touched, eager µs/step or None), or
    None when it did not run; ``step_iters``: also time that many whole forwards without the hooks."""
    cfg = net.cfg
    pools, step_us = None, None
    try:
        pools = allocate_pools(cfg, "fp8", pages_needed + 2, device=device)
        for p in pools[0] + pools[1]:
            p.random_(0, 120)  # finite e4m3 bytes: synthetic context
        step = build(pages_needed + 2)
        per_kind, touched, wall = timed_forward(net, step, pools, iters, warmup)
        if step_iters:  # before any profiler session of the graph sweep: CUPTI never saw these launches
            step_us = eager_step_us(net, step, pools, step_iters)
    except torch.OutOfMemoryError as e:
        print_failed(label, "OOM", str(e).splitlines()[0][:120])
        return None
    except RuntimeError as e:  # e.g. a kernel refusing a shape: the other shapes still run
        print_failed(label, "UNSUPPORTED", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return None
    finally:
        del pools
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for kind, cats in per_kind.items():
        b, f8, bf = layer_roofline(net, kind, tokens, seqs, touched)
        print_row(label, kind, cats, sum(cats.values()), roofline_us(b, f8, bf), b, f8 + bf, touched)
    print(f"  {label}: forward {wall:.0f} µs", file=sys.stderr, flush=True)
    return per_kind, touched, step_us


GRAPH_COLUMNS = ("graph µs/step", "of it outside the layers", "eager µs/step")


def print_graph_rows(net, label, got: dict, eager_us: float | None, seqs, tokens) -> None:
    step = f"{got['step_us']:.1f}" if "step_us" in got else "—"
    eager = f"{eager_us:.1f}" if eager_us is not None else "—"
    if "error" in got:
        print_failed(label, got["error"], got["why"], (step, "—", eager))
        return
    for kind, cats in got["per_kind"].items():
        b, f8, bf = layer_roofline(net, kind, tokens, seqs, got["touched"])
        print_row(label, kind, cats, sum(cats.values()), roofline_us(b, f8, bf), b, f8 + bf, got["touched"],
                  (step, f"{got['outside']:.1f}", eager))
    line = (f"  {label}: graph {got['step_us']:.0f} µs/step; profiled replay span {got['split_us']:.0f} µs = "
            f"layers + {got['outside']:.0f} outside; {got['matched']} of {got['activities']} GPU activities per "
            "replay matched by name to the eager forward's")
    if got["matched"] < got["activities"]:  # the tags of the unmatched ones are borrowed: say so on stdout
        print(line.strip(), flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="a real-dims checkpoint (default: random weights on the device)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=129280)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384, 65536], help="prefill tokens (none: skip)")
    ap.add_argument("--iters", type=int, default=5, help="timed forwards per shape (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed forwards per shape first (default 1)")
    ap.add_argument("--replays", type=int, default=50,
                    help="timed CUDA-graph replays and hook-free eager forwards per decode shape (median; default 50)")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph decode rows (eager only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="3 timed forwards per shape, 20 graph replays")
    ap.add_argument("--compile", action="store_true",
                    help="capture the graph rows from torch.compile's Inductor forward, as the engine's AOTInductor "
                         "program fuses it (the eager rows stay eager)")
    ap.add_argument("--mtp", type=int, nargs="*", default=None, metavar="N",
                    help="also measure each decode shape as the verify step of N MTP drafts (N + 1 query tokens per "
                         "sequence; --mtp alone: N = 1; several N: one verify sweep and one model each) and model "
                         "the attention-DP + EP8 decode with N drafts per sequence")
    ap.add_argument("--mtp-acceptance", type=float, nargs="+", default=[0.85, 0.63], metavar="A",
                    help="the conditional acceptance of draft 1, 2, ... the MTP model assumes, the last repeating "
                         "(default 0.85 0.63: DeepSeek reports 85-90%% for the first draft; realdims_model.py says "
                         "where 0.63 comes from)")
    ap.add_argument("--top-kernels", type=int, default=0, metavar="N",
                    help="after the CUDA-graph rows: the N longest kernels of every layer kind and region, "
                         "µs per layer")
    a = ap.parse_args(argv)
    drafts = sorted(set(a.mtp or [1])) if a.mtp is not None else []
    if any(n < 1 or n > 8 for n in drafts):
        ap.error(f"--mtp {' '.join(map(str, a.mtp))}: each N must be in 1..8 (the runtime's mtp:N range)")
    if any(not 0.0 < x <= 1.0 for x in a.mtp_acceptance):
        ap.error(f"--mtp-acceptance {' '.join(map(str, a.mtp_acceptance))}: each value must be in (0, 1]")
    iters = 3 if a.quick else a.iters
    replays = 20 if a.quick else a.replays
    device = torch.device(a.device)
    graphs = not a.no_graphs and device.type == "cuda"
    if device.type == "cuda":
        from dsa_trt.plugins import cuda_ops

        cuda_ops.load("cuda")
    t0 = time.perf_counter()
    net = checkpoint_network(a.checkpoint, a.device) if a.checkpoint else \
        random_network(real_config(a.layers, a.experts, a.vocab_size), a.device)
    cfg = net.cfg
    print(f"network: {cfg.num_hidden_layers} layers ({sum(la.dense_mlp for la in net.model.layers)} dense), "
          f"{cfg.n_routed_experts} experts, hidden {cfg.hidden_size}, "
          f"{'checkpoint ' + a.checkpoint if a.checkpoint else 'random weights'}, "
          f"{a.device}; built in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    print(f"\nper layer, µs (median of {iters} eager forwards; roofline = max(bytes / 4.2 TB/s, FLOPs at 1377 fp8 / "
          "758 bf16 TFLOP/s)); OOM / UNSUPPORTED rows: the shape did not fit or a kernel refused it, the sweep went on")
    table_header()
    shapes = []  # decode: (label, (b, ctx), build, pages, seqs, tokens)
    for ctx in a.contexts:
        for b in a.batches:
            shapes.append((f"decode B={b} ctx={tokens_label(ctx)}", (b, ctx),
                           lambda n, b=b, ctx=ctx: decode_step(cfg, b, ctx, n, rng, device),
                           b * -(-(ctx + 1) // 64), [(1, ctx)] * b, b))
    for q in (n + 1 for n in drafts):  # the verify step of N drafts: q = N + 1 query tokens after ctx cached ones
        for ctx in a.contexts:
            for b in a.batches:
                shapes.append((f"verify B={b}x{q} ctx={tokens_label(ctx)}", ("verify", q, b, ctx),
                               lambda n, b=b, ctx=ctx, q=q: decode_step(cfg, b, ctx, n, rng, device, query=q),
                               b * -(-(ctx + q) // 64), [(q, ctx + q)] * b, q * b))
    decode, verify = {}, {}  # decode keyed (b, ctx), verify (q, b, ctx)
    for label, key, build, pages, seqs, tokens in shapes:
        got = run_shape(net, label, build, pages, seqs, tokens, iters, device, a.warmup, replays if graphs else 0)
        if got:
            (verify if key[0] == "verify" else decode)[key[1:] if key[0] == "verify" else key] = got
    for s in a.prefill:
        run_shape(net, f"prefill {tokens_label(s)} tokens", lambda n, s=s: prefill_step(cfg, s, n, rng, device),
                  -(-s // 64), [(s, s)], s, iters, device, a.warmup)
    graph_rows = {}
    if graphs:
        print(f"\ndecode under CUDA graphs, per layer, µs: the whole step captured in one graph; graph µs/step: "
              f"median of {replays} replays (CUDA events); the split: torch.profiler over {PROFILED_REPLAYS} replays, "
              "each GPU activity tagged with the eager forward's (layer, region) of the same launch (module "
              f"docstring); eager µs/step: median of {replays} eager forwards without hooks; OOM / ... FAILED rows: "
              "the sweep went on")
        compiled = None
        if a.compile:
            torch._dynamo.config.cache_size_limit = max(64, len(shapes) + 8)  # one graph per decode shape
            compiled = torch.compile(net, fullgraph=True, dynamic=False)
            print("graph rows: the torch.compile (Inductor) forward; its kernels without an eager same-name "
                  "partner (Inductor's fusions) are charged to \"rest\" of their layer", flush=True)
        table_header(GRAPH_COLUMNS)
        for label, key, build, pages, seqs, tokens in shapes:
            t1 = time.perf_counter()
            got = graph_shape(net, build, pages, replays, device, compiled)
            if compiled is not None:
                print(f"  {label}: compiled, captured and profiled in {time.perf_counter() - t1:.0f} s",
                      file=sys.stderr, flush=True)
            eager = verify.get(key[1:]) if key[0] == "verify" else decode.get(key)
            print_graph_rows(net, label, got, eager[2] if eager else None, seqs, tokens)
            graph_rows[key] = got
        if a.top_kernels > 0:
            print(f"\nthe {a.top_kernels} longest kernels of each region under CUDA graphs, µs per layer (median of "
                  f"{PROFILED_REPLAYS} profiled replays)")
            for label, key, *_ in shapes:
                print_top_kernels(label, graph_rows[key], a.top_kernels)
    else:
        print(f"\nCUDA graphs: skipped ({'--no-graphs' if a.no_graphs else f'device {device.type}: graphs need CUDA'})")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    model_8gpu(decode, graph_rows, cfg, card)
    if device.type == "cuda" and cfg.n_routed_experts == 256 and decode:
        batches = sorted({b for b, _ in decode})
        tokens = {*batches, *(WORLD * b for b in batches)}
        tokens |= {(n + 1) * t for t in tokens for n in drafts}
        model_8gpu_dp(decode, graph_rows, experts_alone_us(net, sorted(tokens), replays, device), cfg, verify,
                      a.mtp_acceptance, drafts, card)
    return 0


def experts_alone_us(net, tokens: list[int], replays: int, device) -> dict[int, float]:
    """µs of the first MoE layer's routed experts alone (dsa::moe_experts) at each token count: its
    router's picks on random hidden states, one CUDA graph, median of ``replays`` replays."""
    moe = next(la.mlp for la in net.model.layers if not la.dense_mlp)
    out = {}
    g = torch.Generator(device=device).manual_seed(1)
    for t in tokens:
        try:
            x = (torch.randn(t, net.cfg.hidden_size, generator=g, device=device) * 0.5).to(torch.bfloat16)
            with torch.no_grad():
                ids, w = moe.gate.select(x)
                run = lambda x=x, ids=ids, w=w: moe.stacked_experts(x, ids, w)  # noqa: E731
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    run()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
            out[t] = median_step_us(graph.replay, replays)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # the sweep goes on
            print(f"experts alone at T={t}: FAILED ({str(e).splitlines()[0][:120]})", flush=True)
        torch.cuda.empty_cache()
    return out














if __name__ == "__main__":
    sys.exit(main())
