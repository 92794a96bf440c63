"""Does a row's result depend on how many rows share the call? Each GEMM-like op of a decoder step,
at DeepSeek-V3.2's shapes, on the H200.

    python benchmarks/row_invariance.py [--quick]

For every op: X holds max(T) random rows; the op runs on X[:16] (the deterministic mode's smallest
step: StepInputs.pad_tokens(16)) and on X[:T] for each T; a T "differs" when any of the first
min(T, 16) output rows is not bitwise equal to the T = 16 call's. Ops: torch.ops.dsa.fp8_block_linear
with the plan's own K splits, with DSA_FP8_LINEAR_SPLITS=1 (the deterministic mode), and with each
GEMM path forced at one split; torch.ops.dsa.moe_experts; torch.ops.dsa.sparse_mla with its own
split-KV plan and with DSA_MLA_SPLITS=1; cuBLAS through F.linear in bf16 (the bf16 checkpoints'
linears) and fp32 (the router, the indexer's weights_proj, the Hadamard rotation, the fp32
lm_head) and the bf16 GEMM with fp32 output (torch.mm out_dtype: the lm_head without an fp32 copy
of its weight) and torch.ops.dsa.f32_linear on 128-row GEMMs (DSA_F32_LINEAR_ROWS=128, the
deterministic mode's), each form's time beside the others (as benchmarks/timing.py times); the
absorbed attention's bf16 einsums with W_uk / W_uv (cuBLAS batched GEMMs over the heads). The
engine's batch invariance is the AND of these rows (tests/test_gpu_invariance.py checks it end to end). GPU only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from timing import time_both_us

from dsa_trt.plugins import cuda_ops
from dsa_trt.runtime.knobs import scoped_env

TS = [1, 8, 16, 32, 48, 64, 65, 80, 128, 256, 1024, 4096]
QUICK_TS = [1, 16, 32, 48, 64, 80, 256, 4096]
BASE = 16
FP8_SHAPES = [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("kv_a", 576, 7168), ("o_proj", 7168, 16384),
              ("indexer wq_b", 8192, 1536), ("dense down", 7168, 18432)]
FP32_SHAPES = [("router", 256, 7168), ("indexer weights_proj", 64, 7168),
               ("Hadamard (a row per token x head)", 128, 128), ("lm_head", 129280, 7168)]


def random_e4m3(shape, g: torch.Generator) -> torch.Tensor:
    return (torch.randint(0, 256, shape, generator=g, device="cuda", dtype=torch.uint8) & 0xB7).view(
        torch.float8_e4m3fn)


def differing(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, ts: list[int]) -> tuple[list[int], float]:
    """The T whose first rows differ from the T = BASE call's, and the largest relative difference."""
    base = fn(x[:BASE]).float()
    bad, worst = [], 0.0
    for t in ts:
        r = min(t, BASE)
        out = fn(x[:t])[:r].float()
        if not torch.equal(out, base[:r]):
            bad.append(t)
            worst = max(worst, float(((out - base[:r]).abs().max() / base[:r].abs().max().clamp(min=1e-30))))
    return bad, worst


