"""MTP speculative decoding against plain decoding: `dsa-trt bench` at several batches, one process.

    python benchmarks/bench_spec.py ENGINE_DIR PROMPT_FILE [--batches 1 8 32] [--modes plain mtp fused]

Each (batch, mode) is one `dsa-trt bench --num-prompts max(B, P) --max-num-seqs B --max-tokens 128
--temperature 0 --prompt-file PROMPT_FILE --prompt-len 16 [--speculative mtp]` run through cli.main in
this process (P = --min-prompts, 16: batch 1 decodes every held-out line in turn, not only the first,
and a batch refills as its requests finish),
so the engine's one-time load cost (~40 s of inductor subprocess compiles on the H200) is paid once
rather than per row. Modes: plain; mtp / mtp:N (N drafts; the verify step, then separate draft
passes, DSA_MTP_FUSED=0); fused / fused:N (DSA_MTP_FUSED=1, the default: the verify step runs the
next step's draft passes in the same call). Prints each run's report, then a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys

from dsa_trt.runtime import cli


def run(engine: str, prompts: str, batch: int, mode: str, max_tokens: int, min_prompts: int) -> dict[str, float | str]:
    argv = ["bench", "--engine", engine, "--num-prompts", str(max(batch, min_prompts)), "--max-num-seqs", str(batch),
            "--max-tokens", str(max_tokens), "--temperature", "0", "--prompt-file", prompts, "--prompt-len", "16"]
    method, _, n = mode.partition(":")
    if method != "plain":
        argv += ["--speculative", f"mtp:{n or 1}"]
    os.environ["DSA_MTP_FUSED"] = "1" if method == "fused" else "0"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(argv)
    text = out.getvalue()
    print(f"--- B={batch} {mode} (rc {rc})\n{text}", flush=True)
    if rc != 0:
        raise SystemExit(f"bench B={batch} {mode} failed with rc {rc}")
    row: dict[str, float | str] = {"tok_s": float(re.search(r"([\d.]+) output tok/s", text).group(1))}
    acc = re.search(r"acceptance rate ([\d.]+)%", text)
    per = re.search(r"mean accepted length ([\d.]+) tokens per verify step", text)
    row["acceptance"] = f"{float(acc.group(1)):.1f}%" if acc else "-"
    row["per_step"] = per.group(1) if per else "-"
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", help="an engine directory built with its MTP draft program (trained checkpoint)")
    ap.add_argument("prompts", help="text prompts, one per line (the held-out corpus lines)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--modes", nargs="+", default=["plain", "mtp", "fused"],
                    help="plain, mtp[:N] (separate draft passes), fused[:N] (DSA_MTP_FUSED=1)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-prompts", type=int, default=16,
                    help="prompts per row at least (a batch of B decodes max(B, this) prompts, B at a time)")
    a = ap.parse_args()
    if a.min_prompts < 1:
        ap.error(f"--min-prompts {a.min_prompts} must be >= 1")
    for m in a.modes:
        if m != "plain" and not re.fullmatch(r"(mtp|fused)(:\d+)?", m):
            ap.error(f"--modes: {m!r} is not plain, mtp[:N] or fused[:N]")
    rows = {(b, m): run(a.engine, a.prompts, b, m, a.max_tokens, a.min_prompts) for b in a.batches for m in a.modes}
    print("| batch | mode | output tok/s | vs plain | drafts accepted | tokens per step |")
    print("|---:|---|---:|---:|---:|---:|")
    for (b, m), r in rows.items():
        base = rows.get((b, "plain"))
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        print(f"| {b} | {m} | {r['tok_s']:.1f} | {ratio} | {r['acceptance']} | {r['per_step']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
