"""Rank-0 progress lines for log files: speed, ETA and loss, a few times a minute.

A line per step floods `hpc logs -f` and slows the loop on shared filesystems; a line every
`every_s` seconds is enough to see that a job is alive and how fast it goes. `ProgressMeter` is
pure (the clock is injected), so its rate and ETA arithmetic are unit tested with a fake clock.

The speed is an exponential moving average of steps per second measured between updates, seeded
by the first measured interval; a restart that resumes at step N starts counting from N, so the
ETA after a requeue reflects the current allocation's speed, not the whole job's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


def format_duration(seconds: float) -> str:
    """Format seconds compactly: `45s`, `3m24s`, `2h05m`, `3d04h`; `?` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


class ProgressMeter:
    """Tracks steps/s (EMA), ETA and the last loss; says when a line is due.

    Args:
        total_steps: the step the run ends at (> 0).
        clock: seconds, monotonic; injected for tests.
        every_s: minimum seconds between lines (> 0).
        smoothing: EMA weight of the newest rate measurement, in (0, 1].
        start_step: the step training starts (or resumes) at.

    Raises:
        ValueError: a non-positive total, interval, or a smoothing outside (0, 1].
    """

    def __init__(self, total_steps: int, clock: Callable[[], float] = time.monotonic, *,
                 every_s: float = 30.0, smoothing: float = 0.3, start_step: int = 0) -> None:
        if total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {total_steps}")
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.total_steps = total_steps
        self.clock = clock
        self.every_s = every_s
        self.smoothing = smoothing
        self.step = start_step
        self.loss: float | None = None
        self.rate: float | None = None  # steps per second, EMA
        self._mark_step = start_step
        self._mark_time = clock()
        self._last_line = self._mark_time
        self._start = (start_step, self._mark_time)

    def update(self, step: int, loss: float | None = None) -> str | None:
        """Record that `step` finished; return a progress line when one is due, else None.

        Args:
            step: the step just completed (non-decreasing).
            loss: the step's loss, if known.

        Returns:
            The line (see `line`) at most once per `every_s` seconds, and always at the last step.
        """
        assert step >= self.step, f"step went backwards: {step} < {self.step}"
        self.step = step
        if loss is not None:
            self.loss = float(loss)
        now = self.clock()
        elapsed = now - self._mark_time
        # Measure speed over spans of at least a second (or every_s, whichever is smaller) so a
        # fast loop does not feed the EMA with noise from one step.
        if elapsed >= min(1.0, self.every_s) and step > self._mark_step:
            measured = (step - self._mark_step) / elapsed
            self.rate = measured if self.rate is None else (
                self.smoothing * measured + (1 - self.smoothing) * self.rate)
            self._mark_step, self._mark_time = step, now
        if now - self._last_line >= self.every_s or step >= self.total_steps:
            self._last_line = now
            return self.line()
        return None

    @property
    def speed(self) -> float | None:
        """Steps per second: the smoothed rate, else the average since the start (a run shorter
        than one measuring span), else None before any step."""
        if self.rate is not None:
            return self.rate
        first_step, first_time = self._start
        elapsed = self.clock() - first_time
        if self.step > first_step and elapsed > 0:
            return (self.step - first_step) / elapsed
        return None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current speed, or None while the speed is unknown."""
        if self.step >= self.total_steps:
            return 0.0
        speed = self.speed
        if not speed:
            return None
        return (self.total_steps - self.step) / speed

    def line(self, step: int | None = None) -> str:
        """One line: `step 120/1000 (12.0%) | 4.31 steps/s | loss 2.1345 | eta 3m24s`.

        Args:
            step: The step the line names (default: the latest; a logged row's step lags it).
        """
        step = self.step if step is None else step
        pct = 100.0 * step / self.total_steps
        speed = self.speed
        rate = "? steps/s" if speed is None else f"{speed:.2f} steps/s"
        loss = "?" if self.loss is None else f"{self.loss:.4f}"
        eta = "?" if self.eta_s is None else format_duration(self.eta_s)
        return f"step {step}/{self.total_steps} ({pct:.1f}%) | {rate} | loss {loss} | eta {eta}"
