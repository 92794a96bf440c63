"""benchmarks/bench_parallel.py (issue 28's multi-GPU tables) on CPU processes over gloo: the whole
command runs at the tiny widths, its equality table says the 2-rank EP and CP x EP networks equal
one rank, and its decode and prefill tables hold measured rows. The numbers behind the equality
are tests/test_expert_parallel.py's and test_context_parallel.py's; this keeps the benchmark that
the 8-GPU run will use from rotting on machines without GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_parallel_two_ranks_on_cpu(tmp_path):
    out = tmp_path / "parallel.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_parallel.py"), "--ranks", "2", "--device", "cpu",
         "--batches", "2", "--context", "256", "--prefill", "128", "--iters", "1", "--eq-steps", "2",
         "--eq-batch", "2", "--timeout-s", "120", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["ranks"] == 2 and got["device"] == "cpu"
    assert [r["network"] for r in got["equality"]] == ["EP=2, DP attention", "CP=2 x EP=2"]
    for r in got["equality"]:
        assert "error" not in r, r
        assert r["agree"] == r["total"] > 0, r  # the 2-rank greedy tokens equal one rank's
        assert r["rel_l2"] <= 1e-3, r
    decode = [r for r in got["decode"] if r["mode"] == "eager"]
    assert len(decode) == 1 and "error" not in decode[0]
    assert 0 < decode[0]["exchange"] < decode[0]["layer"] < decode[0]["step"]
    assert decode[0]["sent"] > 0  # pairs left for the other rank's experts
    (pre,) = got["prefill"]
    assert pre["tokens"] == 128 and "error" not in pre and pre["us"] > 0 and pre["one_rank_us"] > 0
    assert "| EP=2, DP attention |" in proc.stdout and "bench_parallel: 2 ranks on cpu" in proc.stdout
