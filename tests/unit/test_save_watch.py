"""The evidence that holds back the kill after a SIGTERM under hpc run (runtime.launch.save_watch).

From both sides: a save that writes, or a Session in its save phase with a live process,
holds the kill back; a hung handler (nothing written, no save phase), a stopped process and a
save phase past its budget do not.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime.launch import save_watch
from runtime.liveness.heartbeat import Heartbeat
from runtime import stopping

pytestmark = pytest.mark.unit


def beat(phase: str, *, since: float, alive: float | None, budget_s: float | None = None) -> Heartbeat:
    return Heartbeat(pid=1, rank=3, local_rank=0, restart=0, phase=phase, step=5, steps_done=5, time=since,
                     p99_s=None, samples=0, budget_s=budget_s, alive_every_s=1.0, alive=alive)


def test_bytes_written_between_two_looks_are_a_save_progressing(tmp_path: Path) -> None:
    (tmp_path / "step-1.tmp").mkdir()
    before = save_watch.look(tmp_path, None, now=100.0)
    assert save_watch.progress(before, save_watch.look(tmp_path, None, now=102.0)) is None
    (tmp_path / "step-1.tmp" / "shard").write_bytes(b"x" * 4096)
    why = save_watch.progress(before, save_watch.look(tmp_path, None, now=102.0))
    assert why and "checkpoint directory changed" in why


def test_a_live_session_in_its_save_phase_holds_the_kill_back_a_stopped_or_overdue_one_not() -> None:
    empty = save_watch.Look(time=1000.0, files=0, bytes=0, newest_mtime=0.0)
    def with_(hb: Heartbeat) -> save_watch.Look:
        return save_watch.Look(time=1000.0, files=0, bytes=0, newest_mtime=0.0, heartbeats=(hb,))
    assert "rank 3 in its save phase" in save_watch.progress(empty, with_(beat("save", since=900, alive=999.5)))
    assert save_watch.progress(empty, with_(beat("step", since=990, alive=999.5))) is None      # a hung handler
    assert save_watch.progress(empty, with_(beat("save", since=990, alive=980))) is None       # SIGSTOPped
    assert save_watch.progress(empty, with_(beat("save", since=900, alive=999.5, budget_s=60))) is None  # overdue


def test_the_kill_waits_while_the_workers_save_and_comes_when_they_stop_progressing(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    import threading

    monkeypatch.setattr(stopping, "KILL_RECHECK_S", 0.2)
    answers = ["writing", "writing", None]
    killed = threading.Event()
    t = stopping.StopTracker(tmp_path / "stop.json", allocation=0, job_end_time=None, lead_s=120,
                             grace_s=None, under_slurm=False, kill_workers=lambda: killed.set() or [7],
                             kill_after_s=0.2, still_saving=lambda: answers.pop(0))
    started = time.monotonic()
    t.on_signal("SIGTERM", time.time())
    assert killed.wait(10) and time.monotonic() - started >= 0.2 + 2 * 0.2
    assert answers == []
    t.cancel()
