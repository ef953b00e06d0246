"""examples/lightning_resume.py under `hpc run` meets the stop contract, for real.

On the warning it saves and exits 75, recorded as the stop. And Lightning's own SIGTERM
handler (in every process; it broadcasts from inside the handler, then the loop raises
``SIGTERMException``, a ``SystemExit`` with status 0 that would read as a finished job) does
not swallow a stop: ours stays behind it, the worker still dies of the SIGTERM, and the
launcher records the stop and restarts nothing. docs/own-script.md says so; this checks it.
When the SIGTERM finds one rank in the step's collective and the other outside it, that
broadcast never completes: the launcher then kills the workers ``KILL_AFTER_S`` after the
SIGTERM (tests/distributed/test_launcher.py forces that case), and the stop is recorded all the
same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.stopping import KILL_AFTER_S
from tests.conftest import REPO
from tests.distributed.own_script_support import env_for, launcher_pid, outcomes, wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.waits]   # CI runs these in a lane of their own
SCRIPT = REPO / "examples" / "lightning_resume.py"


def start(tmp_path: Path, job: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "2",
                             "--max-restarts", "3", "--job-dir", str(job), "--", "--steps", "1000",
                             "--step-sleep", "0.2"], cwd=REPO, env=env_for(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def stop_with(job: Path, p: subprocess.Popen[str], sig: signal.Signals) -> str:
    try:
        wait_for(lambda: (job / "checkpoints" / "last.ckpt").exists(), 150, "Lightning's last.ckpt")
        os.kill(launcher_pid(job), sig)
        out, _ = p.communicate(timeout=KILL_AFTER_S + 60)   # a hung handler is killed after it
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 75, out[-3000:]
    return out


@pytest.mark.timeout(240)
def test_on_the_warning_the_lightning_example_saves_and_exits_75(tmp_path: Path):
    job = tmp_path / "job"
    stop_with(job, start(tmp_path, job), signal.SIGUSR2)   # the warning (hpc run: a preemption's, 30 s)
    rank0 = (job / "logs/alloc-0/restart-0/rank-0.log").read_text(errors="replace")
    assert "saved, stopping" in rank0, rank0[-2000:]
    [record] = outcomes(job)
    assert (record["kind"], record["exit_code"]) == ("preempted", 75), record
    assert record["reason"] == "SIGUSR2 (preempted): the script stopped for it (exit 75)", record["reason"]


@pytest.mark.timeout(300)
def test_sigterm_to_a_lightning_job_is_recorded_as_the_stop(tmp_path: Path):
    job = tmp_path / "job"
    stop_with(job, start(tmp_path, job), signal.SIGTERM)   # a SIGTERM-only stop, no warning
    rank0 = (job / "logs/alloc-0/restart-0/rank-0.log").read_text(errors="replace")
    assert "cluster environment TorchElasticEnvironment" in rank0
    assert "Received SIGTERM" in rank0, "Lightning's handler did not run: " + rank0[-2000:]
    assert sorted(x.name for x in (job / "logs/alloc-0").glob("restart-*")) == ["restart-0"]
    [record] = outcomes(job)
    assert (record["kind"], record["exit_code"]) == ("preempted", 75), record
    # Died of it (or, its handler hung in the broadcast, was killed after it): not a status-0 exit.
    assert any(f"exited with -{int(s)}" in record["reason"] for s in (signal.SIGTERM, signal.SIGKILL)), record
