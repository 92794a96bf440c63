"""Whole DSA decode attention per layer (indexer logits + top-k/translate + sparse MLA, s_q=1) on
the paged fp8 caches, beside FlashMLA's dense decode on the same H200 (measured once, quoted).

    python benchmarks/bench_dsa_decode.py [--batches 1 128] [--context 131072] [--iters 20]

Every column (each piece alone and the whole chain) is its own CUDA graph, replayed after an L2
flush (pools scattered at random), median of --iters: "P (E)" = P µs from the profiler (first
kernel start to last kernel end, the peers' measure), E µs from CUDA events around the replay
(timing.time_both_us).
"""

from __future__ import annotations

import argparse
import sys

import torch

from timing import time_both_us

from dsa_trt.config import PAGE_SIZE
from dsa_trt.plugins import cuda_ops

HEADS, INDEX_HEADS, TOPK = 128, 64, 2048
DENSE_FLASHMLA_US = {1: 84.0, 128: 7597.0}  # FlashMLA dense decode measured on the H200, 128K, bf16 KV
PEERS_PIECES_US = {1: 98.0, 128: 1023.0}  # DeepGEMM logits + FlashInfer top-k + FlashMLA sparse
TARGET_US = {1: 34.0, 128: 760.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dsa_decode: needs a CUDA GPU (Hopper, sm_90a) and `make kernels`; none is visible here")
    cuda_ops.load("cuda")
    dev = "cuda"
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    print("| batch | context | logits µs | top-k µs | sparse MLA µs | DSA total µs | FlashMLA dense µs | "
          "peers' pieces µs | target µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in a.batches:
        pages = a.context // PAGE_SIZE
        num_pages = b * pages
        idx_pool = torch.randint(0, 120, (num_pages, PAGE_SIZE * 132), dtype=torch.uint8, device=dev)
        idx_pool.view(num_pages, -1)[:, PAGE_SIZE * 128:].view(torch.float32).uniform_(0.5, 1.5)
        mla_pool = torch.randint(0, 120, (num_pages, PAGE_SIZE, 576), dtype=torch.uint8, device=dev)
        table = torch.randperm(num_pages, device=dev, dtype=torch.int64).to(torch.int32).view(b, pages)
        req = torch.arange(b, dtype=torch.int32, device=dev)
        lens = torch.full((b,), a.context, dtype=torch.int32, device=dev)
        q_i = (torch.randn(b, INDEX_HEADS, 128, device=dev)).to(torch.float8_e4m3fn)
        w = torch.rand(b, INDEX_HEADS, device=dev)
        q = torch.randn(b, HEADS, 576, device=dev, dtype=torch.bfloat16)
        ops = torch.ops.dsa
        logits = ops.indexer_logits(q_i, w, idx_pool, table, req, lens)
        slots = ops.topk_translate(logits, lens, table, req, TOPK)
        def timed(fn):  # "profiler µs (events µs)"
            ev, kern = time_both_us(fn, flush, a.iters)
            return f"{kern:.1f} ({ev:.1f})" if kern is not None else f"— ({ev:.1f})"

        t_logits = timed(lambda: ops.indexer_logits(q_i, w, idx_pool, table, req, lens))
        t_topk = timed(lambda: ops.topk_translate(logits, lens, table, req, TOPK))
        t_mla = timed(lambda: ops.sparse_mla(q, mla_pool, slots, 0.01, 0.1352))

        def chain():
            lg = ops.indexer_logits(q_i, w, idx_pool, table, req, lens)
            sl = ops.topk_translate(lg, lens, table, req, TOPK)
            return ops.sparse_mla(q, mla_pool, sl, 0.01, 0.1352)

        total = timed(chain)
        print(f"| {b} | {a.context} | {t_logits} | {t_topk} | {t_mla} | {total} | "
              f"{DENSE_FLASHMLA_US.get(b, float('nan'))} | "
              f"{PEERS_PIECES_US.get(b, float('nan'))} | {TARGET_US.get(b, float('nan'))} |", flush=True)
        del idx_pool, mla_pool, logits, slots
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
