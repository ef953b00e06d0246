"""``hpc submit`` on the real test cluster: a 2-node x 2-process job, secrets, permissions, limits.

Every job directory here is hostile (spaces, quotes, ``;``, ``$``, backticks, ``#``): the
path must survive sbatch's #SBATCH parser, bash and srun on the way to the workers.
"""

from __future__ import annotations

import json
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import hpc, squeue_state

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tests" / "slurm" / "allreduce_check.py"
HOSTILE = "semi;colon $HOME `x` quote's \"dq\" #h"
SECRET = "hpc-test-s3cr3t-value-4f1c"


def wait_job(env: dict[str, str], job_id: str, timeout: float = 240) -> dict[str, float]:
    """Polls squeue every 0.2 s; returns when the job was first seen running and when it ended."""
    t0, seen = time.monotonic(), {}
    while time.monotonic() - t0 < timeout:
        state = squeue_state(env, job_id)
        if state == "RUNNING" and "running" not in seen:
            seen["running"] = time.monotonic() - t0
        if state in ("GONE", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            seen["done"] = time.monotonic() - t0
            seen["state"] = state
            return seen
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {squeue_state(env, job_id)} after {timeout} s")


def sacct_state(env: dict[str, str], job_id: str) -> str:
    """The job's final state in accounting (sacct lags the controller by a second or so)."""
    state = "?"
    for _ in range(75):
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"], env=env,
                             capture_output=True, text=True).stdout.splitlines()
        if out:
            state = out[-1].split()[0]
            if state not in ("RUNNING", "PENDING", "COMPLETING", "REQUEUED"):
                return state
        time.sleep(0.2)
    return state


@pytest.fixture
def env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    return {**slurm_cluster.env, "HPC_HOME": str(tmp_path / "hpc-home"), "WANDB_MODE": "offline"}


def test_sbatch_2x2_allreduce_hostile_dir_secret_private(env, tmp_path: Path) -> None:
    job_dir = tmp_path / HOSTILE / "job"
    run_env = {**env, "HPC_TEST_SECRET_TOKEN": SECRET}
    t0 = time.monotonic()
    r = hpc(run_env, "submit", str(CHECK), "--nodes", "2", "--nproc-per-node", "2",
            "--job-dir", str(job_dir), "--time", "10")
    assert r.returncode == 0, r.stderr
    job_id = (job_dir / "slurm_job_id").read_text().strip()
    assert f"Submitted job {job_id}" in r.stdout and str(job_dir) in r.stdout
    times = wait_job(env, job_id)
    submit_s = time.monotonic() - t0
    print(f"\nsbatch 2x2 allreduce: submit->running {times.get('running', float('nan')):.1f} s, "
          f"submit->done {times['done']:.1f} s (incl. hpc submit {submit_s - times['done']:.1f} s)")
    assert sacct_state(env, job_id) == "COMPLETED", (job_dir / "logs" / f"slurm-{job_id}.out").read_text()
    result = json.loads((job_dir / "allreduce.json").read_text())
    assert result["world_size"] == 4 and result["sum"] == 10.0
    assert sorted(set(result["hosts"])) == ["node1", "node2"]
    # The secret reached the workers (its hash matches) ...
    import hashlib
    assert result["secret_sha256"] == hashlib.sha256(SECRET.encode()).hexdigest()
    # ... and is written nowhere: job dir (script, jobspec, logs) and the job index.
    leaked = [str(p) for root in (job_dir, Path(env["HPC_HOME"])) for p in root.rglob("*")
              if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []
    assert "HPC_TEST_SECRET_TOKEN" not in (job_dir / "jobspec.json").read_text()
    # Private: the job directory and what it holds.
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((job_dir / "jobspec.json").stat().st_mode) & 0o077 == 0
    outcomes = [json.loads(line) for line in (job_dir / "outcomes.jsonl").read_text().splitlines()]
    assert outcomes[-1]["kind"] == "finished"


def test_secret_in_env_flag_refused(env, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    r = hpc(env, "submit", str(CHECK), "--env", f"WANDB_API_KEY={SECRET}", "--job-dir", str(job_dir))
    assert r.returncode == 2
    assert "WANDB_API_KEY" in r.stderr and "Export" in r.stderr and SECRET not in r.stderr
    assert not job_dir.exists()


@pytest.mark.parametrize("args,words", [
    (["--partition", "nosuch"], "--partition 'nosuch' is invalid: a partition of this cluster"),
    (["--nodes", "9"], "at most 3 nodes"),
    (["--time", "2:00:00"], "MaxTime"),
])
def test_bad_requests_fail_before_submission(env, tmp_path: Path, args, words) -> None:
    job_dir = tmp_path / "job"
    r = hpc(env, "submit", str(CHECK), "--job-dir", str(job_dir), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr
    assert not job_dir.exists()


def test_sbatch_rejection_is_explained(env, tmp_path: Path, monkeypatch, capsys) -> None:
    """Skip our own check: sbatch itself refuses, and the user gets the same kind of message."""
    from hpc import cli, prechecks

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(prechecks, "check_partition", lambda spec, parts: None)
    job_dir = tmp_path / "job"
    assert cli.main(["submit", str(CHECK), "--job-name", "t", "--job-dir", str(job_dir),
                     "--nodes", "9"]) == 2
    assert "hpc submit: error: Slurm refused the job" in capsys.readouterr().err
    assert not job_dir.exists()


def test_dry_run_creates_nothing(env, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    r = hpc({**env, "SLURM_CONF": "/nonexistent"}, "submit", "--dry-run", str(CHECK),
            "--job-dir", str(job_dir))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].startswith("sbatch --parsable --comment=hpc-tag:")
    assert "#SBATCH --nodes=1" in r.stdout and not job_dir.exists()


def test_train_gpt_tiny_matches_local_run(env, tmp_path: Path, baseline) -> None:
    """The example trainer on 2 nodes x 2 processes gives the same weights as `hpc run`: the
    session's ``baseline`` is that very local run (``hpc run train_gpt.py --nodes 2
    --nproc-per-node 2 -- --preset tiny``), run beside the cluster job, not before it."""
    example = REPO / "examples" / "train_gpt.py"
    slurm_dir = tmp_path / "slurm job"
    t0 = time.monotonic()
    r = hpc(env, "submit", str(example), "--nodes", "2", "--nproc-per-node", "2",
            "--job-dir", str(slurm_dir), "--time", "20", "--", "--preset", "tiny")
    assert r.returncode == 0, r.stderr
    job_id = (slurm_dir / "slurm_job_id").read_text().strip()
    times = wait_job(env, job_id, timeout=600)
    print(f"\ntrain_gpt tiny 2x2: submit->running {times.get('running', float('nan')):.1f} s, "
          f"submit->done {time.monotonic() - t0:.1f} s")
    assert sacct_state(env, job_id) == "COMPLETED", (slurm_dir / "logs" / f"slurm-{job_id}.out").read_text()[-3000:]
    remote = json.loads((slurm_dir / "result.json").read_text())
    assert remote["final_step"] == baseline["final_step"]
    assert remote["weights_sha256"] == baseline["weights_sha256"]
