"""Helpers that the tests of a user's own training script through ``hpc run`` share
(test_own_script, test_hf_trainer, test_lightning_signals): the environment a user's job runs
in (offline W&B), waiting for a condition, the job's outcomes and its launcher's pid."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.wandb_offline import offline_env

def env_for(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "HPC_", "WANDB_"))}
    wandb = offline_env(tmp / "wandb-env")
    del wandb["WANDB_DIR"]            # the launcher's WANDB_DIR=JOB_DIR must apply
    return env | wandb


def wait_for(pred, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def outcomes(job: Path) -> list[dict]:
    path = job / "outcomes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def launcher_pid(job: Path) -> int:
    out = subprocess.run(["pgrep", "-f", f"runtime.launch --job-dir {job}"], capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])
