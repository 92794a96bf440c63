"""Benchmark: the routed MoE experts (plugins/csrc/moe_experts.cu: routing prep, act_quant,
grouped fp8 gate|up GEMM, swiglu + requant, grouped down GEMM, combine) at DeepSeek-V3.2's real
dims: 256 experts all on this GPU, top-8, D 7168, I 2048, e4m3 weights with 128x128 scales,
uniform random routing (8 distinct experts per token), ue8m0 activation scales. The operator runs
through torch.ops.dsa.moe_experts (the C++ binding: `make kernels torch-ops`).

Method (timing.py): one CUDA graph per operator, the L2 flushed before each replay, the GPU span
of the replay from the profiler (events as a cross-check), median of --iters. The whole operator
is timed, all six kernels; so is the anchor.

Counting: pairs P = 8 T; FLOPs = 2 P (2I D + D I); bytes = the experts the routing touches (each
e4m3 weight byte once, plus their scales) + x + out + routing. The read floor is those bytes at
4.2 TB/s (decode's bound); the FLOP floor is the FLOPs at the fp8 dense peak (1377 TFLOP/s
measured, prefill's bound); "% of floor" = max(read floor, FLOP floor) / time.

Anchor, same run, same inputs: a torch loop over the touched experts (token rows gathered per
expert, fixed when the graph is captured) with cuBLASLt's blockwise torch._scaled_mm (1x128
activations, 128x128 weights; activations quantised in torch inside the timed call) for gate|up
and down, SiLU * up in fp32, index_add combine. Where this torch / cuBLASLt refuses the blockwise
layout for some expert's row count, every expert falls back to bf16 matmuls on pre-dequantised
weights (the "anchor" column says which).

Path: the expert GEMMs the operator's plan picks (dsa_moe_experts_path: "tma-fused" for prefill,
the grouped warp-specialised TMA GEMM with SwiGLU in the gate/up epilogue; "legacy" the cp.async
tile); where that is a tma path, the "legacy µs" column times the same inputs with
DSA_MOE_GEMM_PATH=legacy in the same run (the A/B of the path; --ab tma-pipe: against the unfused
TMA GEMMs instead).
The anchor runs for T <= 4096 (its per-expert loop at T = 16384 takes minutes to capture).

"power-capped": the share of the row's timing (capture, replays, profiler) during which the driver
held the GPU's clocks down to stay under its power limit (nvidia-smi's "SW Power Capping" counter;
timing.power_capped_us; the driver updates it in bursts, so it is a sign over a row of seconds, not
a measure of a short one). The prefill rows' GEMMs pass the limit when replayed back to back, so their
µs are those of a power-capped GPU; a GPU that idles between calls runs them faster.

--kernels prints, after each row, the operator's kernels from the profiler (eager calls after an
L2 flush, median of 5): where the time goes, which says what bounds a row.

Usage: python benchmarks/bench_moe.py [--quick | --tokens T ...] [--iters 20] [--kernels] [--md out.md]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from timing import power_capped_share, time_both_us

from dsa_trt.plugins import cuda_ops
from dsa_trt.plugins.kernel_abi import KernelLibrary

NUM_EXPERTS, TOP_K, D, I = 256, 8, 7168, 2048
BLOCK = 128
HBM_TBPS = 4.2
FP8_TFLOPS = 1377.0
TOKENS = [1, 8, 32, 128, 512, 4096, 16384]
QUICK_TOKENS = [1, 32, 4096, 16384]
ANCHOR_MAX_T = 4096
PATH_KNOB = "DSA_MOE_GEMM_PATH"


# ---------------------------------------------------------------- counting (pure, CPU-checkable)
def expert_bytes() -> float:
    """e4m3 bytes + fp32 scales of one expert (gate, up, down)."""
    w = 2 * I * D + D * I
    s = 4 * (-(-2 * I // BLOCK) * -(-D // BLOCK) + -(-D // BLOCK) * -(-I // BLOCK))
    return float(w + s)


def count_flops_and_bytes(t: int, touched: int) -> tuple[float, float]:
    pairs = TOP_K * t
    flops = 2.0 * pairs * (2 * I * D + D * I)
    nbytes = touched * expert_bytes() + 2.0 * t * D + 4.0 * t * D + 8.0 * t * TOP_K  # experts, x, out, routing
    return flops, nbytes


def floors_us(flops: float, nbytes: float) -> tuple[float, float]:
    """(read floor, FLOP floor) in µs."""
    return nbytes / (HBM_TBPS * 1e6), flops / (FP8_TFLOPS * 1e6)


def routing_groups(ids: torch.Tensor, weights: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """[(expert, token rows, their combine weights)] for every touched expert, ascending."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=NUM_EXPERTS).tolist()
    groups, start = [], 0
    for e, c in enumerate(counts):
        if c:
            sel = order[start:start + c]
            groups.append((e, (sel // top_k).contiguous(), weights.reshape(-1)[sel].contiguous()))
        start += c
    return groups


def uniform_routing(t: int, g: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """8 distinct experts per token, uniformly at random; weights in [0, 0.3)."""
    ids = torch.rand(t, NUM_EXPERTS, generator=g, device=device).topk(TOP_K, dim=1).indices.to(torch.int32)
    return ids.contiguous(), torch.rand(t, TOP_K, generator=g, device=device) * 0.3


# ---------------------------------------------------------------- the operator and the anchor
class Moe:
    """One torch.ops.dsa.moe_experts call on fixed inputs (ue8m0 activation scales, as V3.2); the
    output and workspace it allocates stay in the CUDA graph's pool, so a replay only launches."""

    def __init__(self, x, ids, weights, w13, s13, w2, s2):
        self.args = (x, ids, weights, w13, s13, w2, s2, NUM_EXPERTS, 0, True)

    def __call__(self):
        return torch.ops.dsa.moe_experts(*self.args)


def quant_1x128(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[m, K] -> (e4m3 [m, K], fp32 scales [m, K/128] in the outer-dim-major layout cuBLASLt takes)."""
    m, k = v.shape
    g = v.float().view(m, k // BLOCK, BLOCK)
    s = g.abs().amax(-1).clamp(min=1e-4) / 448.0
    q = (g / s[..., None]).view(m, k).to(torch.float8_e4m3fn)
    return q, s.t().contiguous().t()


class TorchLoop:
    """The anchor: per touched expert, gather its tokens, gate|up, SiLU * up, down, index_add."""

    def __init__(self, x, ids, weights, w13, s13, w2, s2):
        self.x, self.w13, self.s13, self.w2, self.s2 = x, w13, s13, w2, s2
        self.groups = routing_groups(ids, weights)
        self.out = torch.zeros(x.shape[0], D, device="cuda", dtype=torch.float32)
        self.scale_layout, self.why = self._probe()
        self.mode = "_scaled_mm blockwise" if self.scale_layout is not None else "bf16 matmul"
        if self.scale_layout is None:  # dequantise the touched experts once, outside the timed call
            self.w13b = {e: self._dequant(w13[e], s13[e]) for e, _, _ in self.groups}
            self.w2b = {e: self._dequant(w2[e], s2[e]) for e, _, _ in self.groups}

    @staticmethod
    def _dequant(w8, ws):
        return (w8.float() * ws.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)).to(torch.bfloat16)

    def _probe(self):
        """The scale_b layout cuBLASLt's blockwise _scaled_mm takes for every row count here, or None
        (and why)."""
        counts = sorted({rows.numel() for _, rows, _ in self.groups})
        errors = []
        for layout in ("transposed", "contiguous"):
            try:
                for m in counts:
                    a, sa = quant_1x128(self.x[:1].expand(m, D).contiguous())
                    torch._scaled_mm(a, self.w13[0].t(), sa, self._sb(self.s13[0], layout), out_dtype=torch.bfloat16)
                torch.cuda.synchronize()
                return layout, None
            except (RuntimeError, TypeError, ValueError) as e:
                errors.append(f"{layout}: {str(e).splitlines()[0][:80]}")
        return None, "; ".join(errors)

    @staticmethod
    def _sb(ws, layout):
        return ws.t() if layout == "transposed" else ws.t().contiguous()

    def __call__(self):
        self.out.zero_()
        scaled = self.scale_layout is not None
        if scaled:
            xq, sx = quant_1x128(self.x)
        for e, rows, w in self.groups:
            if scaled:
                gu = torch._scaled_mm(xq[rows], self.w13[e].t(), sx[rows].t().contiguous().t(),
                                      self._sb(self.s13[e], self.scale_layout), out_dtype=torch.bfloat16)
            else:
                gu = self.x[rows] @ self.w13b[e].t()
            h = (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(torch.bfloat16)
            if scaled:
                hq, sh = quant_1x128(h)
                y = torch._scaled_mm(hq, self.w2[e].t(), sh, self._sb(self.s2[e], self.scale_layout),
                                     out_dtype=torch.bfloat16)
            else:
                y = h @ self.w2b[e].t()
            self.out.index_add_(0, rows, y.float() * w[:, None])


def random_e4m3(shape, g: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 bytes with |v| < 2 (the exponent's top bit and NaN patterns cleared)."""
    return (torch.randint(0, 256, shape, generator=g, device="cuda", dtype=torch.uint8) & 0xB7).view(
        torch.float8_e4m3fn)


def random_experts(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All 256 experts on the GPU: (w13 e4m3 [E, 2I, D] 7.5 GB, its scales, w2 e4m3 [E, D, I] 3.8 GB,
    its scales)."""
    w13 = random_e4m3((NUM_EXPERTS, 2 * I, D), g)
    w2 = random_e4m3((NUM_EXPERTS, D, I), g)
    s13 = torch.rand(NUM_EXPERTS, 2 * I // BLOCK, D // BLOCK, generator=g, device="cuda") * 1e-3 + 1e-4
    s2 = torch.rand(NUM_EXPERTS, D // BLOCK, I // BLOCK, generator=g, device="cuda") * 1e-3 + 1e-4
    return w13, s13, w2, s2


def load_and_experts() -> tuple[torch.Generator, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The CUDA kernels loaded (or a clear exit), then (the seeded generator, an L2-flush buffer,
    random_experts)."""
    try:
        cuda_ops.load("cuda")
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    g = torch.Generator(device="cuda").manual_seed(0)
    return g, torch.empty(64 << 20, dtype=torch.int32, device="cuda"), random_experts(g)


def header(ab: str = "legacy") -> str:
    return (f"| T | experts touched | their GB | read floor µs | path | µs | % of floor | TB/s | TFLOP/s | power-capped | "
            f"{ab} µs | anchor µs | anchor | vs anchor |")


def percent(share: float | None) -> str:
    return "—" if share is None else f"{100 * share:.0f}%"


def format_row(t: int, touched: int, path: str, us: float, ab_us: float | None, anchor_us: float | None,
               anchor: str, capped: str = "—") -> str:
    flops, nbytes = count_flops_and_bytes(t, touched)
    read_floor, flop_floor = floors_us(flops, nbytes)
    a = f"{anchor_us:.1f}" if anchor_us is not None else "—"
    ratio = f"{anchor_us / us:.2f}x" if anchor_us is not None else "—"
    ab = f"{ab_us:.1f}" if ab_us is not None else "—"
    return (f"| {t} | {touched} | {touched * expert_bytes() / 1e9:.2f} | {read_floor:.1f} | {path} | {us:.1f} | "
            f"{100 * max(read_floor, flop_floor) / us:.1f} | {nbytes / us / 1e6:.2f} | {flops / us / 1e6:.1f} | "
            f"{capped} | {ab} | {a} | {anchor} | {ratio} |")


def kernel_breakdown(fn, flush_buf, iters: int = 5) -> list[tuple[str, float]]:
    """[(kernel name, median µs per call)] of fn's CUDA kernels, longest first (profiler, eager)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from timing import flush_l2

    fn()
    torch.cuda.synchronize()
    per_call: dict[str, list[float]] = {}
    for _ in range(iters):
        flush_l2(flush_buf)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        seen: dict[str, float] = {}
        count: dict[str, int] = {}
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA),
                        key=lambda e: e.start_ns())
        for e in events:  # a kernel launched twice (the two expert GEMMs) keeps its launches apart
            n = count[e.name()] = count.get(e.name(), 0) + 1
            seen[f"[{n}] {e.name()}"] = (e.end_ns() - e.start_ns()) / 1e3
        for name, us in seen.items():
            per_call.setdefault(name, []).append(us)
    rows = [(name, sorted(v)[len(v) // 2]) for name, v in per_call.items()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS} only")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="these T only")
    ap.add_argument("--no-anchor", action="store_true", help="skip the torch-loop anchor")
    ap.add_argument("--md", type=str, default=None)
    ap.add_argument("--kernels", action="store_true", help="print each row's kernels (profiler)")
    ap.add_argument("--ab", default="legacy", choices=["legacy", "tma", "tma-pipe", "tma-fused", "tma-fused-nomc", "none"],
                    help="the path of the A/B column (default legacy; none: no A/B)")
    args = ap.parse_args()
    g, flush_buf, (w13, s13, w2, s2) = load_and_experts()
    lib = KernelLibrary()
    rows = [header(args.ab), "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    print("\n".join(rows), flush=True)
    notes = set()
    for t in args.tokens or (QUICK_TOKENS if args.quick else TOKENS):
        try:
            x = torch.randn(t, D, generator=g, device="cuda").to(torch.bfloat16)
            ids, weights = uniform_routing(t, g, "cuda")
            touched = int(torch.unique(ids).numel())
            path = lib.moe_path(t, TOP_K, NUM_EXPERTS, I)
            with power_capped_share() as cap:
                ev, us = time_both_us(Moe(x, ids, weights, w13, s13, w2, s2), flush_buf, args.iters)
            us = us if us is not None else ev
            ab_us = None
            if path.startswith("tma") and args.ab != "none":  # the A/B: the same inputs on --ab's path
                forced = os.environ.get(PATH_KNOB)
                os.environ[PATH_KNOB] = args.ab
                try:
                    ab_ev, ab_us = time_both_us(Moe(x, ids, weights, w13, s13, w2, s2), flush_buf, args.iters)
                    ab_us = ab_us if ab_us is not None else ab_ev
                finally:  # the next row runs under the run's own path again
                    if forced is None:
                        os.environ.pop(PATH_KNOB)
                    else:
                        os.environ[PATH_KNOB] = forced
            anchor_us, anchor = None, "skipped"
            if not args.no_anchor and t <= ANCHOR_MAX_T:
                loop = TorchLoop(x, ids, weights, w13, s13, w2, s2)
                aev, aus = time_both_us(loop, flush_buf, args.iters)
                anchor_us, anchor = (aus if aus is not None else aev), loop.mode
                if loop.why:
                    notes.add(f"_scaled_mm blockwise refused: {loop.why}")
                del loop
            row = format_row(t, touched, path, us, ab_us, anchor_us, anchor, percent(cap["share"]))
            if args.kernels:
                with power_capped_share() as kcap:
                    for name, kus in kernel_breakdown(Moe(x, ids, weights, w13, s13, w2, s2), flush_buf):
                        print(f"#   T={t} {kus:10.1f} µs  {name[:110]}", flush=True)
                print(f"#   T={t} power-capped {percent(kcap['share'])} of the profile", flush=True)
        except torch.OutOfMemoryError:
            row = f"| {t} | OOM | | | | | | | | | | | | |"
        except (RuntimeError, ValueError) as e:  # the op's refusals: NotImplementedError, ValueError
            row = f"| {t} | UNSUPPORTED ({str(e)[:100]}) | | | | | | | | | | | | |"
        torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    for n in sorted(notes):
        print(n, flush=True)
        rows.append(f"\n{n}")
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
