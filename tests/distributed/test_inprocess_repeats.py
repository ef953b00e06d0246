"""A failure that repeats at one step ends in-process recovery; faults apart stay in-process.

``hpc run --recovery inprocess`` (the real launcher, torch's elastic agent, Session workers on
gloo, DDP). A rank whose step's all-reduce fails every time it runs that step (a deterministic
failure: a bad batch) used to loop through re-forms for ever (generation 29 and counting, the
same error each time). Now each generation records how many generations in a row went on from
its step, and past ``HPC_INPROC_MAX_REFORMS`` (3) the workers give up in-process: an
``inproc_fallback`` names the repeat, the launcher replaces nobody, torch's restart path runs
from the last checkpoint and, the failure repeating there too, ``--max-restarts`` ends the job.
The other side: two faults at different steps with steps completed between them, under a
budget of one re-form in a row, stay in-process and the job finishes.
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
BOUND_S = float(os.environ.get("HPC_TEST_REPEATS_BOUND_S", "180"))   # a loaded CI machine: ~16 s alone


def hpc_run(tmp_path: Path, steps: int, fault: str, *, max_restarts: int,
            env: dict[str, str] | None = None) -> tuple[int, str, Path, float]:
    out, job = tmp_path / "out", tmp_path / "job"
    out.mkdir()
    environ = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="30",
                   HPC_TEST_INPROC_FAULT=fault, **(env or {}))
    t0 = time.time()
    run = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "2",
                            "--max-restarts", str(max_restarts), "--recovery", "inprocess", "--job-dir",
                            str(job), "--", "--out", str(out), "--steps", str(steps), "--step-sleep", "0.05"],
                           env=environ, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        text, _ = run.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:   # the loop this test is about: end it, and say so
        os.killpg(run.pid, signal.SIGKILL)
        text, _ = run.communicate()
        gens = [e.get("gen") for e in events(job) if e["ev"] == "inproc_recovery"]
        pytest.fail(f"the job did not end within {BOUND_S} s (re-forms so far: {len(gens)}, last "
                    f"generation {gens[-1] if gens else None}):\n{text[-3000:]}")
    return run.returncode, text, job, time.time() - t0


def events(job: Path) -> list[dict]:
    return [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]


def test_a_failure_that_repeats_at_one_step_ends_in_the_restart_path_not_a_loop(tmp_path: Path):
    code, text, job, took = hpc_run(tmp_path, 12, "1:6:repeat", max_restarts=1)
    assert code != 0, text[-4000:]
    evs = events(job)
    rec = [e for e in evs if e["ev"] == "inproc_recovery"]
    # Three re-forms at step 6 per torch round (the first round and the one restart), no more.
    assert rec and {e["step"] for e in rec} == {6}, rec
    assert len(rec) == 6, [(e["gen"], e["step"]) for e in rec]
    falls = [e["reason"] for e in evs if e["ev"] == "inproc_fallback"]
    assert any("4 re-forms in a row at step 6 without a step completed" in r
               and "injected repeating fault" in r for r in falls), falls
    assert any(r.startswith("the workers gave up in-process recovery") for r in falls), falls
    print(f"repeating failure: ended (exit {code}) after {took:.1f} s, {len(rec)} re-forms")


def test_faults_at_different_steps_with_steps_between_stay_in_process(tmp_path: Path):
    # One re-form in a row allowed: the second fault comes after completed steps, so the count
    # started again and the job goes on in-process to its end.
    code, text, job, took = hpc_run(tmp_path, 14, "1:4:fail,0:10:fail", max_restarts=0,
                                    env={"HPC_INPROC_MAX_REFORMS": "1"})
    assert code == 0, text[-4000:]
    evs = events(job)
    rec = [e for e in evs if e["ev"] == "inproc_recovery"]
    assert len(rec) == 2 and rec[0]["step"] < rec[1]["step"], rec
    assert not [e for e in evs if e["ev"] == "inproc_fallback"], evs
    print(f"faults apart: finished in-process after {took:.1f} s")
