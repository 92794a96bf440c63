"""Benchmark: the fp8 block-scaled linear (plugins/csrc/fp8_linear.cu: act_quant + the GEMM its plan
picks, + the split-K reduce when it splits K) on DeepSeek-V3.2's shapes, beside torch's bf16
matmul and torch._scaled_mm with DeepSeek block scaling (cuBLASLt; 1x128 activations, 128x128
weights) on the same inputs in the same run. The "path" column is the plan of each row
(dsa_fp8_block_linear_path: GEMM, tile of weight rows x tokens, K splits); DSA_FP8_LINEAR_PATH
(tma, tma-nomc, tma-pipe, tma-store, tma-swap, legacy), or --path, forces one GEMM for a whole run. The
operator runs through torch.ops.dsa.fp8_block_linear (the C++ binding: `make kernels torch-ops`).

Method (as the other benchmarks, timing.py): random inputs; before every timed call an L2 flush
(bitwise_not_ over 256 MB); each call captured once in a CUDA graph; median of --iters replays;
"µs" is the profiler's kernel span of one replay (our row: act_quant, GEMM and reduce together;
the _scaled_mm anchor is timed on pre-quantised inputs, so it gets the activation quantisation
for free). "GEMM µs": our span from the end of act_quant (the GEMM and reduce; the GEMM's weight
loads that overlap act_quant are not counted), the like-for-like number beside _scaled_mm's.

Counting: FLOPs = 2*T*N*K; bytes = N*K (e4m3 weight) + 4*ceil(N/128)*ceil(K/128) (its scales)
+ 2*T*K (bf16 x) + 2*T*N (bf16 out). Ceilings of the H200: fp8 dense 1377 TFLOP/s (measured
on this kind), HBM 4.2 TB/s (the issue's weight-read floor). "% roof" = max(FLOPs / 1377 TF,
bytes / 4.2 TB/s) / time.

--fused: instead, the network's fused projections (export/layers.py FusedFp8Linear: the linears
of one input as one call) against their parts called one after another, in one CUDA graph each:
[q_a | indexer wk | kv_a] over x, [q_b | indexer wq_b] over c_q and an MLP's [gate | up] (the
shared expert's, a dense layer's), counted as one linear of the
stacked N (the parts' bytes and FLOPs summed).

Usage: python benchmarks/bench_fp8_linear.py [--quick | --tokens T ...] [--path P] [--fused] [--iters 20] [--md out.md]
"""

from __future__ import annotations

import argparse
import os

import torch

from timing import span_after_us, time_both_us

from dsa_trt.plugins import cuda_ops
from dsa_trt.plugins.kernel_abi import KernelLibrary

FP8_TFLOPS = 1377.0
HBM_TBPS = 4.2
BLOCK = 128

SHAPES = [  # (name, N, K)
    ("q_a", 1536, 7168),
    ("q_b", 24576, 1536),
    ("kv_a", 576, 7168),
    ("kv_b", 32768, 512),
    ("o_proj", 7168, 16384),
    ("indexer wq_b", 8192, 1536),
    ("dense gate+up", 36864, 7168),
    ("dense down", 7168, 18432),
]
TOKENS = [1, 16, 64, 128, 512, 2048, 8192]
QUICK_TOKENS = [1, 64, 4096]
# the MLA layer's FusedFp8Linears (export/network.py DSAAttention): (name, K, the parts' N)
FUSED_GROUPS = [("x -> [q_a, wk, kv_a]", 7168, (1536, 128, 576)), ("c_q -> [q_b, wq_b]", 1536, (24576, 8192)),
                ("shared expert [gate, up]", 7168, (2048, 2048)), ("dense [gate, up]", 7168, (18432, 18432))]
FUSED_TOKENS = [1, 8, 20, 40, 64, 128, 512]


