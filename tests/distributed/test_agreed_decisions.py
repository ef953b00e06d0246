"""Every decision that picks a rank's next collective is the same on every rank, for real.

The save decision's step rules run on each rank without a collective (the Session agrees on
its clock only every N steps). Under ``--checkpoint-interval auto`` they are tuned from the
job's event history, which only rank 0 reads: once a save of the job was measured, rank 0
plans no probe save while the other ranks, seeing no history, plan one 20 steps after the
restore. Where that step is not an agreement step, those ranks entered the save's gather and
rank 0 the next step's gradient all-reduce: a deadlock (found after two quick preemptions on a
Slurm cluster, 2 nodes x 2 processes). Here a 2-process ``hpc run`` of a Session script trains
10 steps (its final save is measured), then the same job goes on to 40 steps with the
agreement every 7 steps (20 steps after the restore is no agreement step): it must finish,
with the weights and samples of an uninterrupted run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"


def run(job: Path, out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "2", "--job-dir",
           str(job), "--", "--out", str(out), "--steps", str(steps), "--step-sleep", "0.01",
           "--boundary-every", "7"]
    log = out / "hpc-run.log"   # a file, not a pipe: the workers of a hung job may outlive hpc run
    with log.open("w") as f:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:   # a backstop: a deadlock sits in the stall watch's first-steps budget for minutes
            p.wait(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()          # its launchers get SIGTERM (PR_SET_PDEATHSIG) and end the workers
            p.wait()
            ranks = "\n".join(f"--- {f}\n{f.read_text(errors='replace')[-3000:]}"
                               for f in sorted(job.glob("logs/alloc-*/restart-*/rank-*.log")))
            raise AssertionError(f"hpc run of {steps} steps did not end:\n{log.read_text()}\n{ranks}") \
                from None
    assert p.returncode == 0, log.read_text()


def results(out: Path) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}


def test_a_resume_after_a_measured_save_agrees_on_the_probe_save(tmp_path: Path) -> None:
    ref, job = tmp_path / "ref", tmp_path / "job"
    run(ref, tmp_path / "out-ref", 40)
    run(job, tmp_path / "out-a", 10)
    run(job, tmp_path / "out-b", 40)
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    tuned = [e for e in events if e["ev"] == "ckpt_interval" and e["alloc"] == 1]
    assert tuned and tuned[0]["source"] == "measured" and tuned[0]["probe_step"] is None, tuned
    saved = sorted(e["step"] for e in events if e["ev"] == "ckpt_save" and e["alloc"] == 1)
    assert saved == [40], saved                     # no probe save: rank 0's plan, on every rank
    want, got = results(tmp_path / "out-ref"), results(tmp_path / "out-b")
    assert set(got) == {0, 1} and all(r["step"] == 40 for r in got.values()), got
    assert {r["weights"] for r in got.values()} == {want[0]["weights"]}, (want, got)
    assert got[0]["sampler"] == want[0]["sampler"], (want, got)
