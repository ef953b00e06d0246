"""When a warning stops the Session's loop, and when it does not.

A real Session (a world of one, gloo) in a subprocess that sends itself SIGUSR2 inside the
body of a chosen step. A warning during the last step must not turn finished work into a
stop (which would cost a requeue and an allocation that has nothing to do); a warning
before it stops the loop at that step's boundary and records the exit intent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed

SCRIPT = """
import json, os, signal, sys
from runtime.session import Session

job, signal_at, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
done = []
with Session(job_dir=job) as s:
    for step in s.steps(0, stop):
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR2)
        done.append(step)
    print(json.dumps({"done": done, "stopped": s.stopped.kind if s.stopped else None}))
"""


def run_session(job: Path, signal_at: int, stop: int) -> dict:
    env = {"PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO),
           "HPC_JOB_END_TIME": "0"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(job), str(signal_at), str(stop)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_warning_in_the_last_step_finishes_the_work(tmp_path: Path):
    out = run_session(tmp_path / "job", signal_at=4, stop=5)
    assert out == {"done": [0, 1, 2, 3, 4], "stopped": None}
    assert not (tmp_path / "job" / "exit-intent.json").exists(), "finished work must not ask for a requeue"


def test_warning_before_the_last_step_stops_at_that_boundary(tmp_path: Path):
    out = run_session(tmp_path / "job", signal_at=2, stop=5)
    assert out["done"] == [0, 1, 2] and out["stopped"] is not None
    intent = json.loads((tmp_path / "job" / "exit-intent.json").read_text())
    assert intent["kind"] == out["stopped"]
