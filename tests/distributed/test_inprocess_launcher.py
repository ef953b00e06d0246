"""``hpc run --recovery inprocess``: the launcher announces a dead worker and restarts nobody.

The real launcher and torch's elastic agent on this machine (3 workers, gloo). A worker is
SIGKILLed mid-run (with --max-restarts 0: no joiner replaces it, test_inprocess_join.py does
that): the launcher sees its child die and announces it in the rendezvous store,
so the survivors re-form at once (the join window is set to 60 s here: without the
announcement the re-form would wait for it), torch's agent restarts none of them, and the job
finishes at world 2 with the survivors' processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"


def test_the_launcher_announces_a_dead_worker_and_restarts_no_survivor(tmp_path: Path):
    out, job = tmp_path / "out", tmp_path / "job dir"
    out.mkdir()
    env = dict(os.environ, HPC_INPROC_WINDOW_S="60", WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    run = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "3",
                            "--recovery", "inprocess", "--max-restarts", "0", "--job-dir", str(job), "--", "--out", str(out),
                            "--steps", "20"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    victim = None
    while victim is None:
        assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
        for f in out.glob("steps-*.jsonl"):
            lines = f.read_text().splitlines()
            if len(lines) >= 6 and json.loads(lines[0])["rank"] == 2:
                victim = int(f.stem.split("-")[1])
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    text, _ = run.communicate(timeout=240)
    assert run.returncode == 0, text[-4000:]
    pids = {int(f.stem.split("-")[1]) for f in out.glob("steps-*.jsonl")}
    assert len(pids) == 3, f"torch restarted workers: {sorted(pids)}"   # no new process
    results = [json.loads(f.read_text()) for f in out.glob("result-*.json")]
    assert sorted(r["pid"] for r in results) == sorted(pids - {victim})
    assert {r["step"] for r in results} == {20} and {r["world"] for r in results} == {2}
    assert len({r["weights"] for r in results}) == 1
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    detect = [e for e in events if e["ev"] == "inproc_detect"]
    assert [e["pid"] for e in detect] == [victim] and detect[0]["exit"] == "signal 9"
    rec = [e for e in events if e["ev"] == "inproc_recovery"]
    assert len(rec) == 1 and rec[0]["world_size"] == 2, rec
    # The launcher's word ended the wait for the dead worker (the window is 60 s).
    assert rec[0]["t_reform"] - rec[0]["t_abort"] < 10, rec[0]
