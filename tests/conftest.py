"""Shared fixtures. Tiers are markers (unit, distributed, slurm, gpu); see pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# DeepSpeed's CPU op (deepspeed_shm_comm) is JIT-compiled into torch's extension cache; the
# default one (~/.cache/torch_extensions) is shared by every checkout on the machine and a build
# from another venv's path is rebuilt (minutes, inside some test's deadline). This venv's own,
# which scripts/setup.sh fills; subprocesses and Slurm jobs (--export=ALL) inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

# Paths users really have: spaces, quotes, shell metacharacters. Every test that puts a path
# into a script or a command runs with these too.
HOSTILE_NAMES = ["plain", "with space", "quote's \"dq\"", "semi;colon $HOME `x`"]


def wait_until(pred, timeout: float, what: str, interval: float = 0.3) -> None:
    """Polls ``pred`` until it is true; fails naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def hpc(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs the ``hpc`` CLI as a user would (``python -m hpc ARGS``) from the repository."""
    return subprocess.run([sys.executable, "-m", "hpc", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def squeue_state(env: dict[str, str], job_id: str) -> str:
    """The job's state in squeue, ``GONE`` once it has left the queue, ``UNKNOWN`` when squeue
    failed (a busy controller: "Socket timed out"), which is no sign that the job ended."""
    r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0 and "Invalid job id" not in r.stderr:
        return "UNKNOWN"
    return r.stdout.strip() or "GONE"


def sacct_rows(env: dict[str, str], job_id: str, fields: str, *args: str,
               until=bool, timeout: float = 60.0) -> list[list[str]]:
    """``sacct -X -n -P -j JOB -o FIELDS ARGS`` as rows of fields, once ``until(rows)`` holds.

    slurmdbd records a job's runs a moment after slurmctld acted on them (the controller sends
    them on asynchronously), so a read right after a job started, was requeued or ended may
    find nothing yet, or an older picture: a full CI run once saw an empty ``Comment`` right
    after a job ended. This waits, bounded, for the record the test needs.
    """
    rows: list[list[str]] = []

    def ready() -> bool:
        nonlocal rows
        r = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", fields, *args], env=env,
                           capture_output=True, text=True)
        rows = [line.split("|") for line in r.stdout.splitlines() if line.strip()]
        return r.returncode == 0 and bool(until(rows))

    wait_until(ready, timeout, f"sacct {fields} of job {job_id} (last read: {rows})", interval=0.5)
    return rows


@pytest.fixture(params=HOSTILE_NAMES, ids=["plain", "space", "quotes", "shellmeta"])
def hostile_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    d = tmp_path / request.param
    d.mkdir()
    return d


@pytest.fixture(autouse=True, scope="session")
def _private_job_index(tmp_path_factory: pytest.TempPathFactory):
    """``hpc run`` and ``hpc submit`` record their jobs in ``$HPC_HOME``: the tests' jobs go to
    an index of their own, never the user's ``~/.hpc`` (tests that read it set their own)."""
    old = os.environ.get("HPC_HOME")
    os.environ["HPC_HOME"] = str(tmp_path_factory.mktemp("hpc-home"))
    yield
    if old is None:
        os.environ.pop("HPC_HOME", None)
    else:
        os.environ["HPC_HOME"] = old


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Slurm/torchrun variables leak into a test from the outer environment."""
    for k in list(os.environ):
        if k == "HPC_HOME":
            continue
        if k.startswith(("SLURM_", "TORCHELASTIC_", "HPC_")) or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
