"""ProgressMeter with a fake clock: line rate, EMA speed, ETA and the line format."""

from __future__ import annotations

import pytest

from runtime.worker.progress import ProgressMeter, format_duration

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_line_format_matches_the_documented_shape() -> None:
    clock = FakeClock()
    meter = ProgressMeter(1000, clock, every_s=10)
    clock.t += 10
    line = meter.update(120, loss=2.13449)
    # 120 steps in 10 s = 12 steps/s; 880 left -> 73.3 s
    assert line == "step 120/1000 (12.0%) | 12.00 steps/s | loss 2.1345 | eta 1m13s"


def test_lines_come_at_most_every_interval_not_every_step() -> None:
    clock = FakeClock()
    meter = ProgressMeter(10_000, clock, every_s=30)
    lines = []
    for step in range(1, 1001):
        clock.t += 0.25  # 4 steps/s for 250 s
        line = meter.update(step, loss=1.0)
        if line:
            lines.append(line)
    assert len(lines) == 8  # 250 s / 30 s
    assert all("4.00 steps/s" in line for line in lines)


def test_speed_is_an_ema_that_follows_a_slowdown() -> None:
    clock = FakeClock()
    meter = ProgressMeter(10_000, clock, every_s=5, smoothing=0.5)
    step = 0
    for _ in range(10):  # 10 steps/s
        clock.t += 1
        step += 10
        meter.update(step)
    assert meter.rate == pytest.approx(10.0)
    clock.t += 1
    step += 2  # 2 steps/s
    meter.update(step)
    assert meter.rate == pytest.approx(6.0)
    assert meter.eta_s == pytest.approx((10_000 - step) / 6.0)


def test_last_step_always_prints_and_unknowns_show_question_marks() -> None:
    clock = FakeClock()
    meter = ProgressMeter(3, clock, every_s=60)
    assert meter.update(1) is None
    assert meter.line() == "step 1/3 (33.3%) | ? steps/s | loss ? | eta ?"   # no time has passed
    assert meter.update(3) == "step 3/3 (100.0%) | ? steps/s | loss ? | eta 0s"


def test_a_run_shorter_than_one_measuring_span_ends_with_its_average_speed() -> None:
    clock = FakeClock()
    meter = ProgressMeter(40, clock, every_s=15)
    for step in range(1, 41):
        clock.t += 0.02          # 40 steps in 0.8 s: never a full 1-s span for the EMA
        line = meter.update(step, loss=3.0)
    assert meter.rate is None
    assert line == "step 40/40 (100.0%) | 50.00 steps/s | loss 3.0000 | eta 0s"


def test_resumed_meter_counts_from_its_start_step() -> None:
    clock = FakeClock()
    meter = ProgressMeter(1000, clock, every_s=10, start_step=500)
    clock.t += 10
    assert meter.update(600) == "step 600/1000 (60.0%) | 10.00 steps/s | loss ? | eta 40s"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"total_steps": 0}, "total_steps"),
    ({"total_steps": 5, "every_s": 0}, "every_s"),
    ({"total_steps": 5, "smoothing": 0}, "smoothing"),
])
def test_bad_arguments_raise_value_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProgressMeter(**kwargs)


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (59.4, "59s"), (204, "3m24s"), (3600 * 2 + 300, "2h05m"),
    (86400 * 3 + 3600 * 4, "3d04h"), (float("inf"), "?"), (-1, "?"),
])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
