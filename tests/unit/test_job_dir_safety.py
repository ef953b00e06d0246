"""Job directories: unique default names, no silent takeover of a user's directory, a full disk
refused up front and named when it fills."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from hpc.cli import main
from hpc.contract import diskspace, joblock, jobdir

pytestmark = pytest.mark.unit


def test_default_names_never_collide_within_one_second(tmp_path: Path) -> None:
    names = {jobdir.default_job_dir("train", root=tmp_path, now=1e9) for _ in range(1000)}
    assert len(names) == 1000
    for name in list(names)[:4]:
        jobdir.create(name)
        assert stat.S_IMODE(name.stat().st_mode) == 0o700


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


@pytest.mark.parametrize("how", ["path", "dot", "home"])
def test_run_refuses_an_existing_directory_that_is_not_a_job(tmp_path: Path, script: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str],
                                                           how: str) -> None:
    project = tmp_path / "project"
    project.mkdir(mode=0o755)
    os.chmod(project, 0o755)
    (project / "notes.txt").write_text("mine\n")
    monkeypatch.chdir(project)
    monkeypatch.setenv("HOME", str(project))
    arg = {"path": str(project), "dot": ".", "home": "~"}[how]
    assert main(["run", str(script), "--job-dir", arg]) == 2
    err = capsys.readouterr().err
    assert f"{project} exists, is not a job directory and holds 1 entry (notes.txt)" in err
    assert stat.S_IMODE(project.stat().st_mode) == 0o755          # not made private
    assert sorted(p.name for p in project.iterdir()) == ["notes.txt"]   # nothing written


def test_existing_job_dir_and_empty_dir_are_reused_without_changing_their_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared-job"
    shared.mkdir()
    os.chmod(shared, 0o750)
    assert jobdir.create(shared) == shared                         # empty: fine
    (shared / jobdir.JOBSPEC).write_text("{}")
    assert jobdir.create(shared) == shared                         # a job directory: resume
    assert stat.S_IMODE(shared.stat().st_mode) == 0o750


def test_run_refuses_a_job_dir_in_use(tmp_path: Path, script: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job"
    jobdir.create(job)
    with joblock.acquire(job, "hpc submit"):
        assert main(["run", str(script), "--job-dir", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"it is in use by `hpc submit` (pid {os.getpid()} on host" in err
    assert not (job / jobdir.JOBSPEC).exists()


def test_run_refuses_a_full_disk(tmp_path: Path, script: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: (4096, 8 << 30))
    assert main(["run", str(script), "--job-dir", str(tmp_path / "job")]) == 2
    err = capsys.readouterr().err
    assert "no space left on device (ENOSPC)" in err and "4.0 KiB free of 8.0 GiB" in err
    assert str(tmp_path / "job") in err


def test_failure_on_a_full_disk_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert diskspace.explain(tmp_path, "rank 1 exited with 1") == "rank 1 exited with 1"
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: (0, 3 << 20))
    assert diskspace.explain(tmp_path, "rank 1 exited with 1") == (
        f"disk full (ENOSPC) under the job directory, {tmp_path}: 0 B free of 3.0 MiB; "
        "rank 1 exited with 1")


def test_outcome_is_recorded_on_a_full_disk_from_the_reserve(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert diskspace.reserve(tmp_path)
    real_write, calls = os.write, []

    def full_until_the_reserve_is_back(fd: int, data: bytes) -> int:
        calls.append(data)
        if (tmp_path / diskspace.RESERVE).exists():
            if len(calls) == 1:
                return real_write(fd, data[:10])        # the last free bytes: a torn line
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_until_the_reserve_is_back)
    jobdir.append_outcome(tmp_path, jobdir.Outcome(allocation=0, kind="app_error", exit_code=1,
                                                   reason="disk full"))
    monkeypatch.setattr(os, "write", real_write)
    assert [o.reason for o in jobdir.read_outcomes(tmp_path)] == ["disk full"]
    assert not (tmp_path / diskspace.RESERVE).exists() and len(calls) == 2


LAUNCH = """
import sys, time
from hpc.backends import local
from hpc.cli import build_parser, build_spec
args = build_parser().parse_args(["run", sys.argv[1]])
args.script_args = []
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
job_dir, lock = local.prepare(build_spec(args))     # what `hpc run` does before its launchers
print(job_dir)
"""


def test_parallel_launches_with_default_names_get_their_own_directories(tmp_path: Path,
                                                                         script: Path) -> None:
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    start = time.time() + 2.0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", LAUNCH, str(script), str(start)], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    dirs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        dirs.append(Path(out.strip()))
    assert len(set(dirs)) == 4, dirs
    assert all(d.parent == tmp_path / "jobs" and (d / jobdir.JOBSPEC).exists() for d in dirs)
