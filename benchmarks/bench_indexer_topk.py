"""Benchmark: paged fp8 indexer logits and top-k + page translation (our CUDA kernels).

Method (the peers' published one; benchmarks/RESULTS.md): random inputs; before every timed call an L2 flush
(bitwise_not_ over 256 MB); the call is captured once in a CUDA graph; 3 warm-ups; median of
`--iters`. "µs" is the profiler's span of one replay (first kernel start to last kernel end, the
peers' measure); "events µs" brackets the same replay with CUDA events (timing.time_both_us).
Ceilings measured on this H200 kind: copy 4.3 TB/s, fp8 matmul 1377 TFLOP/s. "% roof" = the
larger of (bytes / 4.3 TB/s, FLOPs / 1377 TFLOP/s) over the measured time. Each case counts
FLOPs and bytes like the peer it is compared with (the peers' own counting functions):

* paged decode logits (DeepGEMM fp8_paged_mqa_logits): FLOPs = 2*sum_len*H*D; bytes = q (bf16
  count, as DeepGEMM's test) + weights + sum_len*(D+4) + sum_len*4.
* prefill logits (DeepGEMM fp8_mqa_logits, CP=0 causal tail): FLOPs = 2*sum(ke-ks)*H*D; bytes =
  q_fp8 + kv_fp8 + kv_scale + weights + ks + ke + sum(ke-ks)*4.
* top-k (FlashInfer transform): bytes = scores read once + slots written; no FLOPs.
* "read-only µs" (memory-bound rows): torch.sum over as many bytes of contiguous fp32, timed the
  same way: a library kernel that only streams the bytes, under the same flush. Not a floor (our
  decode logits beat it at every size), but it shows what this method gives a plain read of that
  size: short reads stay far from the copy ceiling (ramp-up, the flush's dirty lines written back
  meanwhile). The floors themselves (a kernel that only reads the same pages, every load in
  flight) come from benchmarks/read_floor.py.
Usage: python benchmarks/bench_indexer_topk.py [--iters 20] [--md out.md] [--only logits|topk]
"""

from __future__ import annotations

import argparse

import torch

from timing import time_both_us

from dsa_trt.plugins import cuda_ops as K

COPY_TBPS = 4.3
FP8_TFLOPS = 1377.0
H, D = 64, 128
TOPK = 2048


# ---------------------------------------------------------------- counting (one per peer)
def count_paged_logits(batch: int, ctx: int) -> tuple[float, float]:
    sum_len = batch * ctx
    flops = 2.0 * sum_len * H * D
    nbytes = batch * H * D * 2 + batch * H * 4 + sum_len * (D + 4) + sum_len * 4
    return flops, nbytes


def count_prefill_logits(s: int, skv: int) -> tuple[float, float]:
    lens = [skv - s + i + 1 for i in range(s)]
    sum_len = sum(lens)
    flops = 2.0 * sum_len * H * D
    nbytes = s * H * D + skv * D + skv * 4 + s * H * 4 + 2 * s * 4 + sum_len * 4
    return flops, nbytes


def count_topk(rows: int, width: int) -> tuple[float, float]:
    return 0.0, rows * width * 4 + rows * TOPK * 4


def random_index_pool(num_pages: int, g: torch.Generator) -> torch.Tensor:
    """Random e4m3 keys (no NaN codes) and positive power-of-two scales."""
    mag = torch.randint(0, 0x7F, (num_pages, 8192), generator=g, device="cuda", dtype=torch.uint8)
    sign = torch.randint(0, 2, (num_pages, 8192), generator=g, device="cuda", dtype=torch.uint8) << 7
    scales = torch.exp2(torch.randint(-10, -4, (num_pages, 64), generator=g, device="cuda").float())
    return torch.cat([mag | sign, scales.view(torch.uint8)], dim=1).contiguous()


def logits_inputs(pool_pages: int, batch: int, ctx_pages: int, seq_lens: torch.Tensor, g, num_tokens=None):
    num_tokens = num_tokens or batch
    perm = torch.randperm(pool_pages, generator=g, device="cuda")
    if batch * ctx_pages <= pool_pages:
        page_table = perm[: batch * ctx_pages].view(batch, ctx_pages)
    else:
        page_table = perm[:ctx_pages].repeat(batch, 1)
    q = torch.randn(num_tokens, H, D, generator=g, device="cuda").clamp(-8, 8).to(torch.float8_e4m3fn)
    w = torch.randn(num_tokens, H, generator=g, device="cuda") * 0.01
    req_idx = torch.zeros(num_tokens, dtype=torch.int32, device="cuda") if num_tokens != batch else \
        torch.arange(batch, dtype=torch.int32, device="cuda")
    return q, w, page_table.to(torch.int32).contiguous(), req_idx, seq_lens.to(torch.int32)


def roof_cells(us: float, flops: float, nbytes: float) -> str:
    """`µs | TFLOP/s | TB/s | % of roofline` for a measured time."""
    tflops = flops / us / 1e6
    tbps = nbytes / us / 1e6
    floor_us = max(nbytes / (COPY_TBPS * 1e6), flops / (FP8_TFLOPS * 1e6))
    tf = f"{tflops:.1f}" if flops else "—"
    return f"{us:.1f} | {tf} | {tbps:.2f} | {100 * floor_us / us:.0f}%"


