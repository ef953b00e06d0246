"""The event recorder: one line per event, step summaries, the null recorder, the reader."""

from __future__ import annotations

import json
import threading

import pytest

from hpc.contract.events import EVENTS, read_events
from runtime.events import EventLog, NullEventLog, StepSummary, process_start_time

pytestmark = pytest.mark.unit


def test_lines_from_many_threads_never_interleave(tmp_path):
    log = EventLog(tmp_path, allocation=3, rank=0, restart=1, sync_every_s=0.01)
    threads = [threading.Thread(target=lambda i=i: [log.emit("x", i=i, pad="y" * 500) for _ in range(200)])
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    lines = (tmp_path / EVENTS).read_text().splitlines()
    assert len(lines) == 800
    first = json.loads(lines[0])
    assert first["alloc"] == 3 and first["rank"] == 0 and first["restart"] == 1 and "node" in first


def test_step_summary_windows_cover_the_steps_back_to_back(tmp_path):
    log = EventLog(tmp_path, allocation=0, sync_every_s=0)
    summary = StepSummary(log, start_step=20, t0=100.0, every_s=5.0)
    for k in range(1, 31):                 # one step per 0.5 s: steps 21..50 in [100, 115]
        summary.done(20 + k, 100.0 + 0.5 * k)
    summary.flush()
    log.close()
    wins = [e for e in read_events(tmp_path) if e["ev"] == "steps"]
    assert [(w["first"], w["last"], w["count"]) for w in wins] == [(21, 30, 10), (31, 40, 10), (41, 50, 10)]
    assert [(w["t0"], w["t"]) for w in wins] == [(100.0, 105.0), (105.0, 110.0), (110.0, 115.0)]


def test_flush_without_time_ends_at_the_last_step(tmp_path):
    log = EventLog(tmp_path, allocation=0, sync_every_s=0)
    summary = StepSummary(log, start_step=0, t0=10.0, every_s=100.0)
    summary.done(1, 11.0)
    summary.done(2, 12.5)
    summary.flush()
    summary.flush()                        # nothing new: nothing written
    (w,) = [e for e in read_events(tmp_path) if e["ev"] == "steps"]
    assert (w["t0"], w["t"], w["last"]) == (10.0, 12.5, 2)


def test_reader_skips_torn_lines_and_sorts(tmp_path):
    (tmp_path / EVENTS).write_text('{"t": 2, "ev": "b", "alloc": 0}\n{"t": 1, "ev"\n'
                                   '{"t": 1, "ev": "a", "alloc": 0}\nnot json\n')
    assert [e["ev"] for e in read_events(tmp_path)] == ["a", "b"]
    assert read_events(tmp_path / "missing") == []


def test_null_and_unwritable_logs_are_quiet(tmp_path):
    NullEventLog().emit("x")
    (tmp_path / "a-file").write_text("")
    log = EventLog(tmp_path / "a-file", allocation=0)      # not a directory: quiet, no events
    log.emit("x")
    log.close()


def test_process_start_time_is_in_the_past():
    import time

    t = process_start_time()
    assert t is not None and time.time() - 3600 < t <= time.time()
