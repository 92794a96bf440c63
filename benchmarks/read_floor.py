"""Read floors of the memory-bound rows: what a kernel that only reads the same bytes takes.

For the decode-logits shapes of issue 3 (H=64, pages of 64 fp8 keys + scales, 8448 bytes, a random
permutation of a 2.2 GB pool) and the top-k's 64 x 128K fp32 scores, next to our kernel:
  * contiguous read: the same number of bytes from one buffer, every load in flight at once
    (16-byte cp.async per thread, 4 / 8 / 12 per thread; or one bulk copy of 16 / 32 KB per CTA);
  * paged read (logits only): the request's own pages through its page table, 1 / 2 / 4 pages per
    CTA (the ids first, one dependent load, then every 16 bytes of the pages by cp.async).
Every read is evict-first, into shared memory, with one conditional store at the end. The best
variant of each kind is reported. Profiler span (first kernel start to last kernel end, median of
--iters calls) after the benchmarks' dirty flush (256 MB overwritten: L2 full of dirty lines) and
after a clean one (the same, then 256 MB read). Needs CuPy (the H200 image has it):

    python benchmarks/read_floor.py [--iters 15]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_indexer_topk import logits_inputs, random_index_pool  # noqa: E402
from timing import kernel_names, kernel_span_us  # noqa: E402

from dsa_trt.plugins import cuda_ops as K  # noqa: E402

PAGE_BYTES = 8448
KERNELS = r"""
// == V 16-byte cp.async per thread, all in flight (no register destination), one shared read
extern "C" __global__ void __launch_bounds__(256) read_cpasync(const uint4* __restrict__ p, long long nvec, unsigned* out) {
  __shared__ __align__(16) uint4 buf[256 * V];
  const long long base = (long long)blockIdx.x * (256 * V) + threadIdx.x;
  #pragma unroll
  for (int u = 0; u < V; ++u) {
    long long i = base + u * 256;
    i = i < nvec ? i : nvec - 1;
    const unsigned dst = (unsigned)__cvta_generic_to_shared(buf + u * 256 + threadIdx.x);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" :: "r"(dst), "l"(p + i), "l"(0x12F0000000000000ull) : "memory");
  }
  asm volatile("cp.async.commit_group;\n cp.async.wait_all;" ::: "memory");
  if (buf[threadIdx.x].x == 0x9E3779B9u) out[0] = 1;
}
// == one bulk copy (TMA) of V bytes per CTA into shared memory
extern "C" __global__ void __launch_bounds__(128) read_bulk(const char* __restrict__ p, long long nbytes, unsigned* out) {
  __shared__ __align__(128) uint4 buf[V / 16];
  __shared__ __align__(8) unsigned long long bar;
  const long long off = (long long)blockIdx.x * V;
  const unsigned n = (unsigned)(nbytes - off < V ? nbytes - off : V);
  const unsigned sbar = (unsigned)__cvta_generic_to_shared(&bar), sbuf = (unsigned)__cvta_generic_to_shared(buf);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(sbar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(sbar), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(sbuf), "l"(p + off), "r"(n), "r"(sbar), "l"(0x12F0000000000000ull) : "memory");
  }
  __syncthreads();
  asm volatile("{\n .reg .pred P;\n W: mbarrier.try_wait.parity.shared.b64 P, [%0], 0;\n @!P bra W;\n}" :: "r"(sbar) : "memory");
  if (buf[threadIdx.x].x == 0x9E3779B9u) out[0] = 1;
}
// == V pages of 8448 bytes (528 vectors) per CTA through a page table: the ids first, then cp.async
extern "C" __global__ void __launch_bounds__(256) read_paged(const uint4* __restrict__ pool, const int* __restrict__ table, int npages, unsigned* out) {
  constexpr int kV = (528 * V + 255) / 256;
  __shared__ __align__(16) uint4 buf[256 * kV];
  __shared__ int ids[V];
  if (threadIdx.x < V) ids[threadIdx.x] = blockIdx.x * V + threadIdx.x < npages ? table[blockIdx.x * V + threadIdx.x] : -1;
  __syncthreads();
  #pragma unroll
  for (int u = 0; u < kV; ++u) {
    const int j = u * 256 + threadIdx.x, pg = j / 528;
    const int id = pg < V ? ids[pg] : -1;
    const unsigned dst = (unsigned)__cvta_generic_to_shared(buf + j);
    if (id >= 0) asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" :: "r"(dst), "l"(pool + (long long)id * 528 + j % 528), "l"(0x12F0000000000000ull) : "memory");
  }
  asm volatile("cp.async.commit_group;\n cp.async.wait_all;" ::: "memory");
  if (buf[threadIdx.x].x == 0x9E3779B9u) out[0] = 1;
}
"""


class Readers:
    """The read kernels (CuPy RawKernel, one module per variant: V is a #define)."""

    def __init__(self, cp):
        self.cp = cp
        parts = {re.search(r"__launch_bounds__\(\d+\) (\w+)\(", p).group(1): "//" + p for p in KERNELS.split("// ==")[1:]}
        self.k = {(name, v): cp.RawKernel(f"#define V {v}\n" + parts[name], name, options=("-std=c++17",))
                  for name, vs in (("read_cpasync", (4, 8, 12)), ("read_bulk", (16384, 32768)), ("read_paged", (1, 2, 4)))
                  for v in vs}
        self.out = torch.zeros(4, dtype=torch.int32, device="cuda")
        self.stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def contiguous(self, t: torch.Tensor, name: str, v: int):
        cp, nbytes = self.cp, t.numel() * t.element_size()
        if name == "read_cpasync":
            nvec = nbytes // 16
            grid, block, args = (nvec + 256 * v - 1) // (256 * v), 256, (cp.int64(nvec),)
        else:
            grid, block, args = (nbytes + v - 1) // v, 128, (cp.int64(nbytes),)
        kern = self.k[(name, v)]

        def run():
            with self.stream:
                kern((grid,), (block,), (cp.uint64(t.data_ptr()), *args, cp.uint64(self.out.data_ptr())))
        return run

    def paged(self, pool: torch.Tensor, table: torch.Tensor, v: int):
        cp, n, kern = self.cp, table.numel(), self.k[("read_paged", v)]

        def run():
            with self.stream:
                kern(((n + v - 1) // v,), (256,), (cp.uint64(pool.data_ptr()), cp.uint64(table.data_ptr()), cp.int32(n),
                                                   cp.uint64(self.out.data_ptr())))
        return run


def span_us(run, flush, iters: int) -> float:
    """Profiler span of one call after flush() (timing.kernel_span_us, the flush's own kernels
    separating the calls), after 3 warm-up calls."""
    for _ in range(3):
        run()
    return kernel_span_us(run, flush, iters, flush_kernels=kernel_names(flush))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    try:
        import cupy as cp
    except ImportError:
        sys.exit("read_floor.py needs CuPy for its read kernels (pip install cupy-cuda13x)")
    assert K.library() is not None, K.library_error()
    readers = Readers(cp)
    g = torch.Generator(device="cuda").manual_seed(0)
    dirty_buf = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    clean_buf = torch.zeros(64 << 20, dtype=torch.int32, device="cuda")
    flushes = {"dirty": lambda: dirty_buf.bitwise_not_(), "clean": lambda: (dirty_buf.bitwise_not_(), clean_buf.sum())}
    print("| case | MB read | flush | ours µs | paged read µs | contiguous read µs | ours / paged read | ours / contiguous |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")

    def row(case, nbytes, ours, paged, contiguous):
        for fl, flush in flushes.items():
            t_ours = span_us(ours, flush, args.iters)
            t_paged = min(span_us(r, flush, args.iters) for r in paged) if paged else None
            t_cont = min(span_us(r, flush, args.iters) for r in contiguous)
            print(f"| {case} | {nbytes / 1e6:.1f} | {fl} | {t_ours:.1f} | " + (f"{t_paged:.1f}" if paged else "—") +
                  f" | {t_cont:.1f} | " + (f"{t_ours / t_paged:.2f}" if paged else "—") + f" | {t_ours / t_cont:.2f} |",
                  flush=True)

    pool_pages = 128 * 2048 + 64
    pool = random_index_pool(pool_pages, g)
    for batch, ctx_k in ((1, 32), (1, 128), (32, 32), (32, 128), (128, 128)):
        npg = ctx_k * 16
        seq = torch.full((batch,), ctx_k * 1024, device="cuda")
        q, w, pt, ri, seq = logits_inputs(pool_pages, batch, npg, seq, g)
        out = torch.empty(batch, ctx_k * 1024, device="cuda")
        nbytes = batch * npg * PAGE_BYTES
        flat = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_()
        row(f"logits decode B={batch} ctx={ctx_k}K H=64", nbytes,
            lambda: K.indexer_logits(q, w, pool, pt, ri, seq, out=out),
            [readers.paged(pool, pt.view(-1), v) for v in (1, 2, 4)],
            [readers.contiguous(flat, "read_cpasync", v) for v in (4, 8, 12)] +
            [readers.contiguous(flat, "read_bulk", v) for v in (16384, 32768)])
        del flat
    del pool
    torch.cuda.empty_cache()
    rows, width = 64, 131072
    lg = torch.randn(rows, width, generator=g, device="cuda")
    lens = torch.full((rows,), width, dtype=torch.int32, device="cuda")
    table = torch.randperm(rows * width // 64, device="cuda", generator=g).to(torch.int32).view(rows, width // 64)
    req = torch.arange(rows, dtype=torch.int32, device="cuda")
    row(f"topk+translate {rows}x{width // 1024}K k=2048 randn", lg.numel() * 4,
        lambda: K.topk_translate(lg, lens, table, req, 2048), [],
        [readers.contiguous(lg, "read_cpasync", v) for v in (4, 8, 12)] +
        [readers.contiguous(lg, "read_bulk", v) for v in (16384, 32768)])


if __name__ == "__main__":
    main()
