"""The runtime on real nodes: each node picks its own interface, and `hpc doctor` checks an
allocation (interfaces, shared filesystem, an all-reduce across nodes) and fails with a clear
reason where there is no usable route."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tests" / "slurm" / "allreduce_check.py"


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


def test_each_node_chooses_its_own_eth0(env, tmp_path: Path):
    job = tmp_path / "job"
    r = subprocess.run([sys.executable, "-m", "hpc", "submit", str(CHECK), "--nodes", "2",
                        "--nproc-per-node", "2", "--job-dir", str(job), "--time", "5"],
                       env=env, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    job_id = (job / "slurm_job_id").read_text().strip()
    subprocess.run([sys.executable, "-m", "hpc", "logs", "-f", job_id], env=env, capture_output=True,
                   text=True, cwd=REPO, timeout=240)
    for node in ("node1", "node2"):
        log = (job / "logs" / "alloc-0" / f"node-{node}.log").read_text()
        assert "NCCL_SOCKET_IFNAME: (unset) -> '=eth0'" in log, log
        assert "GLOO_SOCKET_IFNAME: (unset) -> 'eth0'" in log, log
    assert json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])["kind"] == "finished"


def test_doctor_across_an_allocation(env, tmp_path: Path):
    shared = tmp_path / "shared dir"
    shared.mkdir()
    r = subprocess.run(["salloc", "-N", "2", "-t", "5", sys.executable, "-m", "hpc", "doctor",
                        "--nodes", "2", "--json"], env=env, capture_output=True, text=True,
                       cwd=shared, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout[r.stdout.index("{"):])
    assert report["ok"] is True
    hosts = sorted(n["host"] for n in report["nodes"])
    assert hosts == ["node1", "node2"]
    for n in report["nodes"]:
        assert n["checks"]["network"]["socket_ifname"] == "eth0"
        assert n["checks"]["shared_fs"]["reads_every_node"] is True
        assert n["checks"]["allreduce"]["correct"] is True
        assert n["checks"]["allreduce"]["latency_us"] > 0


def test_doctor_fails_clearly_without_a_route(tmp_path: Path):
    ns = f"hpcdoc-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "hpc", "doctor",
                            "--rdzv-host", "10.213.0.11"], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
    finally:
        subprocess.run(["ip", "netns", "del", ns])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "PROBLEM: no usable network interface" in r.stdout
    assert "10.213.0.11" in r.stdout
