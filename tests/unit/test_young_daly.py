"""The checkpoint interval rule (Young/Daly) and the --checkpoint-interval value, by hand."""

from __future__ import annotations

import math

import pytest

from hpc.contract.errors import SpecError
from hpc.contract.interval import check_checkpoint_interval, parse_checkpoint_interval, prior_mtbf_s
from hpc.contract.jobspec import JobSpec
from hpc.report import young_daly as yd

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cost, mtbf, expected", [
    (10.0, 3600.0, 268.3281572999748),     # sqrt(72000)
    (0.5, 21600.0, 146.96938456699067),    # sqrt(21600)
    (60.0, 86400.0, 3219.937887599233),    # sqrt(10368000)
    (0.0, 3600.0, 0.0),
])
def test_young_daly_by_hand(cost, mtbf, expected):
    assert yd.young_daly_s(cost, mtbf) == pytest.approx(expected, rel=1e-12)


def test_young_daly_refuses_nonsense():
    with pytest.raises(ValueError):
        yd.young_daly_s(-1, 10)
    with pytest.raises(ValueError):
        yd.young_daly_s(1, 0)


def test_mtbf_prior_is_one_pseudo_interruption():
    assert yd.mtbf_s(21600, 0, 0) == 21600                # a new job: the prior
    assert yd.mtbf_s(21600, 3600, 5) == pytest.approx(25200 / 6)   # 4200 s
    assert yd.mtbf_s(21600, 10 * 86400, 0) == 21600 + 864000       # a quiet job: longer


def test_choose_applies_the_floors():
    c = yd.choose(save_cost_s=2.0, save_total_s=30.0, prior_mtbf_s=21600, observed_s=0, interruptions=0)
    assert c.every_s == pytest.approx(math.sqrt(2 * 2.0 * 21600))   # 293.9 s
    assert yd.choose(save_cost_s=0.001, save_total_s=40.0, prior_mtbf_s=3600, observed_s=0,
                     interruptions=0).every_s == 40.0                 # never faster than a save
    assert yd.choose(save_cost_s=0.0, save_total_s=0.0, prior_mtbf_s=3600, observed_s=0,
                     interruptions=0).every_s == yd.MIN_INTERVAL_S


def _job(interrupted: int, hours: float = 10.0) -> list[dict]:
    """A job's events: `interrupted` crashed worker groups, then one that runs on; 2 s saves."""
    evs, t = [], 0.0
    span = hours * 3600 / (interrupted + 1)
    for k in range(interrupted + 1):
        evs += [{"t": t, "ev": "session_start", "alloc": 0, "rank": 0, "restart": k},
                {"t": t + 10, "ev": "ckpt_save", "alloc": 0, "rank": 0, "restart": k, "block_s": 2.0},
                {"t": t + 20, "ev": "ckpt_commit", "alloc": 0, "rank": 0, "restart": k, "save_s": 8.0}]
        if k < interrupted:
            evs.append({"t": t + span, "ev": "crash", "alloc": 0, "rank": 0, "restart": k})
        t += span
    evs.append({"t": t, "ev": "steps", "alloc": 0, "rank": 0, "restart": interrupted})
    return evs


def test_a_job_interrupted_often_gets_a_shorter_interval():
    choices = {}
    for n in (0, 2, 20):
        h = yd.history(_job(n), current=(0, n))
        assert h.interruptions == n and h.save_cost_s == 2.0 and h.save_total_s == 8.0
        choices[n] = yd.choose(save_cost_s=h.save_cost_s, save_total_s=h.save_total_s,
                               prior_mtbf_s=21600, observed_s=h.observed_s, interruptions=n).every_s
    # By hand: observed ~10 h = 36000 s; MTBF = (21600 + 36000) / (1 + n)
    assert choices[0] == pytest.approx(math.sqrt(2 * 2 * 57600), rel=1e-3)        # 480 s
    assert choices[2] == pytest.approx(math.sqrt(2 * 2 * 57600 / 3), rel=1e-3)    # 277 s
    assert choices[20] == pytest.approx(math.sqrt(2 * 2 * 57600 / 21), rel=1e-3)  # 105 s
    assert choices[20] < choices[2] < choices[0]


def test_history_counts_vanished_groups_and_stops_but_not_time_limits():
    evs = [{"t": 0, "ev": "session_start", "alloc": 0, "rank": 0, "restart": 0},
           {"t": 50, "ev": "steps", "alloc": 0, "rank": 0, "restart": 0},          # vanished
           {"t": 60, "ev": "session_start", "alloc": 1, "rank": 0, "restart": 0},
           {"t": 70, "ev": "stop_begin", "alloc": 1, "rank": 0, "restart": 0, "kind": "time_limit"},
           {"t": 80, "ev": "session_start", "alloc": 2, "rank": 0, "restart": 0},
           {"t": 90, "ev": "stop_begin", "alloc": 2, "rank": 0, "restart": 0, "kind": "preempted"},
           {"t": 95, "ev": "hang", "alloc": 2},
           {"t": 100, "ev": "session_start", "alloc": 3, "rank": 0, "restart": 0}]   # the caller
    h = yd.history(evs, current=(3, 0))
    assert h.interruptions == 3 and h.observed_s == pytest.approx(50 + 10 + 10)


@pytest.mark.parametrize("given, normalized, prior", [
    ("fixed", "fixed", None), ("auto", "auto", 21600.0), ("AUTO:6h", "auto", 21600.0),
    ("auto:2h", "auto:7200", 7200.0), ("auto:90m", "auto:5400", 5400.0),
    ("auto:1.5d", "auto:129600", 129600.0), ("auto:3600", "auto:3600", 3600.0),
])
def test_interval_values(given, normalized, prior):
    assert parse_checkpoint_interval(given) == normalized
    check_checkpoint_interval(normalized)
    assert prior_mtbf_s(normalized) == prior


@pytest.mark.parametrize("bad", ["", "sometimes", "auto:", "auto:10s", "auto:2y", "auto:-1h", 5, None])
def test_interval_refuses_bad_values(bad):
    with pytest.raises(SpecError) as e:
        parse_checkpoint_interval(bad)
    assert "--checkpoint-interval" in str(e.value)


def test_jobspec_field_round_trips():
    spec = JobSpec(script="train.py", checkpoint_interval="auto:7200")
    assert JobSpec.from_json(spec.to_json()).checkpoint_interval == "auto:7200"
    assert JobSpec(script="train.py").checkpoint_interval == "fixed"
    with pytest.raises(SpecError):
        JobSpec(script="train.py", checkpoint_interval="auto:2h")   # not normalized
