"""The quick start's example on GPUs: ``hpc run examples/train_gpt.py`` on min(2, GPUs) ranks, DDP
over NCCL, once straight through and once with a worker failing mid-run (torch's restart path from
the checkpoint): both finish with the same weights and the same samples.

Why on a GPU: a GPU job's default group is NCCL, which takes no CPU tensor. The first run of the
example on a GPU (an H200, session 9) trained its 40 steps and then died on its last line, an
all-reduce of a CPU tensor (the final loss), and so did a one-GPU Session job on its first metric
row; the restarted worker then said "result.json is kept" of a result never written. None of it
could show on the CPU suite, where every group is gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.gpu
TRAIN = REPO / "examples" / "train_gpt.py"


def train(job: Path, *args: str) -> dict:
    import torch

    nproc = min(2, torch.cuda.device_count())
    r = subprocess.run([sys.executable, "-m", "hpc", "run", str(TRAIN), "--nproc-per-node", str(nproc),
                        "--job-dir", str(job), "--", "--preset", "tiny", *args], cwd=REPO,
                       env=dict(os.environ, WANDB_MODE="offline"), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    out = json.loads((job / "result.json").read_text())
    assert out["final_step"] == 40 and out["world_size"] == nproc, out
    return out


def test_train_gpt_on_gpus_resumes_after_a_failure_with_the_uninterrupted_weights(tmp_path: Path):
    straight = train(tmp_path / "straight")
    failed = train(tmp_path / "failed", "--fail-at-step", "25", "--fail-once")
    assert failed["weights_sha256"] == straight["weights_sha256"]
    assert failed["sample_order_sha256"] == straight["sample_order_sha256"]
