"""Job-directory bookkeeping files: atomic writes, tolerant reads."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from hpc.contract import jobdir

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("durable", [True, False])
def test_write_atomic_replaces_whole_private_files(tmp_path: Path, durable: bool) -> None:
    path = tmp_path / jobdir.PROGRESS
    jobdir.write_atomic(path, '{"step": 1}\n', durable=durable)
    jobdir.write_atomic(path, '{"step": 2}\n', durable=durable)
    assert jobdir.read_json(path) == {"step": 2}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [jobdir.PROGRESS]   # no temp file left


@pytest.mark.parametrize("content", ["", '{"step": 4', "\x00\x00"])
def test_read_json_treats_an_unreadable_file_as_absent(tmp_path: Path, content: str) -> None:
    (tmp_path / "progress.json").write_text(content)
    assert jobdir.read_json(tmp_path / "progress.json") is None
    assert jobdir.read_json(tmp_path / "missing.json") is None
