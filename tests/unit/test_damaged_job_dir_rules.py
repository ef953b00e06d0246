"""Hostile or damaged job-directory files end in a clear message, never a traceback or a wrong
Slurm command (issue 23's reliability probe): ``slurm_job_id`` and the lock file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hpc import status
from hpc.cli import main
from hpc.contract import joblock, jobdir

pytestmark = pytest.mark.unit

HOSTILE_IDS = [b"--me", b"-u root", b"1234 --me", b"1234,5678", b"all", b"1234\n--me", b"\xff\xfe"]


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """scancel/squeue/sacct/scontrol that only record their arguments (real processes)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for cmd in ("scancel", "squeue", "sacct", "scontrol"):
        (bin_dir / cmd).write_text(f'#!/bin/sh\necho "{cmd} $*" >> {calls}\n')
        (bin_dir / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(status, "current_cluster", lambda client=None: "")
    return calls


def _job(tmp_path: Path, job_id: bytes) -> Path:
    job = jobdir.create(tmp_path / "job")
    (job / "jobspec.json").write_text("{}")
    (job / "slurm_job_id").write_bytes(job_id + b"\n")
    return job


@pytest.mark.parametrize("bad", HOSTILE_IDS, ids=repr)
@pytest.mark.parametrize("command", ["cancel", "status", "report"])
def test_a_hostile_slurm_job_id_reaches_no_slurm_command(tmp_path: Path, fake_slurm: Path, bad: bytes,
                                                         command: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    job = _job(tmp_path, bad)
    assert main([command, str(job)]) == 2
    err = capsys.readouterr().err
    assert f"{job / 'slurm_job_id'}" in err and "is invalid: a Slurm job id" in err, err
    assert "Traceback" not in err
    assert not fake_slurm.exists(), fake_slurm.read_text()      # scancel --me never ran


def test_a_real_job_id_and_an_array_task_are_cancelled(tmp_path: Path, fake_slurm: Path) -> None:
    job = _job(tmp_path, b"4242")
    assert main(["cancel", str(job)]) == 0
    task = jobdir.create(tmp_path / "task")
    (task / "jobspec.json").write_text("{}")
    (task / "slurm_job_id").write_text("4242_3\n")
    assert main(["cancel", str(task)]) == 0
    assert fake_slurm.read_text().splitlines() == ["scancel 4242", "scancel 4242_3"]


def test_the_slurm_client_refuses_an_option_as_a_job_id(fake_slurm: Path) -> None:
    from hpc.contract.slurm import SlurmClient

    for bad in ("--me", "-u", ""):
        with pytest.raises(ValueError, match="not a Slurm job id"):
            SlurmClient().cancel(bad)
        with pytest.raises(ValueError, match="not a Slurm job id"):
            SlurmClient().requeue(bad)
    assert not fake_slurm.exists()


def test_the_lock_reads_a_hostile_slurm_job_id_as_an_error(tmp_path: Path) -> None:
    holder = joblock.me("hpc submit")
    (tmp_path / joblock.LOCK).write_text(holder.to_json())
    (tmp_path / "slurm_job_id").write_text("--me\n")
    with pytest.raises(ValueError, match="slurm_job_id.*is invalid"):
        joblock.acquire(tmp_path, "hpc run", slurm_active=lambda job_id: pytest.fail(job_id))


@pytest.mark.parametrize("content", [b"[1, 2]\n", b"\xff\xfe{}", b'"text"', b"{\"pid\": \"x\"}",
                                     b'{"command": "hpc run", "host": "h", "pid": 1, "since": 1, '
                                     b'"processes": [["a", 1]]}'],
                         ids=["list", "non-utf8", "string", "wrong-types", "bad-processes"])
def test_a_damaged_lock_file_is_taken_over_once_old(tmp_path: Path, content: bytes,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    lock_file = tmp_path / joblock.LOCK
    lock_file.write_bytes(content)
    assert joblock.read_holder(tmp_path) is None
    old = time.time() - 60
    os.utime(lock_file, (old, old))               # not a lock being written right now
    with joblock.acquire(tmp_path, "hpc run") as lock:
        assert joblock.read_holder(tmp_path) == lock.holder
    assert "names no holder" in caplog.text and str(lock_file) in caplog.text


@pytest.mark.parametrize("ref", ["١٢٣", "１２", "12_٣"])
def test_a_job_id_in_non_ascii_digits_reaches_no_slurm_command(fake_slurm: Path, ref: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cancel", ref]) == 2
    assert "JOB" in capsys.readouterr().err
    assert not fake_slurm.exists()


def test_permanent_failures_are_told_from_ones_a_restart_fixes() -> None:
    from types import SimpleNamespace

    from runtime.ending.outcome import permanent_failure

    def f(message: object) -> SimpleNamespace:
        return SimpleNamespace(message=message, timestamp=0.0)

    assert permanent_failure({0: f("RuntimeError: Connection reset by peer"), 1: f("")}) is None
    got = permanent_failure({1: f({"message": "Traceback...\nOSError: [Errno 28] No space left on device"}),
                             0: f("ValueError: nan loss")})
    assert got == "rank 1 failed with 'No space left on device' (OSError: [Errno 28] No space left on device)"
    assert "Disk quota exceeded" in (permanent_failure({3: f("OSError: [Errno 122] Disk quota exceeded")}) or "")


def test_rank0_straggler_check_skips_damaged_liveness_records(tmp_path: Path) -> None:
    import json as _json

    from hpc.contract.jobpaths import JobPaths
    from runtime.liveness.stragglers import StragglerWatch

    paths = JobPaths(tmp_path)
    paths.liveness(0).mkdir(parents=True)
    now = time.time()
    good = lambda rank, s: {"node": f"n{rank}", "node_rank": rank, "time": now,  # noqa: E731
                            "pace": [{"rank": rank, "compute_s": s}]}
    for n, content in enumerate([b"[1, 2]", b"\xff\xfe", b'{"time": "soon"}', b'{"time": 1e18, "pace": 5}',
                                 _json.dumps(good(0, 0.1)).encode(), _json.dumps(good(1, 0.1)).encode(),
                                 _json.dumps(good(2, 0.9)).encode()]):
        paths.liveness_node(0, n).write_bytes(content)
    watch = StragglerWatch(tmp_path, 0)
    assert watch.check(step=5) == []                         # once is not yet persistent
    [slow] = watch.check(step=6)
    assert slow.rank == 2


@pytest.mark.parametrize("content", [b"\xff\xfe", b"--project=evil", b"a b", b"x/../../y", b""])
def test_hpc_sync_refuses_a_damaged_wandb_run_id(tmp_path: Path, content: bytes) -> None:
    from hpc import sync
    from hpc.contract.errors import HpcError

    (tmp_path / "wandb_run_id").write_bytes(content + b"\n")
    with pytest.raises(HpcError, match="not a W&B run id"):
        sync.plan(tmp_path)


def test_hpc_sync_plans_a_real_run_id(tmp_path: Path) -> None:
    from hpc import sync

    (tmp_path / "wandb_run_id").write_text("ab12cd34\n")
    assert sync.plan(tmp_path).run_id == "ab12cd34"
