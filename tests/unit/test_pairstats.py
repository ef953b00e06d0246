"""The step-overhead benchmark's statistics (benchmarks/pairstats.py), on recorded inputs.

The interval ranks are checked against the binomial table for the median (n=10: 2nd and 9th
values, 97.85 %; n=20: 6th and 15th, 95.86 %), and the ratios against a round sequence
recorded by ``benchmarks/step_overhead.py`` on the project VM.
"""

from __future__ import annotations

import pytest

from benchmarks.pairstats import (
    binom_cdf_half,
    median,
    median_ci_ranks,
    sandwich_ratios,
    summarize,
)

pytestmark = pytest.mark.unit


def test_median_odd_and_even():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        median([])


def test_binomial_cdf_exact():
    assert binom_cdf_half(1, 10) == 11 / 1024
    assert binom_cdf_half(5, 20) == 21700 / 2**20
    assert binom_cdf_half(-1, 5) == 0.0
    assert binom_cdf_half(7, 7) == 1.0


@pytest.mark.parametrize(("n", "expected"), [
    (6, (1, 6, 1 - 2 / 64)),
    (10, (2, 9, 1 - 2 * 11 / 1024)),
    (20, (6, 15, 1 - 2 * 21700 / 2**20)),
    (30, (10, 21, None)),
])
def test_median_interval_ranks_match_the_binomial_table(n, expected):
    lo, hi, coverage = median_ci_ranks(n)
    assert (lo, hi) == expected[:2]
    assert coverage >= 0.95
    if expected[2] is not None:
        assert coverage == pytest.approx(expected[2])


def test_too_few_pairs_have_no_95_interval():
    assert median_ci_ranks(5) is None
    s = summarize([1.0, 1.1, 0.9, 1.0, 1.05], resolution_pct=3.0)
    assert s.lo is None and not s.trusted and s.verdict(3.0) == "untrusted"


# A block as the benchmark ran it (seconds per step of each round, 100 ms steps, 2026-11-25
# 01:18): bare, Session, bare, bare, bare.
RECORDED_BLOCK = [("bare", 0.0990581), ("session", 0.1000126), ("bare", 0.0991628), ("bare", 0.0989758),
                  ("bare", 0.0993976)]


def test_sandwich_ratios_divide_by_the_mean_of_both_neighbours():
    r = sandwich_ratios(RECORDED_BLOCK)
    assert r["session"] == [pytest.approx(0.1000126 / ((0.0990581 + 0.0991628) / 2))]
    # A bare round between two bare rounds is the A/A control; the ends have no two neighbours.
    assert r["bare"] == [pytest.approx(0.0989758 / ((0.0991628 + 0.0993976) / 2))]
    assert set(r) == {"session", "bare"}


def test_sandwich_needs_baseline_on_both_sides():
    assert sandwich_ratios([("bare", 1.0), ("session", 1.1), ("metrics", 1.2), ("bare", 1.0)]) == {}


# Session/bare ratios recorded on the VM: 15 blocks at 100 ms steps (load average ~10), and 20
# blocks at 10 ms steps of a run whose first Session round included W&B's start (1.37).
RECORDED_100MS = [1.0091, 1.0088, 1.0074, 1.0001, 1.0076, 1.004, 1.0097, 1.0092, 1.0059, 1.007,
                  1.0088, 1.009, 1.0029, 1.0113, 1.0066]
RECORDED_10MS = [1.1269, 0.9982, 0.7783, 0.9058, 0.9663, 1.0043, 1.0132, 0.8155, 1.0482, 1.0281,
                 1.3742, 0.9505, 1.0811, 1.0428, 1.1191, 1.0785, 1.0115, 1.0833, 1.059, 1.2498]


def test_summary_of_recorded_ratios_at_100ms():
    s = summarize(RECORDED_100MS, resolution_pct=1.0)
    assert s.n == 15 and s.median == 1.0076
    assert (s.lo, s.hi) == (1.0059, 1.0091)             # 4th and 12th of 15
    assert s.coverage == pytest.approx(1 - 2 * binom_cdf_half(3, 15))
    assert s.half_width_pct == pytest.approx((1.0076 - 1.0059) / 1.0076 * 100)   # the longer side
    assert s.trusted and s.verdict(1.0) == "meets"
    assert s.overhead_pct == pytest.approx(0.76)


def test_summary_of_recorded_noisy_ratios_at_10ms_is_not_trusted():
    s = summarize(RECORDED_10MS, resolution_pct=3.0)
    srt = sorted(RECORDED_10MS)
    assert s.median == pytest.approx((srt[9] + srt[10]) / 2) == pytest.approx(1.03545)
    assert (s.lo, s.hi) == (srt[5], srt[14]) == (0.9982, 1.0811)   # 6th and 15th of 20
    assert s.half_width_pct == pytest.approx(4.4087, abs=1e-3)
    assert not s.trusted and s.verdict(3.0) == "untrusted"


def test_a_wide_interval_is_not_trusted():
    s = summarize([0.95, 1.10, 1.00, 0.90, 1.20, 1.05, 0.85, 1.15, 1.02, 0.98], resolution_pct=1.0)
    assert not s.trusted and s.verdict(1.0) == "untrusted"


def test_verdicts_at_the_target():
    above = summarize([1.030 + i * 1e-4 for i in range(20)], resolution_pct=1.0)
    assert above.verdict(1.0) == "exceeds"
    straddles = summarize([1.005 + i * 5e-4 for i in range(20)], resolution_pct=1.0)
    assert straddles.lo < 1.01 < straddles.hi and straddles.verdict(1.0) == "undecided"