def row(shape: str, t: tuple | None, flops: float, nbytes: float, peer: str, note: str = "",
        read_us: float | None = None) -> str:
    read = f"{read_us:.1f}" if read_us is not None else "—"
    if t is None:
        return f"| {shape} | {note} | | | | | {read} | {peer} |"
    return f"| {shape} | {roof_cells(t[0], flops, nbytes)} | {t[1]:.1f} | {read} | {peer} |"


def read_only_us(nbytes: float, flush, iters: int) -> float | None:
    """Profiler span of torch.sum over nbytes of contiguous fp32 after the flush (None: no memory)."""
    try:
        buf = torch.empty(int(nbytes) // 4, device="cuda")
        out = torch.empty((), device="cuda")
        events, kernels = time_both_us(lambda: torch.sum(buf, dim=0, out=out), flush, iters)
        return kernels if kernels is not None else events
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def run_case(fn, flush, iters):
    """((profiler µs, events µs), note): the profiler's kernel span is the peers' measure (the
    roofline cells use it); the events time the graph replay (~2 µs more on short calls)."""
    try:
        events, kernels = time_both_us(fn, flush, iters)
        return (kernels if kernels is not None else events, events), ""
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "OOM"
    except (RuntimeError, ValueError) as e:
        return None, f"UNSUPPORTED ({str(e)[:80]})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--md", default=None)
    ap.add_argument("--only", choices=("logits", "topk"), default=None,
                    help="run only the logits rows or the top-k + translation rows")
    args = ap.parse_args()
    assert K.library() is not None, K.library_error()
    g = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    lines = ["| case | µs | TFLOP/s | TB/s | % of roofline | events µs | read-only µs | peer µs (H200) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]

    if args.only != "topk":
        pool_pages = 128 * 2048 + 64
        pool = random_index_pool(pool_pages, g)
        if args.only in (None, "logits"):
            logits_rows(pool, pool_pages, g, flush, args, lines)
        del pool
        torch.cuda.empty_cache()
    if args.only in (None, "topk"):
        topk_rows(g, flush, args, lines)

    table = "\n".join(lines)
    print("\n" + table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")


def logits_rows(pool, pool_pages, g, flush, args, lines) -> None:
    # ---- paged decode logits
    peers = {(1, 32): "5.26 DeepGEMM", (32, 32): "45.2 DeepGEMM", (128, 32): "147.3 DeepGEMM",
             (1, 128): "9.70 DeepGEMM", (32, 128): "147.5 DeepGEMM", (128, 128): "555.9 DeepGEMM"}
    for ctx_k in (32, 128):
        for batch in (1, 32, 128):
            ctx = ctx_k * 1024
            seq = torch.full((batch,), ctx, device="cuda")
            q, w, pt, ri, seq = logits_inputs(pool_pages, batch, ctx // 64, seq, g)
            out = torch.empty(batch, ctx, device="cuda")
            us, note = run_case(lambda: K.indexer_logits(q, w, pool, pt, ri, seq, out=out), flush, args.iters)
            flops, nbytes = count_paged_logits(batch, ctx)
            out = None
            lines.append(row(f"logits decode B={batch} ctx={ctx_k}K H=64", us, flops, nbytes, peers[(batch, ctx_k)], note,
                             read_only_us(nbytes, flush, args.iters)))
            print(lines[-1], flush=True)

    # ---- prefill-shaped logits (one request, causal tail), paged form
    s, skv = 4096, 32768
    seq = torch.arange(s, device="cuda") + (skv - s + 1)
    q, w, pt, ri, seq = logits_inputs(pool_pages, 1, skv // 64, seq, g, num_tokens=s)
    out = torch.empty(s, skv, device="cuda")
    us, note = run_case(lambda: K.indexer_logits(q, w, pool, pt, ri, seq, out=out), flush, max(5, args.iters // 4))
    flops, nbytes = count_prefill_logits(s, skv)
    lines.append(row(f"logits prefill S={s} SKV=32K H=64", us, flops, nbytes, "1817 DeepGEMM (non-paged)", note))
    print(lines[-1], flush=True)


def topk_rows(g, flush, args, lines) -> None:
    # ---- top-k + translation
    topk_cases = [(1, 32, "randn", "13.9 FlashInfer"), (64, 32, "randn", "23.9 FlashInfer"),
                  (128, 32, "randn", "24.6 FlashInfer"), (1, 128, "randn", "16.6 FlashInfer"),
                  (64, 128, "randn", "59.1 FlashInfer"), (128, 128, "randn", "72.5 FlashInfer"),
                  (64, 8, "randn", "12.0 FlashInfer"), (64, 128, "zeros99", "190.4 FlashInfer (CUB 104.2)"),
                  (1, 128, "zeros99", "20.7 FlashInfer")]
    for rows, width_k, kind, peer in topk_cases:
        width = width_k * 1024
        logits = torch.randn(rows, width, generator=g, device="cuda")
        if kind == "zeros99":
            keep = torch.rand(rows, width, generator=g, device="cuda") < 0.01
            logits = torch.where(keep, logits.abs() + 0.1, torch.zeros_like(logits))
        lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        pt = torch.randperm(rows * width // 64, generator=g, device="cuda").view(rows, -1).to(torch.int32)
        ri = torch.arange(rows, dtype=torch.int32, device="cuda")
        slots = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
        us, note = run_case(lambda: K.topk_translate(logits, lengths, pt, ri, TOPK, slots=slots), flush, args.iters)
        flops, nbytes = count_topk(rows, width)
        lines.append(row(f"topk+translate {rows}x{width_k}K k=2048 {kind}", us, flops, nbytes, peer, note,
                         read_only_us(rows * width * 4, flush, args.iters)))
        print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
