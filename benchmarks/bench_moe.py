"""Benchmark: the routed MoE experts (plugins/csrc/moe_experts.cu: routing prep, act_quant,
grouped fp8 gate|up GEMM, swiglu + requant, grouped down GEMM, combine) at DeepSeek-V3.2's real
dims: 256 experts all on this GPU, top-8, D 7168, I 2048, e4m3 weights with 128x128 scales,
uniform random routing (8 distinct experts per token).

Method as bench_fp8_linear.py (L2 flushed before each CUDA-graph replay, profiler kernel span,
median of --iters). The whole operator is timed, all six kernels.

Counting: pairs P = 8 T; FLOPs = 2 * P * (2I*D + D*I); the read floor is the bytes of the experts
the routing touches (each e4m3 weight byte once, plus scales) at 4.2 TB/s, the decode bound; the
prefill bound is FLOPs at 1377 TFLOP/s. "% of floor" = max(read floor, FLOP floor) / time.

Usage: python benchmarks/bench_moe.py [--quick] [--iters 20] [--md out.md]
"""

from __future__ import annotations

import argparse

import torch

from bench_fp8_linear import BLOCK, FP8_TFLOPS, HBM_TBPS, MoeParams, launch_checked, load_library, random_e4m3
from timing import time_both_us

NUM_EXPERTS, TOP_K, D, I = 256, 8, 7168, 2048
TOKENS = [1, 8, 32, 128, 512, 4096, 16384]
QUICK_TOKENS = [1, 32, 4096]


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


class Moe:
    """One preallocated dsa_launch_moe_experts call (ue8m0 activation scales, as V3.2)."""

    def __init__(self, dll, x, ids, weights, w13, s13, w2, s2):
        t = x.shape[0]
        self.out = torch.empty(t, D, device="cuda", dtype=torch.float32)
        ws = dll.dsa_moe_experts_workspace_size(t, TOP_K, NUM_EXPERTS, D, I, 0)
        self.work = torch.empty(max(ws, 16), device="cuda", dtype=torch.uint8)
        self.keep = (x, ids, weights)
        self.p = MoeParams(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), w13.data_ptr(), s13.data_ptr(),
                           w2.data_ptr(), s2.data_ptr(), self.out.data_ptr(), t, TOP_K, NUM_EXPERTS, NUM_EXPERTS, 0,
                           D, I, 0, 1, self.work.data_ptr())
        self.dll = dll

    def __call__(self):
        launch_checked(self.dll.dsa_launch_moe_experts, self.p, self.dll, "moe_experts")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS} only")
    ap.add_argument("--md", type=str, default=None)
    args = ap.parse_args()
    dll = load_library()
    g = torch.Generator(device="cuda").manual_seed(0)
    flush_buf = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    w13 = random_e4m3((NUM_EXPERTS, 2 * I, D), g)  # 7.5 GB
    w2 = random_e4m3((NUM_EXPERTS, D, I), g)       # 3.8 GB
    s13 = torch.rand(NUM_EXPERTS, 2 * I // BLOCK, D // BLOCK, generator=g, device="cuda") * 1e-3 + 1e-4
    s2 = torch.rand(NUM_EXPERTS, D // BLOCK, I // BLOCK, generator=g, device="cuda") * 1e-3 + 1e-4
    header = ("| T | experts touched | their GB | read floor µs | µs | % of floor | TFLOP/s | % of fp8 peak | "
              "events µs |")
    rows = [header, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print(header, flush=True)
    for t in (QUICK_TOKENS if args.quick else TOKENS):
        try:
            x = torch.randn(t, D, generator=g, device="cuda").to(torch.bfloat16)
            ids = torch.rand(t, NUM_EXPERTS, generator=g, device="cuda").topk(TOP_K, dim=1).indices.to(torch.int32)
            weights = torch.rand(t, TOP_K, generator=g, device="cuda") * 0.3
            touched = int(torch.unique(ids).numel())
            flops, nbytes = count_flops_and_bytes(t, touched)
            ev, us = time_both_us(Moe(dll, x, ids.contiguous(), weights, w13, s13, w2, s2), flush_buf, args.iters)
            us = us if us is not None else ev
            read_floor = nbytes / (HBM_TBPS * 1e12) * 1e6
            floor = max(read_floor, flops / (FP8_TFLOPS * 1e12) * 1e6)
            tflops = flops / us / 1e6
            row = (f"| {t} | {touched} | {touched * expert_bytes() / 1e9:.2f} | {read_floor:.1f} | {us:.1f} | "
                   f"{100 * floor / us:.1f} | {tflops:.1f} | {100 * tflops / FP8_TFLOPS:.1f} | {ev:.1f} |")
        except torch.OutOfMemoryError:
            row = f"| {t} | OOM | | | | | | | |"
        except RuntimeError as e:
            row = f"| {t} | UNSUPPORTED ({str(e)[:100]}) | | | | | | | |"
        torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
