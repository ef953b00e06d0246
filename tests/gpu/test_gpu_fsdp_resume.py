"""FSDP2 with a bf16 mixed-precision policy on CUDA: saved asynchronously and resumed bit-exact.

Two runs of ``_gpu_ckpt_worker.py`` on min(2, GPUs) ranks (NCCL for the model, gloo for the
checkpointer): one trains 3 steps, saves asynchronously (pinned host buffers, side-stream copy)
and trains 2 more; the other builds the model from another seed, restores and trains the same 2
steps. The restored state must equal the state at the save, and the resumed run's end state the
uninterrupted run's, bit for bit (deterministic algorithms on).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.gpu
WORKER = Path(__file__).with_name("_gpu_ckpt_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(world: int, scenario: str, ckpt: Path, out: Path, timeout_s: float = 300) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(ckpt), str(out)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(logs)
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(world)]


def _mismatches(ref: Any, got: Any, path: str = "") -> list[str]:
    import torch

    if isinstance(ref, dict):
        if set(ref) != set(got):
            return [f"{path}: keys differ"]
        return [m for k in ref for m in _mismatches(ref[k], got[k], f"{path}/{k}")]
    if isinstance(ref, list | tuple):
        return [m for i, (a, b) in enumerate(zip(ref, got, strict=True)) for m in _mismatches(a, b, f"{path}[{i}]")]
    if isinstance(ref, torch.Tensor):
        same = isinstance(got, torch.Tensor) and ref.dtype == got.dtype and torch.equal(ref, got)
        return [] if same else [path]
    return [] if ref == got else [f"{path}: {ref!r} != {got!r}"]


def test_fsdp2_bf16_async_save_resumes_bit_exact(tmp_path: Path) -> None:
    import torch

    world = min(2, torch.cuda.device_count())
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    trained = run_ranks(world, "train", ckpt, out)
    assert all(r["resumed_step"] is None for r in trained)
    for r in trained:
        assert any("async staging: pinned host buffers" in line for line in r["log"]), r["log"]
        assert any("staging buffers ready (pinned" in line for line in r["log"]), r["log"]   # the warm-up made them
    resumed = run_ranks(world, "resume", ckpt, out)
    assert [r["resumed_step"] for r in resumed] == [3] * world
    a = torch.load(out / "train.pt", weights_only=False)
    b = torch.load(out / "resume.pt", weights_only=False)
    assert a["at_save"]["model"], "no full state was gathered"
    assert _mismatches(a["at_save"], b["at_save"]) == []   # restored == saved, bit for bit
    assert _mismatches(a["final"], b["final"]) == []       # and training goes on identically
    assert not torch.equal(next(iter(a["at_save"]["model"].values())), next(iter(a["final"]["model"].values())))
