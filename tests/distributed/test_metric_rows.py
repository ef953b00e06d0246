"""Ranks that log different metrics (rank 0's evaluation, a metric of some steps, one rank's own)
train on and get one row per step with each metric reduced over the ranks that logged it. Each
rank reduced its own names before (runtime.worker.metric_rows): the ranks posted all-reduces of
other sizes and the job hung at its first such row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.wandb_offline import offline_env, read_run

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests" / "distributed" / "scripts" / "uneven_metrics.py"


def test_ranks_logging_different_metrics_finish_with_each_metric_reduced_over_its_ranks(tmp_path: Path) -> None:
    job = tmp_path / "job"
    env = {**__import__("os").environ, **offline_env(tmp_path), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "2",
                        "--job-dir", str(job), "--max-restarts", "0"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = {int(row["_step"]): row for row in read_run(job / "wandb", (job / "wandb_run_id").read_text().strip()).history
            if "loss" in row}
    assert sorted(rows) == list(range(1, 9)), sorted(rows)
    for step, row in rows.items():   # the row of step k holds what the body of step k - 1 logged
        body = step - 1
        assert row["loss"] == pytest.approx(body + 0.5), row       # mean of ranks 0 and 1
        assert row["r1"] == pytest.approx(body), row                 # rank 1's alone, summed
        assert ("val" in row) == (body == 4) and ("peak" in row) == (body >= 2), row
        assert ("seen" in row) == (body == 6), row
    assert rows[5]["val"] == pytest.approx(10.0)                     # rank 0's evaluation, not halved
    assert rows[8]["peak"] == pytest.approx(107.0) and rows[7]["seen"] == pytest.approx(0.5)
