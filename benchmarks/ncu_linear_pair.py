"""Drive one fp8 block linear and cuBLASLt's blockwise _scaled_mm on the same inputs, once each, for a
profiler to compare the two GEMM kernels (no timing here: bench_fp8_linear.py times them).

    ncu --clock-control none --set full --import-source yes -k 'regex:fp8_gemm_ws_kernel|nvjet' -c 2 \\
        -o gemm python3 benchmarks/ncu_linear_pair.py [T N K]

Default shape: dense gate+up at T=4096 (4096 x 36864 x 7168). The comparison of 2026-12-07 and
what it showed: docs/history/2026-12-07-fp8-gemm-stages-raster-order.md.
"""

from __future__ import annotations

import sys

import torch

from bench_fp8_linear import Linear, random_weight, scaled_mm_fn

from dsa_trt.plugins import cuda_ops


def main(argv: list[str]) -> int:
    if len(argv) not in (0, 3) or not all(a.isdigit() and int(a) > 0 for a in argv):
        print("usage: ncu_linear_pair.py [T N K] (positive integers)", file=sys.stderr)
        return 2
    t, n, k = (int(a) for a in argv) if argv else (4096, 36864, 7168)
    cuda_ops.load("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    w8, ws = random_weight(n, k, g)
    x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
    ours = Linear(x, w8, ws)
    anchor, err = scaled_mm_fn(x, w8, ws)
    torch.cuda.synchronize()
    ours()
    if anchor is not None:
        anchor()
    torch.cuda.synchronize()
    print(f"T={t} N={n} K={k}: ours ran; _scaled_mm {'ran' if anchor is not None else 'refused: ' + err}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
