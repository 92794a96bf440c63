"""A rank that dies stops the others with an error naming it, within a bound (docs/architecture.md §7).

Two real rank processes (the environment torchrun gives them) serve a context-parallel eager
engine over gloo: rank 0 drives decode steps (broadcast + the program's all-gathers and
all-reduce), rank 1 mirrors them. The test SIGKILLs one rank mid-stream and requires the other
to exit non-zero within BOUND_S with a RankFailure naming the dead rank and its pid. The gloo
timeout (DSA_DIST_TIMEOUT_S) is set far above the bound, so passing shows the failure is seen
when the peer's connection drops, not by waiting out the timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers.ranks import free_port

REPO = Path(__file__).resolve().parents[1]
START_S = 240  # two torch imports and network builds on a busy 2-core machine
BOUND_S = 30


def _launch(rank: int, world: int, port: int, ckpt: Path, marker: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), DSA_DIST_TIMEOUT_S="300")
    code = f"from tests.helpers.ranks import serve_until_killed; serve_until_killed({str(ckpt)!r}, {str(marker)!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_dead_rank_stops_the_other_with_its_name(tiny_ckpt, tmp_path, victim):
    world, port, marker = 2, free_port(), tmp_path / "steps-flow"
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs = [_launch(r, world, port, tiny_ckpt, marker, logs[r]) for r in range(world)]
    try:
        t0 = time.monotonic()
        while not marker.exists():
            assert all(p.poll() is None for p in procs), "a rank exited before the steps started:\n" + "\n".join(
                log.read_text() for log in logs)
            assert time.monotonic() - t0 < START_S, "the ranks did not start stepping within START_S"
            time.sleep(0.2)
        dead = procs[victim]
        os.kill(dead.pid, signal.SIGKILL)
        survivor = procs[1 - victim]
        t_kill = time.monotonic()
        try:
            rc = survivor.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {1 - victim} still runs {BOUND_S} s after rank {victim} was killed (a hang):\n"
                        + logs[1 - victim].read_text())
        took = time.monotonic() - t_kill
        out = logs[1 - victim].read_text()
        assert rc != 0, f"rank {1 - victim} exited 0 after its peer died:\n{out}"
        assert "RankFailure" in out and f"rank {victim} (pid {dead.pid}) exited" in out, out
        print(f"[rank failure] rank {victim} killed: rank {1 - victim} stopped in {took:.1f} s: "
              + next(line for line in out.splitlines() if "RankFailure:" in line))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
