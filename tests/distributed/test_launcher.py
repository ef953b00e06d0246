"""The per-node launcher, for real: torch's elastic agent, gloo workers, signals, restarts.

Each test runs `hpc run` as a user would, in a subprocess, and checks what the user cares
about: the job's outcome, logs, restarts, and that no worker outlives its agent.
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
PROBE = REPO / "tests" / "distributed" / "scripts" / "worker_probe.py"


def hpc_run(job_dir: Path, *script_args: str, nproc: int = 2, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hpc", "run", str(PROBE), "--nproc-per-node", str(nproc),
           "--job-dir", str(job_dir), *extra, "--", "--out", str(job_dir), *script_args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for(pred, timeout: float = 60.0, what: str = "condition") -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def outcomes(job_dir: Path) -> list[dict]:
    path = job_dir / "outcomes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_local_run_writes_the_job_dir_layout(hostile_dir: Path):
    job = hostile_dir / "job"
    p = hpc_run(job, "--seconds", "1")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert "[rank0]: probe rank 0" in out                       # rank 0 streamed to the terminal
    assert (job / "jobspec.json").exists()
    assert "probe rank 1" in (job / "logs/alloc-0/restart-0/rank-1.log").read_text()
    assert outcomes(job)[-1]["kind"] == "finished"
    assert oct(job.stat().st_mode & 0o777) == "0o700"


def test_worker_sigkill_is_restarted_and_the_job_finishes(tmp_path: Path):
    job = tmp_path / "job"
    p = hpc_run(job, "--seconds", "4")
    wait_for(lambda: (job / "pid-1-0").exists(), what="worker 1 to start")
    time.sleep(1.0)
    os.kill(int((job / "pid-1-0").read_text()), signal.SIGKILL)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 0, out
    assert (job / "pid-0-1").exists() and (job / "pid-1-1").exists(), "workers were not restarted"
    assert "probe rank 1 restart 1" in (job / "logs/alloc-0/restart-1/rank-1.log").read_text()
    assert outcomes(job)[-1]["kind"] == "finished"


def test_killed_agent_leaves_no_worker_behind(tmp_path: Path):
    job = tmp_path / "job"
    p = hpc_run(job, "--seconds", "60")
    wait_for(lambda: (job / "pid-0-0").exists() and (job / "pid-1-0").exists(), what="workers")
    pids = [int((job / f"pid-{r}-0").read_text()) for r in (0, 1)]
    launcher = int(subprocess.run(["pgrep", "-f", f"runtime.launch --job-dir {job}"],
                                  capture_output=True, text=True).stdout.split()[0])
    os.kill(launcher, signal.SIGKILL)
    try:
        wait_for(lambda: not any(alive(x) for x in pids), timeout=10, what="workers to die with their agent")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        for x in pids:
            if alive(x):
                os.kill(x, signal.SIGKILL)
        p.communicate()


def test_warning_signal_reaches_workers_and_agent_survives(tmp_path: Path):
    job = tmp_path / "job"
    p = hpc_run(job, "--seconds", "5")
    wait_for(lambda: (job / "pid-0-0").exists() and (job / "pid-1-0").exists(), what="workers")
    time.sleep(1.0)
    launcher = int(subprocess.run(["pgrep", "-f", f"runtime.launch --job-dir {job}"],
                                  capture_output=True, text=True).stdout.split()[0])
    os.kill(launcher, signal.SIGUSR2)
    time.sleep(0.5)
    os.kill(launcher, signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out                               # the workers finished their work
    for r in (0, 1):
        assert (job / f"signals-{r}").read_text() == "SIGUSR2,SIGTERM"
    assert not (job / "pid-0-1").exists(), "workers were restarted instead of left to finish"


def test_application_error_is_named_in_the_outcome(tmp_path: Path):
    job = tmp_path / "job"
    p = hpc_run(job, "--fail", extra=("--max-restarts", "0"))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out
    last = outcomes(job)[-1]
    assert last["kind"] == "app_error"
    assert "boom: injected failure in rank 1" in last["reason"]
