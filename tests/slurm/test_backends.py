"""The same JobSpec through each backend on the real cluster: 2 nodes x 2 processes all-reduce."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import sacct_rows, squeue_state

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tests" / "slurm" / "allreduce_check.py"


def hpc(env: dict[str, str], cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def wait_gone(env: dict[str, str], job_id: str, timeout: float = 240) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        # (a heterogeneous TorchX job has one line per component)
        states = squeue_state(env, job_id).split()
        if states == ["GONE"] or all(s in ("COMPLETED", "FAILED", "CANCELLED") for s in states):
            return time.monotonic() - t0
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not done after {timeout} s")


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline",
            "PYTHONPATH": str(REPO)}


@pytest.mark.parametrize("backend,dirname", [
    ("submitit", "semi;colon $HOME `x` quote's"),
    ("torchx", "with space"),
])
def test_backend_2x2_allreduce(env, tmp_path: Path, backend: str, dirname: str) -> None:
    job_dir = tmp_path / dirname / "job"
    r = hpc(env, tmp_path, "submit", "--backend", backend, str(CHECK), "--nodes", "2",
            "--nproc-per-node", "2", "--job-dir", str(job_dir), "--time", "10")
    assert r.returncode == 0, r.stderr
    job_id = (job_dir / "slurm_job_id").read_text().strip()
    took = wait_gone(env, job_id)
    print(f"\n{backend} 2x2 allreduce: submit->done {took:.1f} s")
    result = json.loads((job_dir / "allreduce.json").read_text())
    assert result["world_size"] == 4 and result["sum"] == 10.0
    assert sorted(set(result["hosts"])) == ["node1", "node2"]
    outcomes = [json.loads(l) for l in (job_dir / "outcomes.jsonl").read_text().splitlines()]
    assert [o["kind"] for o in outcomes] == ["finished"]
    # submitit / TorchX wrote the script, but the sbatch went through our SlurmClient (retries,
    # a unique tag looked up before any retry): only that client sets this comment.
    # slurmdbd gets the record a moment after the job ended: wait for it (bounded).
    comments = [row[0] for row in sacct_rows(env, job_id, "Comment",
                                             until=lambda rows: rows and all(r[0] for r in rows))]
    assert all(c.startswith("hpc-tag:") for c in comments), comments


def test_torchx_refuses_options_it_would_drop(env, tmp_path: Path) -> None:
    r = hpc(env, tmp_path, "submit", "--backend", "torchx", str(CHECK), "--account", "proj",
            "--qos", "high", "--job-dir", str(tmp_path / "job"))
    assert r.returncode == 2
    assert "--account, --qos" in r.stderr and "--backend sbatch" in r.stderr
    assert not (tmp_path / "job").exists()


def test_torchx_run_cli_with_component(env, tmp_path: Path) -> None:
    """`torchx run -s slurm hpc/backends/torchx_component.py:elastic ...` works as documented."""
    job_dir = tmp_path / "cli job"
    r = subprocess.run([str(Path(sys.executable).with_name("torchx")), "run", "-s", "slurm",
                        "-cfg", "time=10", f"{REPO}/hpc/backends/torchx_component.py:elastic",
                        "--script", str(CHECK), "--job_dir", str(job_dir), "--nodes", "2",
                        "--nproc_per_node", "2"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    job_id = r.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1]
    wait_gone(env, job_id)
    result = json.loads((job_dir / "allreduce.json").read_text())
    assert result["world_size"] == 4 and result["sum"] == 10.0



def test_submitit_gives_an_excluded_node_back_before_training(env, tmp_path: Path) -> None:
    """A job directory resumed after an earlier allocation found node3 bad: the submitit job's
    batch shell gives node3 back to Slurm before srun (runtime.exclusions in submitit's setup
    lines), so the launchers and workers run on node1 and node2 only. Before, a submitit job
    recorded exclusions and ran on the excluded nodes anyway."""
    from hpc.contract.jobspec import JobSpec
    from runtime.exclusions import add

    job_dir = tmp_path / "job"
    job_dir.mkdir(mode=0o700)
    (job_dir / "jobspec.json").write_text(JobSpec(script=str(CHECK), job_dir=str(job_dir)).to_json())
    assert add(job_dir, "node3", "health", "job directory: not writable", 0)
    r = hpc(env, tmp_path, "submit", "--backend", "submitit", str(CHECK), "--nodes", "2:3",
            "--nproc-per-node", "2", "--job-dir", str(job_dir), "--time", "10")
    assert r.returncode == 0, r.stderr
    job_id = (job_dir / "slurm_job_id").read_text().strip()
    took = wait_gone(env, job_id)
    batch_out = "".join(p.read_text() for p in (job_dir / "submitit").rglob("*.out"))
    print(f"\nsubmitit 2:3 with node3 excluded: submit->done {took:.1f} s")
    if not batch_out:   # (CI of d306e5b: no output at all; say what Slurm did with the job)
        rows = sacct_rows(env, job_id, "State,ExitCode,Reason,NodeList,Start,End", until=bool)
        raise AssertionError(f"job {job_id} left no batch output; Slurm's record: {rows}")
    assert "hpc: gave back excluded node(s) node3; running on node1,node2" in batch_out, batch_out[-3000:]
    result = json.loads((job_dir / "allreduce.json").read_text())
    assert result["world_size"] == 4 and result["sum"] == 10.0
    assert sorted(set(result["hosts"])) == ["node1", "node2"]
    assert not list(job_dir.glob("logs/alloc-0/node-node3.log")), "node3 ran a launcher"
    outcomes = [json.loads(l) for l in (job_dir / "outcomes.jsonl").read_text().splitlines()]
    assert [o["kind"] for o in outcomes] == ["finished"]
