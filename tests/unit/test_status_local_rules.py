"""`hpc status` and `hpc run` jobs: listed without arguments, with real elapsed times (pure parts;
tests/distributed/test_status_local.py runs a real `hpc run`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc import status
from hpc.contract.jobdir import Outcome
from hpc.contract.records import JobRecord
from hpc.contract.index import record_job
from hpc.local_clock import LocalClock, Span, local_clock
from hpc.status import build_views, format_table

pytestmark = pytest.mark.unit

T0 = 1_800_000_000.0


def _events(alloc: int, start: float, end: float | None, nodes: int = 2) -> list[dict]:
    out = []
    for n in range(nodes):   # each node's launcher writes its own start and end, a moment apart
        out.append({"t": start + n * 0.5, "ev": "alloc_start", "alloc": alloc, "node": f"n{n}"})
        out.append({"t": start + 3, "ev": "steps", "alloc": alloc, "node": "n0"})
        if end is not None:
            out.append({"t": end - n * 0.5, "ev": "alloc_end", "alloc": alloc, "node": f"n{n}"})
    return out


def _local(job_dir: str = "/j/run1") -> JobRecord:
    return JobRecord("", job_dir, "run1", "local", T0)


def test_an_ended_allocation_lasts_from_its_first_start_to_its_last_end() -> None:
    clock = local_clock(_events(0, T0, T0 + 125), [Outcome(0, "finished", 0, time=T0 + 126)], None)
    assert clock.running is None
    assert clock.spans[0] == Span(T0, T0 + 125)
    assert clock.spans[0].elapsed_s(now=T0 + 9999) == 125     # an ended one stops counting


def test_an_allocation_without_alloc_end_ends_at_its_outcome_else_its_last_event() -> None:
    events = _events(0, T0, None) + _events(1, T0 + 500, None)
    clock = local_clock(events, [Outcome(0, "app_error", 1, time=T0 + 60)], None)
    assert clock.spans[0].end == T0 + 60
    assert clock.spans[1].end == T0 + 503                      # hpc run killed: its last event


def test_the_allocation_a_live_hpc_run_holds_is_running() -> None:
    events = _events(0, T0, T0 + 100) + _events(1, T0 + 200, None)
    clock = local_clock(events, [Outcome(0, "preempted", 75, time=T0 + 100)],
                        running_since=T0 + 199)
    assert clock.running == 1 and clock.spans[1] == Span(T0 + 200, None)
    assert clock.spans[1].elapsed_s(now=T0 + 260) == 60
    # before its launchers wrote anything, it runs since the lock was taken
    assert local_clock([], [], running_since=T0).spans[0] == Span(T0, None)


def test_views_show_local_elapsed_times_and_the_running_allocation() -> None:
    outcomes = {"/j/run1": [Outcome(0, "preempted", 75, step=40, time=T0 + 100)]}
    clocks = {"/j/run1": LocalClock({0: Span(T0, T0 + 100), 1: Span(T0 + 200)}, running=1)}
    view = build_views([_local()], {}, (), outcomes, clocks=clocks, now=T0 + 3800)[0]
    assert view.state == "local: running" and view.elapsed_s == 3600 and view.requeues == 1
    assert [a.elapsed_s for a in view.allocations] == [100, 3600]
    assert view.allocations[-1].describe() == "#1 local (running)"
    assert "01:00:00" in format_table([view])

    ended = build_views([_local()], {}, (), outcomes, clocks={"/j/run1": LocalClock({0: Span(T0, T0 + 100)})},
                        now=T0 + 3800)[0]
    assert ended.state == "local: preempted" and ended.elapsed_s == 100
    assert "00:01:40" in format_table([ended])


def test_without_arguments_hpc_run_jobs_are_listed_once_each(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPC_HOME", str(tmp_path / "home"))
    for rec in (_local("/j/a"), JobRecord("7", "/j/s", "s", "sbatch", T0), _local("/j/b"), _local("/j/a")):
        record_job(rec)     # /j/a run twice: one job, listed where its latest run is
    assert [r.key for r in status._jobs_from_args([])] == ["7", "/j/b", "/j/a"]
