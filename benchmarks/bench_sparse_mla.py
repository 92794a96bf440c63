"""Benchmark: sparse MLA over the 576-byte fp8 pool (plugins/csrc/sparse_mla_fp8.cuh).

Method (the peers' published one; benchmarks/RESULTS.md): random inputs (never zeros); before every timed call
an L2 flush (bitwise_not_ over 256 MB); the launch is captured once in a CUDA graph; 3 warm-ups;
median of `--iters`. "µs" is the profiler's span of one replay (the FlashMLA anchors' measure);
"events µs" brackets the same replay with CUDA events (timing.time_both_us).

Counting, per case, as FlashMLA counts (its benchmark's functions, named below), with our 576-byte rows
where FlashMLA's layout has 656 (decode) or 1152 bf16 bytes (prefill):

* decode (count_flop_and_mem_vol_for_decode): FLOPs = 2*h*(b*s_q*topk)*(576+512); bytes = q bf16
  + unique(valid slots in the batch)*576 + out bf16. Each request: s_k = 32768 tokens on pages
  scattered over the pool, each query token selects topk distinct positions of its request.
* prefill (count_flop_and_mem_vol): FLOPs = 2*s_q*topk*h*(576+512); bytes = valid indices*576
  (no dedup: mostly L2 traffic) + s_q*h*(576+512)*2. One sequence of s_kv tokens, random indices.

Ceilings measured on this H200 kind: copy 4.3 TB/s, fp8 matmul 1377 TFLOP/s (the kernel's QK^T
and PV run on fp8 tensor cores). "% roof" = max(FLOPs / 1377 TF, bytes / 4.3 TB/s) / time.
The FlashMLA column is its measured time on the same GPU for the same shape (measured once, quoted:
sparse fp8 decode with its 656-B layout; sparse prefill with a bf16 KV).

Small-T decode rows run split-KV (auto: the top-k list cut into chunks over one wave of SMs,
then a combine kernel; both kernels are in the timed graph); rows marked "unsplit" force
num_splits = 1 on the same shape for comparison.

Usage: python benchmarks/bench_sparse_mla.py [--iters 20] [--md out.md] [--only decode|verify|prefill]
"""

from __future__ import annotations

import argparse

import torch

from timing import time_both_us

from dsa_trt.plugins import cuda_ops as K

COPY_TBPS = 4.3
FP8_TFLOPS = 1377.0
D_QK, D_V, PAGE = 576, 512, 64
ROW_BYTES = 576
SM_SCALE = 0.1352


# ---------------------------------------------------------------- counting (FlashMLA's, 576-B rows)
def count_flops_and_bytes_decode(b: int, s_q: int, h: int, topk: int, unique_slots: int) -> tuple[float, float]:
    flops = 2.0 * h * (b * s_q * topk) * (D_QK + D_V)
    nbytes = 2.0 * b * s_q * h * D_QK + unique_slots * ROW_BYTES + 2.0 * b * s_q * h * D_V
    return flops, nbytes


def count_flops_and_bytes_prefill(s_q: int, h: int, topk: int, valid_indices: int) -> tuple[float, float]:
    flops = 2.0 * s_q * topk * h * (D_QK + D_V)
    nbytes = valid_indices * ROW_BYTES + 2.0 * s_q * h * (D_QK + D_V)
    return flops, nbytes


# ---------------------------------------------------------------- inputs
def random_pool(num_pages: int, g: torch.Generator) -> tuple[torch.Tensor, float]:
    kv = torch.randn(num_pages * PAGE, D_QK, generator=g, device="cuda")
    kv_scale = float(kv.abs().max()) / 448.0
    pool = (kv / kv_scale).to(torch.float8_e4m3fn).view(torch.uint8).view(num_pages, PAGE, D_QK)
    return pool, kv_scale


