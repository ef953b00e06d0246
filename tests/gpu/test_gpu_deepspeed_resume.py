"""DeepSpeed on CUDA with NCCL: what its CPU path here cannot show (issue 28).

On CPU (tests/distributed/test_deepspeed_resume.py, tests/slurm/test_frameworks_on_cluster.py)
the example passes torch's AdamW to ``deepspeed.initialize``: DeepSpeed's own optimizers are
C++ ops it compiles on first use, and on the 2-core CPU machines here the ``fused_adam`` build
did not end in 10 minutes, twice (docs/own-script.md). On a GPU the config's ``AdamW`` is
FusedAdam (a CUDA op, compiled with nvcc on first use). Each case runs the unchanged example
under ``hpc run`` on min(2, GPUs) ranks with NCCL: stopped by the warning signal mid-run (it
saves every rank's ZeRO partitions and exits 75), resumed, and ending with the weights and
loss of an uninterrupted run bit for bit.
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

pytestmark = pytest.mark.gpu
SCRIPT = REPO / "examples" / "deepspeed_resume.py"


def start(job: Path, nproc: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    import torch

    if any(c.isalpha() for c in env.get("TORCH_CUDA_ARCH_LIST", "").replace("PTX", "")):
        # DeepSpeed 0.19.8 parses each entry as digits (ValueError on "9.0a", as this GPU image
        # sets it): its FusedAdam build then fails before any of ours runs. This device's own.
        major, minor = torch.cuda.get_device_capability()
        env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", str(nproc),
                             "--job-dir", str(job), "--", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen) -> tuple[int, str]:
    out, _ = p.communicate(timeout=900)   # a first FusedAdam build (nvcc) takes minutes
    return p.returncode, out


@pytest.mark.parametrize("zero, optimizer", [(2, "deepspeed"), (3, "deepspeed"), (3, "torch")])
def test_deepspeed_on_cuda_saves_on_the_warning_and_resumes_bit_equal(tmp_path: Path, zero: int,
                                                                     optimizer: str) -> None:
    import torch

    nproc = min(2, torch.cuda.device_count())
    args = ("--zero", str(zero), "--optimizer", optimizer, "--steps", "20", "--ckpt-every", "5",
            "--step-sleep", "0.1")
    code, out = finish(start(tmp_path / "reference", nproc, *args))
    assert code == 0, out[-4000:]
    expected = json.loads((tmp_path / "reference" / "result.json").read_text())
    if optimizer == "deepspeed":
        assert expected["optimizer"] == "FusedAdam", expected   # DeepSpeed's own, not torch's

    job = tmp_path / "stopped"
    p = start(job, nproc, *args)
    deadline = time.time() + 600
    while time.time() < deadline and not any("fresh start" in f.read_text(errors="replace")
                                             for f in (job / "logs").glob("alloc-*/restart-*/rank-0.log")):
        time.sleep(0.1)
    time.sleep(0.8)                     # a few steps of 0.1 s in
    p.send_signal(signal.SIGUSR2)       # what Slurm's warning does (hpc run forwards it)
    code, out = finish(p)
    assert code == 75 and "saved, stopping" in out, out[-4000:]
    code, out = finish(start(job, nproc, *args))
    assert code == 0, out[-4000:]
    resumed = int(out.split("resumed at step ")[1].split()[0])
    assert 0 < resumed < 20, out[-4000:]
    final = json.loads((job / "result.json").read_text())
    assert final["steps"] == 20 and final["world_size"] == nproc
    assert final["weights_sha256"] == expected["weights_sha256"], (final, expected)
    assert final["loss"] == expected["loss"]
