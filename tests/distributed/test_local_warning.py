"""A warning to a local ``hpc run``: harmless once the work is done, a user's stop before.

On the cluster's time-limit test a worker that had finished its last step and closed its
Session died of the warning (exit status -12): CPython resets signals with a Python handler to
SIG_DFL at interpreter shutdown, and a SIGUSR2 in that window killed it; the launcher then took
the allocation for a time limit and requeued it. Here a real 2-process ``hpc run`` of a
Session script holds its workers after the Session closed, then lets them exit while SIGUSR2
keeps arriving (at ``hpc run`` once, at each worker until it is gone): the outcome must be
``finished``, exit 0, one allocation.

Without Slurm a warning sent to ``hpc run`` is a stop someone asked for: its summary says so
and names no Slurm and no time limit.
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

from tests.conftest import REPO

pytestmark = pytest.mark.distributed

SCRIPT = """
import os, sys, time
from pathlib import Path
from runtime.session import Session

out = Path(sys.argv[1])
with Session() as s:
    for step in s.steps(0, int(sys.argv[2])):
        if step == 1:
            (out / f"started-{os.environ['RANK']}").write_text("")
        time.sleep(0.05)
rank = os.environ["RANK"]
(out / f".closed-{rank}").write_text(str(os.getpid()))   # whole or absent: the test reads it at once
os.replace(out / f".closed-{rank}", out / f"closed-{rank}")
while not (out / "go").exists():
    time.sleep(0.01)
"""


def _wait(pred, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _hpc_run(tmp_path: Path, steps: int) -> tuple[Path, Path, subprocess.Popen]:
    job, out = tmp_path / "job", tmp_path / "out"
    out.mkdir()
    script = tmp_path / "late.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(script), "--nproc-per-node", "2",
                          "--job-dir", str(job), "--", str(out), str(steps)],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, env=dict(os.environ, WANDB_MODE="disabled"))
    return job, out, p


def test_warning_after_the_session_closed_leaves_the_job_finished(tmp_path: Path):
    job, out, p = _hpc_run(tmp_path, 5)
    try:
        _wait(lambda: all((out / f"closed-{r}").exists() for r in (0, 1)), 180, "both Sessions closed")
        workers = [int((out / f"closed-{r}").read_text()) for r in (0, 1)]
        p.send_signal(signal.SIGUSR2)         # hpc run passes it on, as Slurm's warning would come
        time.sleep(0.5)
        (out / "go").write_text("")
        # The warning keeps coming while the workers exit, through the interpreter's shutdown.
        end = time.time() + 60
        while any(_alive(w) for w in workers) and time.time() < end:
            for w in workers:
                try:
                    os.kill(w, signal.SIGUSR2)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        stdout, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, stdout
    kinds = [json.loads(x)["kind"] for x in (job / "outcomes.jsonl").read_text().splitlines()]
    assert kinds == ["finished"], (kinds, stdout)
    assert "time limit" not in stdout.lower() and "slurm" not in stdout.lower(), stdout


def test_local_warning_stop_is_summarized_as_the_users_stop(tmp_path: Path):
    job, out, p = _hpc_run(tmp_path, 100_000)
    (out / "go").write_text("")   # nothing to hold after the Session closed
    try:
        _wait(lambda: all((out / f"started-{r}").exists() for r in (0, 1)), 180, "both ranks stepping")
        p.send_signal(signal.SIGUSR2)
        stdout, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 75, stdout                     # stopped, resumable
    assert "hpc run: stopped by SIGUSR2 (sent to hpc run) at step" in stdout, stdout
    assert f"to start it again, run the same command with --job-dir {job}" in stdout, stdout
    text = stdout.lower()
    assert "slurm" not in text and "time limit" not in text and "time_limit" not in text, stdout