def row(name: str, shape: str, bad: list[int], worst: float, ts: list[int]) -> str:
    verdict = "invariant" if not bad else "differs at T = " + ", ".join(map(str, bad))
    return f"| {name} | {shape} | {len(ts) - len(bad)}/{len(ts)} | {verdict} | {worst:.1e} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TS}")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("row_invariance: needs a CUDA GPU", file=sys.stderr)
        return 2
    cuda_ops.load("cuda")
    ts = QUICK_TS if a.quick else TS
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"rows 0..{BASE - 1} of X[:T] against X[:{BASE}], T in {ts}; 'same' counts the T that match bitwise")
    print("| op | N x K | same | result | max rel diff |")
    print("|---|---|---:|---|---:|")
    for name, n, k in FP8_SHAPES:
        x = torch.randn(max(ts), k, generator=g, device="cuda").to(torch.bfloat16)
        w8 = random_e4m3((n, k), g)
        ws = torch.rand(-(-n // 128), -(-k // 128), generator=g, device="cuda") * 1e-2 + 1e-3
        fn = lambda v: torch.ops.dsa.fp8_block_linear(v, w8, ws, True)
        for label, kv in (("plan", {}), ("splits 1", {"DSA_FP8_LINEAR_SPLITS": "1"}),
                          ("splits 1, tma-swap", {"DSA_FP8_LINEAR_SPLITS": "1", "DSA_FP8_LINEAR_PATH": "tma-swap"}),
                          ("splits 1, tma", {"DSA_FP8_LINEAR_SPLITS": "1", "DSA_FP8_LINEAR_PATH": "tma"})):
            with scoped_env({"DSA_FP8_LINEAR_SPLITS": None, "DSA_FP8_LINEAR_PATH": None, **kv}):
                print(row(f"fp8_block_linear {name} ({label})", f"{n} x {k}", *differing(fn, x, ts), ts), flush=True)
        wb = (w8.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(torch.bfloat16)
        print(row(f"F.linear bf16 {name}", f"{n} x {k}", *differing(lambda v: F.linear(v, wb), x, ts), ts), flush=True)
        del w8, ws, wb
    for name, n, k in FP32_SHAPES:
        x = torch.randn(max(ts), k, generator=g, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        wf = w.float()
        print(row(f"F.linear fp32 {name}", f"{n} x {k}", *differing(lambda v: F.linear(v.float(), wf), x, ts), ts),
              flush=True)
        print(row(f"mm bf16 -> fp32 {name}", f"{n} x {k}",
                  *differing(lambda v: torch.mm(v, w.t(), out_dtype=torch.float32), x, ts), ts), flush=True)
        with scoped_env({"DSA_F32_LINEAR_ROWS": "128"}):  # the deterministic mode's fixed-row GEMMs
            print(row(f"dsa::f32_linear {name} (DSA_F32_LINEAR_ROWS=128)", f"{n} x {k}",
                      *differing(lambda v: torch.ops.dsa.f32_linear(v, w), x, ts), ts), flush=True)
        same = torch.equal(torch.mm(x[:BASE], w.t(), out_dtype=torch.float32), F.linear(x[:BASE].float(), wf))
        diff = float((torch.mm(x[:BASE], w.t(), out_dtype=torch.float32) - F.linear(x[:BASE].float(), wf)).abs().max())
        print(f"|   mm bf16 -> fp32 vs F.linear fp32, {name}, T = {BASE} | | | {'equal' if same else 'not equal'} "
              f"| {diff:.1e} abs |", flush=True)
        # the cost of each form (timing.py: CUDA graph, L2 flushed): the lm_head's fp32 copy of the
        # head per step, cuBLAS fp32 (the weight already fp32) for the others
        flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
        for t in (1, 32) if name == "lm_head" else (16, 4096):
            h = x[:t].contiguous()
            fp32 = (lambda: F.linear(h.float(), w.float())) if name == "lm_head" else (lambda: F.linear(h.float(), wf))
            cast = time_both_us(fp32, flush, 20)[0]
            mm = time_both_us(lambda: torch.mm(h, w.t(), out_dtype=torch.float32), flush, 20)[0]
            with scoped_env({"DSA_F32_LINEAR_ROWS": "128"}):
                rows128 = time_both_us(lambda: torch.ops.dsa.f32_linear(h, w), flush, 20)[0]
            print(f"|   {name} {n} x {k}, T = {t}: F.linear fp32 {cast:.1f} µs, mm bf16 -> fp32 {mm:.1f} µs, "
                  f"f32_linear in 128-row GEMMs {rows128:.1f} µs | | | | |", flush=True)
        del w, wf
    # the absorbed attention's bf16 batched products (export/network.py: q_nope x W_uk, o_lat x W_uv;
    # kv_b stays bf16), 128 heads of V3.2: cuBLAS batched GEMMs whose M is the step's token count
    heads, nope, lat, v_dim = 128, 128, 512, 128
    w_uk = (torch.randn(heads, nope, lat, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    w_uv = (torch.randn(heads, v_dim, lat, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    q_nope = torch.randn(max(ts), heads, nope, generator=g, device="cuda").to(torch.bfloat16)
    o_lat = torch.randn(max(ts), heads, lat, generator=g, device="cuda").to(torch.bfloat16)
    print(row("einsum bf16 q_nope x W_uk (absorbed attention)", f"{heads} x {nope} x {lat}",
              *differing(lambda v: torch.einsum("thd,hdc->thc", v, w_uk), q_nope, ts), ts), flush=True)
    print(row("einsum bf16 o_lat x W_uv (absorbed attention)", f"{heads} x {lat} x {v_dim}",
              *differing(lambda v: torch.einsum("thc,hvc->thv", v, w_uv), o_lat, ts), ts), flush=True)
    del w_uk, w_uv, q_nope, o_lat
    # the routed experts: 16 local experts of 256 (expert-parallel rank 0 of 16), real D and I
    e_local, experts, top_k, d, i = 16, 256, 8, 7168, 2048
    w13 = random_e4m3((e_local, 2 * i, d), g)
    w2 = random_e4m3((e_local, d, i), g)
    s13 = torch.rand(e_local, 2 * i // 128, d // 128, generator=g, device="cuda") * 1e-3 + 1e-4
    s2 = torch.rand(e_local, d // 128, i // 128, generator=g, device="cuda") * 1e-3 + 1e-4
    t_max = max(ts)
    x = torch.randn(t_max, d, generator=g, device="cuda").to(torch.bfloat16)
    # each token: 8 distinct experts, two of them local (e, e + 8) so every row computes something
    local = torch.randint(0, 8, (t_max, 1), generator=g, device="cuda")
    remote = torch.rand(t_max, experts - 16, generator=g, device="cuda").topk(top_k - 2, dim=1).indices + 16
    ids = torch.cat([local, local + 8, remote], dim=1).sort(dim=1).values.to(torch.int32).contiguous()
    wts = torch.rand(t_max, top_k, generator=g, device="cuda") * 0.3
    moe = lambda v: torch.ops.dsa.moe_experts(v, ids[: v.shape[0]], wts[: v.shape[0]], w13, s13, w2, s2,
                                              experts, 0, True)
    print(row("moe_experts (16 of 256 experts, top-8)", f"D {d}, I {i}", *differing(moe, x, ts), ts), flush=True)
    del w13, w2
    # sparse MLA over the fp8 latent pool: 2048 scattered keys per query row (split-KV at small T)
    pages, topk, dim = 512, 2048, 576
    pool = (torch.randn(pages * 64, dim, generator=g, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    pool = pool.view(torch.uint8).view(pages, 64, dim)
    for heads in (16, 128):
        q = (torch.randn(t_max, heads, dim, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
        slots = torch.stack([torch.randperm(pages * 64, generator=g, device="cuda")[:topk]
                             for _ in range(t_max)]).to(torch.int32)
        mla = lambda v, q=q, slots=slots: torch.ops.dsa.sparse_mla(v, pool, slots[: v.shape[0]], 0.01,
                                                                     dim**-0.5)[0]
        for label, kv in (("auto splits", {}), ("DSA_MLA_SPLITS=1", {"DSA_MLA_SPLITS": "1"})):
            with scoped_env({"DSA_MLA_SPLITS": None, **kv}):
                print(row(f"sparse_mla fp8, {heads} heads ({label})", f"top-k {topk}", *differing(mla, q, ts), ts),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
