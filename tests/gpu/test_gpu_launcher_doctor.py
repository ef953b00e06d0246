"""The launcher and the doctor on a GPU node: an NCCL all-reduce through ``hpc run`` with the
interfaces the runtime detected, and ``hpc doctor`` reporting the GPUs, CUDA and NCCL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.launch import network
from tests.conftest import REPO

pytestmark = pytest.mark.gpu
SCRIPT = REPO / "tests" / "gpu" / "scripts" / "nccl_allreduce.py"


def test_nccl_allreduce_through_the_launcher_uses_the_detected_interfaces(
        tmp_path: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import torch

    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"):  # the launcher's own choice
        monkeypatch.delenv(name, raising=False)
    world = torch.cuda.device_count()
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", str(world),
           "--job-dir", str(tmp_path / "job"), "--", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads((out / f"nccl-rank{i}.json").read_text()) for i in range(world)]
    _, changes = network.detect("127.0.0.1", multi_node=False, env=os.environ)
    planned = {c.name: c.new for c in changes}
    assert planned.get("NCCL_SOCKET_IFNAME"), planned  # the launcher chooses one on every node
    for rec in records:
        assert rec["backend"] == "nccl" and rec["world"] == world
        assert rec["sum"] == world * (world + 1) / 2 and rec["all_equal"]
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"):
            assert rec["env"][name] == planned.get(name), (name, rec["env"], planned)


def test_hpc_doctor_on_a_gpu_node_reports_gpus_cuda_and_nccl(clean_env: None) -> None:
    import torch

    r = subprocess.run([sys.executable, "-m", "hpc", "doctor", "--json"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    report = json.loads(r.stdout)
    node = report["nodes"][0]
    assert r.returncode == 0 and report["ok"], r.stdout + r.stderr
    assert len(node["checks"]["gpus"]) == torch.cuda.device_count()
    assert all(g["name"] and g["memory_gib"] > 0 for g in node["checks"]["gpus"])
    versions = node["checks"]["versions"]
    assert versions["cuda"] and versions["nccl"] and not str(versions["nccl"]).startswith("unavailable")
