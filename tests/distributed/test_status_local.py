"""`hpc status` without arguments lists a real `hpc run` job, running and then finished, with the
time it ran (issue 24: local jobs were missing, and their ELAPSED was always 00:00:00)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, hpc, wait_until

pytestmark = pytest.mark.distributed

WAITER = """
import pathlib, sys, time
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.1)
"""


def _status(env: dict[str, str]) -> list[dict]:
    r = hpc(env, "status", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout or "[]")


@pytest.mark.timeout(240)
def test_status_lists_a_running_then_finished_hpc_run_job_with_its_elapsed_time(tmp_path: Path) -> None:
    script, go, job = tmp_path / "waiter.py", tmp_path / "go", tmp_path / "job"
    script.write_text(WAITER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "HPC_"))}
    env |= {"HPC_HOME": str(tmp_path / "home"), "WANDB_MODE": "disabled"}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(script), "--job-dir", str(job),
                             "--", str(go)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (job / "events.jsonl").exists(), 120, "the launcher's first event")
        first = _status(env)
        assert [(v["job_id"], v["job_dir"], v["state"]) for v in first] == [("", str(job), "local: running")]
        time.sleep(2.5)
        second = _status(env)[0]
        assert second["elapsed_s"] >= first[0]["elapsed_s"] + 2      # running: time so far
        assert second["allocations"][-1]["detail"] == "running"
        go.touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ran = time.monotonic() - started
    assert proc.returncode == 0, out
    done = _status(env)[0]
    assert done["state"] == "local: finished"
    assert second["elapsed_s"] <= done["elapsed_s"] <= ran + 1     # ended: its duration
    table = hpc(env, "status").stdout
    row = next(line for line in table.splitlines() if "local" in line and "finished" in line)
    assert "00:00:00" not in row
    print(f"hpc run took {ran:.1f} s; hpc status: {done['elapsed_s']} s")
