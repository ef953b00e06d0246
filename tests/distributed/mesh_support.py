"""Helpers that the parallel-training tests share (test_mesh_training, test_pipeline_training):
the example GPT run through ``hpc run`` on real gloo processes, its result and its losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.wandb_offline import read_run

TRAIN = REPO / "examples" / "train_gpt.py"
STEPS = ("--max-steps", "10", "--log-every", "1")


def run(job: Path, nproc: int, *args: str, hpc_args: tuple[str, ...] = ()) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "hpc", "run", str(TRAIN), "--nproc-per-node", str(nproc),
           "--job-dir", str(job), *hpc_args, "--", "--preset", "tiny", *STEPS, *args]
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    return p.returncode, p.stdout


def result(job: Path) -> dict:
    return json.loads((job / "result.json").read_text())


def losses(job: Path) -> dict[int, float]:
    """The loss W&B recorded at each step, over every allocation of the job."""
    history = read_run(job / "wandb", (job / "wandb_run_id").read_text().strip()).history
    return {int(row["_step"]): float(row["loss"]) for row in history if "loss" in row}
