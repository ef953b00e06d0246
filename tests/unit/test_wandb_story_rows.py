"""The job's story as W&B rows (pure): the ledger per allocation, events at their steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.report.load import load
from hpc.report.wandb_story import COLUMNS, step_at, story, story_key

pytestmark = pytest.mark.unit
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "events" / "worker_fail_resume"


def test_step_at_interpolates_between_progress_points_and_never_across_a_resume() -> None:
    steps = [(100.0, 0), (110.0, 10), (120.0, 6), (130.0, 16)]
    assert step_at(steps, 99.0) is None
    assert step_at(steps, 105.0) == 5
    assert step_at(steps, 115.0) == 10        # the curve goes back to 6 (a resume): no blend
    assert step_at(steps, 125.0) == 11 and step_at(steps, 500.0) == 16


def test_rows_add_up_to_the_ledger_and_name_every_category() -> None:
    ledger = load(FIXTURE)
    s = story(ledger)
    rows = [dict(zip(s["columns"], r)) for r in s["rows"]]
    assert s["columns"] == COLUMNS and rows[-1]["allocation"] == "all"
    assert len(rows) == len(ledger.allocations) + 1
    assert sum(r["node_s"] for r in rows[:-1]) == pytest.approx(rows[-1]["node_s"], abs=0.01)
    cats = [c for c in COLUMNS if c.endswith("_s") and c not in ("wall_s", "node_s", "queue_s")]
    assert sum(rows[-1][c] for c in cats) == pytest.approx(rows[-1]["node_s"], abs=0.05)
    assert all(isinstance(r["allocation"], str) for r in rows)   # one type per column for wandb
    kinds = {e[1] for e in s["events"]}
    assert "failure" in kinds and "restart" in kinds, s["events"]
    assert s["summary"]["hpc/goodput_pct"] == pytest.approx(ledger.goodput * 100, abs=0.01)


def test_a_story_is_keyed_by_the_outcomes_so_it_is_told_once_per_ended_allocation() -> None:
    from hpc.contract import jobdir

    one = [jobdir.Outcome(allocation=0, kind="preempted", exit_code=75, time=1.0)]
    two = one + [jobdir.Outcome(allocation=1, kind="finished", exit_code=0, time=2.0)]
    assert story_key(one) == story_key(list(one)) != story_key(two)