def random_e4m3(shape, g: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 bytes with |v| < 2 (the exponent's top bit and NaN patterns cleared)."""
    return (torch.randint(0, 256, shape, generator=g, device="cuda", dtype=torch.uint8) & 0xB7).view(
        torch.float8_e4m3fn)


# ---------------------------------------------------------------- counting
def count_flops_and_bytes(t: int, n: int, k: int) -> tuple[float, float]:
    flops = 2.0 * t * n * k
    nbytes = n * k + 4.0 * -(-n // BLOCK) * -(-k // BLOCK) + 2.0 * t * k + 2.0 * t * n
    return flops, nbytes


# ---------------------------------------------------------------- the cases
class Linear:
    """One torch.ops.dsa.fp8_block_linear call on fixed inputs (ue8m0 activation scales, as V3.2); the
    output and workspace it allocates stay in the CUDA graph's pool, so a replay only launches."""

    def __init__(self, x, w8, ws):
        self.args = (x, w8, ws, True)

    def __call__(self):
        return torch.ops.dsa.fp8_block_linear(*self.args)


def scaled_mm_fn(x, w8, ws):
    """torch._scaled_mm blockwise on the same weight; x quantised once outside the timed call.
    None when this torch / cuBLASLt refuses the layout."""
    t, k = x.shape
    kb = -(-k // BLOCK)
    xp = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - k)).view(t, kb, BLOCK)
    sx = (xp.abs().amax(-1).clamp(min=1e-4) / 448.0)  # [T, kb]
    xq = (xp / sx[..., None]).view(t, kb * BLOCK)[:, :k].to(torch.float8_e4m3fn).contiguous()
    scale_a = sx.t().contiguous().t()  # [T, kb], stride (1, T): the layout cuBLASLt takes
    errors = []
    for scale_b in (ws.t(), ws.t().contiguous()):  # [kb, ceil(N/128)]
        try:
            fn = lambda sb=scale_b: torch._scaled_mm(xq, w8.t(), scale_a, sb, out_dtype=torch.bfloat16)
            fn()
            torch.cuda.synchronize()
            return fn, None
        except (RuntimeError, TypeError) as e:
            errors.append(str(e).splitlines()[0][:80])
    return None, "; ".join(errors)


def random_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [N, K] and its fp32 128x128 scales [ceil(N/128), ceil(K/128)]."""
    return random_e4m3((n, k), g), (torch.rand(-(-n // BLOCK), -(-k // BLOCK), generator=g, device="cuda") * 1e-2
                                     + 1e-3).contiguous()


def fused_table(iters: int, g: torch.Generator, flush_buf: torch.Tensor) -> list[str]:
    """The fused projections against their parts, one table."""
    rows = ["| group (N = parts) x K | T | parts µs | fused µs | saved µs | fused TB/s | fused % of roofline |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(rows), flush=True)
    for name, k, ns in FUSED_GROUPS:
        parts = [random_weight(n, k, g) for n in ns]
        w8, ws = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        for t in FUSED_TOKENS:
            x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
            calls = [Linear(x, pw, ps) for pw, ps in parts]
            _, us_parts = time_both_us(lambda calls=calls: [c() for c in calls], flush_buf, iters)
            _, us = time_both_us(Linear(x, w8, ws), flush_buf, iters)
            flops, nbytes = count_flops_and_bytes(t, sum(ns), k)
            roof = max(flops / (FP8_TFLOPS * 1e12), nbytes / (HBM_TBPS * 1e12)) * 1e6
            row = (f"| {name} ({' + '.join(map(str, ns))}) x {k} | {t} | {us_parts:.1f} | {us:.1f} | "
                   f"{us_parts - us:.1f} | {nbytes / us / 1e6:.2f} | {100 * roof / us:.1f} |")
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS} only")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="these T only")
    ap.add_argument("--md", type=str, default=None)
    ap.add_argument("--fused", action="store_true", help="the fused projections against their parts instead")
    ap.add_argument("--path", type=str, default=None,
                    help="DSA_FP8_LINEAR_PATH for this run (auto, tma, tma-nomc, tma-pipe, tma-store, tma-swap, legacy)")
    args = ap.parse_args()
    if args.path is not None:
        os.environ["DSA_FP8_LINEAR_PATH"] = args.path  # the library reads it at every launch
    try:
        cuda_ops.load("cuda")
        lib = KernelLibrary()  # the plan text of each row (the op does not report it)
    except (OSError, RuntimeError) as e:
        raise SystemExit(str(e)) from None
    g = torch.Generator(device="cuda").manual_seed(0)
    flush_buf = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    if args.fused:
        rows = fused_table(args.iters, g, flush_buf)
        if args.md:
            with open(args.md, "w") as f:
                f.write("\n".join(rows) + "\n")
        return
    header = ("| shape (N x K) | T | path | µs | TFLOP/s | TB/s | % of roofline | GEMM µs | bf16 matmul µs | "
              "_scaled_mm µs | vs _scaled_mm | GEMM vs _scaled_mm |")
    rows = [header, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    print("\n".join(rows), flush=True)
    for name, n, k in SHAPES:
        w8, ws = random_weight(n, k, g)
        wb = w8.to(torch.bfloat16)
        for t in tokens:
            label = f"{name} {n}x{k} | {t} | {lib.linear_path(t, n, k)}"
            try:
                x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
                flops, nbytes = count_flops_and_bytes(t, n, k)
                op = Linear(x, w8, ws)
                ev, us = time_both_us(op, flush_buf, args.iters)
                us = us if us is not None else ev
                gemm_us = span_after_us(op, flush_buf, args.iters, after="act_quant")
                roof = max(flops / (FP8_TFLOPS * 1e12), nbytes / (HBM_TBPS * 1e12)) * 1e6
                ob = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
                bev, bus = time_both_us(lambda: torch.matmul(x, wb.t(), out=ob), flush_buf, args.iters)
                bus = bus if bus is not None else bev
                fn, why = scaled_mm_fn(x, w8, ws)
                if fn is None:
                    smm, ratio, gemm_ratio = f"UNSUPPORTED ({why})", "—", "—"
                else:
                    sev, sus = time_both_us(fn, flush_buf, args.iters)
                    sus = sus if sus is not None else sev
                    smm, ratio = f"{sus:.1f}", f"{sus / us:.2f}x"
                    gemm_ratio = f"{sus / gemm_us:.2f}x" if gemm_us else "—"
                gemm = f"{gemm_us:.1f}" if gemm_us else "—"
                row = (f"| {label} | {us:.1f} | {flops / us / 1e6:.1f} | {nbytes / us / 1e6:.2f} | "
                       f"{100 * roof / us:.1f} | {gemm} | {bus:.1f} | {smm} | {ratio} | {gemm_ratio} |")
            except torch.OutOfMemoryError:
                row = f"| {label} | OOM | | | | | | | | |"
            except (RuntimeError, ValueError) as e:  # the op's refusals: NotImplementedError, ValueError
                row = f"| {label} | UNSUPPORTED ({str(e)[:100]}) | | | | | | | | |"
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
        del w8, ws, wb
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
