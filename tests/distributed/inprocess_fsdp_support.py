"""Helpers that the FSDP2 in-process recovery tests share (test_inprocess_fsdp_peers,
test_inprocess_cascade): ``scripts/inproc_fsdp_train.py`` on two local "nodes" through
``hpc run --recovery inprocess``, ranks SIGKILLed together, the job's events, each worker's
result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from tests.distributed.inprocess_support import lines

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_fsdp_train.py"
STEPS = 14


def hpc_run(out: Path, job: Path, *extra: str, nproc: int = 2, window_s: int = 60,
            steps: int = STEPS, script_args: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S=str(window_s),
               HPC_INPROC_COPY_EVERY="2")
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nodes", "2",
                             "--nproc-per-node", str(nproc), "--recovery", "inprocess", "--max-restarts", "3",
                             "--job-dir", str(job), *extra,
                             "--", "--out", str(out), "--steps", str(steps), "--step-sleep", "0.15",
                             *script_args],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_ranks(run: subprocess.Popen, out: Path, ranks: set[int], after: int, deadline: float,
               ready: Callable[[], bool] = lambda: True) -> list[int]:
    """SIGKILLs the workers of ``ranks`` at once, when each has run ``after`` steps and ``ready()``."""
    while True:
        assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
        ran = lines(out)
        pick = {r[0]["rank"]: pid for pid, r in ran.items() if r and r[0]["rank"] in ranks and len(r) >= after}
        if set(pick) == ranks and ready():
            for pid in pick.values():
                os.kill(pid, signal.SIGKILL)
            return sorted(pick.values())
        time.sleep(0.05)


def events(job: Path) -> list[dict]:
    return [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]


def results(out: Path) -> dict[int, dict]:
    return {r["pid"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}
