"""Paired-ratio statistics for the benchmarks: ratios per pair, the median, its 95 % interval.

Why paired: on a shared 2-core machine the speed of a loop drifts by several percent within
a minute (other processes, CPU frequency, page cache). Timing the baseline and the variant in
long separate runs puts that drift into the difference; timing them in short rounds that
alternate, and dividing each variant round by the baseline rounds on either side of it, cancels
the drift that is slower than a round (and a linear trend across the three rounds exactly).
The median of those ratios ignores the few pairs that another process's burst hit, and an
order-statistic interval for the median needs no assumption about the ratios' distribution.

Everything here is pure (lists of floats in, numbers out), so it is unit tested on recorded
inputs (tests/unit/test_pairstats.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


def median(values: Sequence[float]) -> float:
    """The sample median (mean of the two middle values for an even count)."""
    if not values:
        raise ValueError("median of no values")
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def sandwich_ratios(rounds: Sequence[tuple[str, float]], baseline: str = "bare") -> dict[str, list[float]]:
    """Each non-baseline round over the mean of the baseline rounds just before and after it.

    ``rounds`` is the sequence as run, e.g. ``[("bare", t0), ("session", t1), ("bare", t2), ...]``
    (seconds per step of each round). A variant round needs a baseline round on both sides; a
    baseline round with baseline rounds on both sides is also a variant (the A/A control, named
    ``baseline``): its ratio shows the benchmark's own noise floor.

    Returns:
        variant name -> its ratios, in run order.
    """
    out: dict[str, list[float]] = {}
    for i in range(1, len(rounds) - 1):
        name, value = rounds[i]
        (before, b), (after, a) = rounds[i - 1], rounds[i + 1]
        if before != baseline or after != baseline:
            continue
        out.setdefault(name, []).append(value / ((b + a) / 2))
    return out


def binom_cdf_half(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2), exact."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(min(k, n) + 1)) / 2**n


def median_ci_ranks(n: int, level: float = 0.95) -> tuple[int, int, float] | None:
    """The distribution-free interval for a median: 1-based ranks ``(lo, hi)`` and coverage.

    ``[x_(k), x_(n-k+1)]`` of the sorted sample covers the true median with probability
    ``1 - 2 P(X <= k-1)``, X ~ Binomial(n, 1/2); this picks the largest ``k`` (the narrowest
    interval) whose coverage is still at least ``level``. None when even ``[min, max]``
    falls short (n <= 5 for 95 %).
    """
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * binom_cdf_half(k - 1, n)
        if coverage < level:
            break
        best = (k, n - k + 1, coverage)
    return best


@dataclass(frozen=True)
class RatioSummary:
    """The median ratio of ``n`` pairs, its interval, and what it lets one say.

    ``half_width_pct`` is the larger distance from the median to an end of the interval, in
    percent of the median; the figure is trusted when that is within ``resolution_pct``.
    """

    n: int
    median: float
    lo: float | None
    hi: float | None
    coverage: float | None
    half_width_pct: float | None
    resolution_pct: float
    trusted: bool

    @property
    def overhead_pct(self) -> float:
        return (self.median - 1) * 100

    def verdict(self, target_pct: float) -> str:
        """``meets`` (the whole interval <= 1 + target), ``exceeds`` (all of it above),
        ``undecided`` (it straddles the target), or ``untrusted`` (too wide to say)."""
        if not self.trusted or self.lo is None or self.hi is None:
            return "untrusted"
        limit = 1 + target_pct / 100
        if self.hi <= limit:
            return "meets"
        if self.lo > limit:
            return "exceeds"
        return "undecided"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"overhead_pct": self.overhead_pct}


def summarize(ratios: Sequence[float], resolution_pct: float, level: float = 0.95) -> RatioSummary:
    """Median, ``level`` interval (order statistics) and whether it resolves ``resolution_pct``."""
    if not ratios:
        raise ValueError("no ratios to summarize")
    m = median(ratios)
    ranks = median_ci_ranks(len(ratios), level)
    if ranks is None:
        return RatioSummary(len(ratios), m, None, None, None, None, resolution_pct, False)
    s = sorted(ratios)
    lo, hi, coverage = s[ranks[0] - 1], s[ranks[1] - 1], ranks[2]
    half = max(m - lo, hi - m) / m * 100
    return RatioSummary(len(ratios), m, lo, hi, coverage, half, resolution_pct, half <= resolution_pct)
