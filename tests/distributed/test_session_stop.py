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


# Two ranks; at step 3 rank 0 writes the stop notice as node 0's launcher does once Slurm
# answered (a preemption whose real end is 1 s away, while the workers' own estimate, from
# HPC_JOB_END_TIME within the lead, is a time limit a minute away), then both get SIGUSR2.
TWO_RANKS = """
import json, os, signal, sys, time
from runtime.session import Session

job, notice = sys.argv[1], sys.argv[2]
with Session(job_dir=job) as s:
    for step in s.steps(0, 1000):
        if step == 3:
            if s.rank == 0:
                now = time.time()
                with open(notice + ".tmp", "w") as f:
                    json.dump({"allocation": 0, "kind": "preempted", "signal": "SIGUSR2",
                               "received_at": now, "deadline": now + 1.0,
                               "assumed_deadline": now + 60.0, "slurm_deadline": now + 1.0,
                               "query": "answered"}, f)
                os.replace(notice + ".tmp", notice)
            os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
    print(json.dumps({"step": s.step, "kind": s.stopped.kind, "deadline": s.stopped.deadline}))
"""


def test_ranks_plan_the_stop_against_slurms_earlier_deadline_from_the_notice(tmp_path: Path):
    """The stop notice's real deadline (issue 23) reaches every rank's plan: no save is tried
    in the 1 s left, the stop is the preemption Slurm named, and all ranks agree on both."""
    import socket
    import time

    job, notice = tmp_path / "job", tmp_path / "stop.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {"PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO),
               "HPC_JOB_END_TIME": f"{time.time() + 60:.0f}", "HPC_STOP_FILE": str(notice),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(job), str(notice)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert results[0] == results[1], results                 # one plan on every rank
    assert results[0]["kind"] == "preempted", outs[0][-2000:]
    intent = json.loads((job / "exit-intent.json").read_text())
    assert intent["kind"] == "preempted"
    assert "leaving on the last committed checkpoint" in intent["reason"], intent
    assert "Slurm's" in intent["reason"] and "assumed deadline" in intent["reason"], intent
