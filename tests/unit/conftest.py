"""Fixtures shared by the unit tests that drive the ``hpc`` CLI in-process (``hpc.cli.main``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A training script in a fresh working directory that is also ``$HOME``, with no
    ``$HPC_CONFIG``: no config file of the user's or of another test can reach the CLI."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HPC_CONFIG", raising=False)
    s = tmp_path / "train.py"
    s.write_text("print('hi')\n")
    return s
