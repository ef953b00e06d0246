"""The pre-join health check for real: two local nodes, node 1's job-directory probe fails
(HPC_TEST_HEALTH_FAIL points the real probe at a path that cannot be written), so node 1
reports it and stays out; node 0 trains alone (MIN 1) and finishes. `hpc run` is one
machine: nothing is excluded, and no line says so (the cluster test checks the exclusion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed


def test_node_failing_its_health_check_stays_out_and_the_job_goes_on(tmp_path: Path) -> None:
    job = tmp_path / "job"
    r = subprocess.run(
        [sys.executable, "-m", "hpc", "run", str(REPO / "examples" / "train_gpt.py"), "--nodes", "1:2",
         "--nproc-per-node", "1", "--job-dir", str(job), "--env", "HPC_TEST_HEALTH_FAIL=1",
         "--", "--preset", "tiny", "--max-steps", "6"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert json.loads((job / "result.json").read_text())["world_size"] == 1
    assert not (job / "exclusions.jsonl").exists()
    logs = "".join(p.read_text() for p in (job / "logs" / "alloc-0").glob("node-*.log"))
    assert "[hpc launch node 1] ERROR health check failed" in logs and "this node leaves the job" in logs
    assert "job_dir: cannot write and read back" in logs
    assert "excluding node" not in logs + r.stdout + r.stderr
    outcome = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    assert outcome["kind"] == "finished" and outcome["excluded"] == [], outcome
