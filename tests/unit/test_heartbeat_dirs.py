"""Heartbeat directories left in /dev/shm by killed launchers are cleaned at the next start
(issue 23's probe: every kill -9 left one behind, 34 of 34), and nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from runtime.liveness.watchdog import HEARTBEAT_DIR_QUIET_S, clean_stale_heartbeat_dirs

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _left(root: Path, name: str, age_s: float, *, beat: bool = True) -> Path:
    d = root / name
    d.mkdir()
    if beat:
        (d / "123-0.json").write_text("{}")
    then = time.time() - age_s
    for p in (*d.iterdir(), d):
        os.utime(p, (then, then))
    return d


def test_only_this_users_quiet_dirs_of_dead_launchers_are_removed(tmp_path: Path) -> None:
    uid, old = os.getuid(), HEARTBEAT_DIR_QUIET_S + 60
    live = subprocess.Popen(["sleep", "60"])
    try:
        dead = _left(tmp_path, f"hpc-liveness-{uid}-{_dead_pid()}", old)
        dead_empty = _left(tmp_path, f"hpc-liveness-{uid}-{_dead_pid()}", old, beat=False)
        kept = [
            _left(tmp_path, f"hpc-liveness-{uid}-{_dead_pid()}", 5),          # beating lately
            _left(tmp_path, f"hpc-liveness-{uid}-{live.pid}", old),           # its launcher runs
            _left(tmp_path, f"hpc-liveness-{uid + 1}-{_dead_pid()}", old),    # another user's
            _left(tmp_path, f"hpc-liveness-{uid}-{os.getpid()}", old),        # this process's
            _left(tmp_path, f"hpc-liveness-{uid}-x1", old),                   # not a pid
            _left(tmp_path, "other-dir", old),
        ]
        (tmp_path / f"hpc-liveness-{uid}-{_dead_pid()}-file").write_text("not a dir")
        removed = clean_stale_heartbeat_dirs(tmp_path)
    finally:
        live.kill()
        live.wait()
    assert sorted(removed) == sorted([dead, dead_empty])
    assert not dead.exists() and not dead_empty.exists()
    assert all(k.is_dir() for k in kept)


def test_a_missing_root_cleans_nothing(tmp_path: Path) -> None:
    assert clean_stale_heartbeat_dirs(tmp_path / "none") == []
