"""Fixtures shared by the distributed tier."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs (root), for the full-disk tests."""
    mnt = tmp_path / "small disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.fail(f"cannot mount a 4 MiB tmpfs for the full-disk test (needs root): {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def hydra_quiet_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hydra launcher tests' jobs: W&B offline in the test's directory, an index of their own."""
    from tests.wandb_offline import offline_env

    for key, value in offline_env(tmp_path / "wandb-env").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "hpc-home"))