def random_positions(rows: int, length: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """[rows, topk] distinct random positions in [0, length) per row, chunked to bound memory."""
    out = []
    chunk = max(1, (1 << 27) // length)
    for r0 in range(0, rows, chunk):
        n = min(chunk, rows - r0)
        out.append(torch.rand(n, length, generator=g, device="cuda").topk(topk, dim=-1).indices)
    return torch.cat(out)


def random_q(tokens: int, heads: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(tokens, heads, D_QK, generator=g, device="cuda") * 0.15).to(torch.bfloat16)


class Launch:
    """One preallocated dsa_launch_sparse_mla call (no Python allocation in the timed region).
    num_splits: 0 = auto split-KV (the default of the op), 1 = unsplit."""

    def __init__(self, q, pool, slots, kv_scale, num_splits: int = 0):
        lib = K.library()
        assert lib is not None, K.library_error()
        t, h = q.shape[:2]
        self.out = torch.empty(t, h, D_V, dtype=torch.bfloat16, device="cuda")
        self.lse = torch.empty(t, h, dtype=torch.float32, device="cuda")
        ws_bytes = lib.sparse_mla_workspace_size(t, h, slots.shape[1], K.CACHE_FP8)
        self.workspace = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda") if ws_bytes else None
        self.args = (q, pool, slots, self.out, self.lse)
        self.kw = dict(fmt=K.CACHE_FP8, num_splits=num_splits, workspace=self.workspace, kv_scale=kv_scale,
                       sm_scale=SM_SCALE)

    def __call__(self):
        status, msg = K.sparse_mla_launch(*self.args, **self.kw)
        if status != 0:
            raise RuntimeError(f"sparse_mla: {status}: {msg}")


def decode_case(b: int, s_q: int, h: int, topk: int, s_k: int, g: torch.Generator, num_splits: int = 0):
    pages_per_req = s_k // PAGE
    pool, kv_scale = random_pool(b * pages_per_req, g)
    table = torch.randperm(b * pages_per_req, generator=g, device="cuda").view(b, pages_per_req)
    pos = random_positions(b * s_q, s_k, topk, g)  # [b*s_q, topk]
    req = torch.arange(b, device="cuda").repeat_interleave(s_q)
    slots = (table[req[:, None], pos // PAGE] * PAGE + pos % PAGE).to(torch.int32).contiguous()
    q = random_q(b * s_q, h, g)
    unique = int(torch.unique(slots).numel())
    return Launch(q, pool, slots, kv_scale, num_splits), count_flops_and_bytes_decode(b, s_q, h, topk, unique)


def prefill_case(s_q: int, h: int, topk: int, s_kv: int, g: torch.Generator):
    pool, kv_scale = random_pool(s_kv // PAGE, g)
    perm = torch.randperm(s_kv // PAGE, generator=g, device="cuda")
    pos = random_positions(s_q, s_kv, topk, g)
    slots = (perm[pos // PAGE] * PAGE + pos % PAGE).to(torch.int32).contiguous()
    q = random_q(s_q, h, g)
    return Launch(q, pool, slots, kv_scale), count_flops_and_bytes_prefill(s_q, h, topk, slots.numel())


# (label, kind, args, FlashMLA µs on the H200 or None, target µs or None[, keyword args of the case])
CASES = [
    ("decode b=128 s_q=2 h=128 k=2048", "decode", (128, 2, 128, 2048, 32768), 365.7, 300.0),
    ("decode b=128 s_q=1 h=128 k=2048", "decode", (128, 1, 128, 2048, 32768), 186.8, 155.0),
    ("decode b=64 s_q=1 h=128 k=2048", "decode", (64, 1, 128, 2048, 32768), 97.5, 80.0),
    ("decode b=64 s_q=2 h=128 k=2048", "decode", (64, 2, 128, 2048, 32768), 187.3, None),
    ("decode b=8 s_q=1 h=128 k=2048", "decode", (8, 1, 128, 2048, 32768), None, None),
    ("decode b=2 s_q=2 h=128 k=2048", "decode", (2, 2, 128, 2048, 32768), 21.4, None),
    ("decode b=2 s_q=2 h=128 k=2048 unsplit", "decode", (2, 2, 128, 2048, 32768), 21.4, None, {"num_splits": 1}),
    ("decode b=1 s_q=1 h=128 k=2048", "decode", (1, 1, 128, 2048, 32768), None, None),
    ("decode b=1 s_q=1 h=128 k=2048 unsplit", "decode", (1, 1, 128, 2048, 32768), None, None, {"num_splits": 1}),
    ("decode b=128 s_q=1 h=128 k=512", "decode", (128, 1, 128, 512, 32768), None, None),
    ("decode b=128 s_q=1 h=128 k=64", "decode", (128, 1, 128, 64, 32768), None, None),
    ("decode b=128 s_q=1 h=64 k=2048 (TP2)", "decode", (128, 1, 64, 2048, 32768), None, None),
    ("decode b=128 s_q=1 h=32 k=2048 (TP4)", "decode", (128, 1, 32, 2048, 32768), None, None),
    ("decode b=128 s_q=1 h=16 k=2048 (TP8)", "decode", (128, 1, 16, 2048, 32768), None, None),
    # the verify step of one MTP draft at a GPU's 32K batch (2 query tokens per sequence): two waves of chunks
    ("verify b=20 s_q=2 h=128 k=2048", "verify", (20, 2, 128, 2048, 32768), None, None),
    ("verify b=20 s_q=2 h=128 k=2048 unsplit", "verify", (20, 2, 128, 2048, 32768), None, None, {"num_splits": 1}),
    ("verify b=22 s_q=2 h=128 k=2048", "verify", (22, 2, 128, 2048, 32768), None, None),
    ("prefill s_q=4096 h=128 k=2048 s_kv=32K", "prefill", (4096, 128, 2048, 32768), 3889.0, None),
    ("prefill s_q=4096 h=128 k=2048 s_kv=128K", "prefill", (4096, 128, 2048, 131072), 4205.0, 4205.0),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--md", type=str, default=None)
    ap.add_argument("--only", choices=["decode", "verify", "prefill"], default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    flush_buf = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    header = "| shape | µs | TFLOP/s | TB/s | % of roofline | events µs | FlashMLA anchor µs | target µs |"
    rows = [header, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    print(header, flush=True)
    for label, kind, cargs, anchor, target, *kwargs in CASES:
        if args.only and kind != args.only:
            continue
        try:
            case = prefill_case if kind == "prefill" else decode_case  # verify: decode at s_q = 2
            launch, (flops, nbytes) = case(*cargs, g, **(kwargs[0] if kwargs else {}))
            ev, us = time_both_us(launch, flush_buf, args.iters)
            us = us if us is not None else ev  # µs: the profiler's kernel span (the anchors' measure)
            roof = max(flops / (FP8_TFLOPS * 1e12), nbytes / (COPY_TBPS * 1e12)) * 1e6
            row = (f"| {label} | {us:.1f} | {flops / us / 1e6:.1f} | {nbytes / us / 1e6:.2f} | "
                   f"{100 * roof / us:.1f} | {ev:.1f} | {anchor if anchor else '—'} | {target if target else '—'} |")
            del launch
        except torch.OutOfMemoryError:
            row = f"| {label} | OOM | | | | | {anchor or '—'} | {target or '—'} |"
        except RuntimeError as e:
            row = f"| {label} | UNSUPPORTED ({e}) | | | | | {anchor or '—'} | {target or '—'} |"
        torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
