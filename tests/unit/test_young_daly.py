"""The checkpoint interval rule (Young/Daly) and the --checkpoint-interval value, by hand."""

from __future__ import annotations

import json
import math

import pytest

from hpc.contract.errors import SpecError
from hpc.contract.interval import check_checkpoint_interval, parse_checkpoint_interval, prior_mtbf_s
from hpc.contract.jobspec import JobSpec
from hpc.contract import young_daly as yd
from tests.conftest import REPO

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


def test_choose_keeps_the_interval_between_5_and_30_minutes():
    c = yd.choose(save_cost_s=2.0, save_total_s=30.0, prior_mtbf_s=86400, observed_s=0, interruptions=0)
    assert c.every_s == pytest.approx(math.sqrt(2 * 2.0 * 86400))   # 587.9 s: inside the bounds
    fast = yd.choose(save_cost_s=0.01, save_total_s=0.3, prior_mtbf_s=21600, observed_s=0,
                     interruptions=0)
    assert fast.optimum_s == pytest.approx(math.sqrt(2 * 0.01 * 21600))   # 20.8 s (async save)
    assert fast.every_s == yd.MIN_INTERVAL_S == 300                       # the floor
    assert yd.choose(save_cost_s=0.001, save_total_s=400.0, prior_mtbf_s=3600, observed_s=0,
                     interruptions=0).every_s == 400.0                 # never faster than a save
    assert yd.choose(save_cost_s=0.0, save_total_s=0.0, prior_mtbf_s=3600, observed_s=0,
                     interruptions=0).every_s == yd.MIN_INTERVAL_S
    # A first allocation's guess of a slow save, a long prior: still every 30 minutes at most.
    slow = yd.choose(save_cost_s=120.0, save_total_s=120.0, prior_mtbf_s=86400, observed_s=0,
                     interruptions=0, source="estimated")
    assert slow.optimum_s > 4000 and slow.every_s == yd.MAX_INTERVAL_S == 1800
    assert yd.choose(save_cost_s=1.0, save_total_s=2400.0, prior_mtbf_s=3600, observed_s=0,
                     interruptions=0).every_s == 1800                  # the ceiling wins


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
                               prior_mtbf_s=21600, observed_s=h.observed_s, interruptions=n).optimum_s
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
    assert JobSpec(script="train.py").checkpoint_interval == "auto"     # on by default
    with pytest.raises(SpecError):
        JobSpec(script="train.py", checkpoint_interval="auto:2h")   # not normalized


def test_an_explicit_minute_interval_wins_over_auto():
    from hpc.contract.interval import effective

    assert effective("auto", 0.0) == "auto" and effective("auto:3600", 0.0) == "auto:3600"
    assert effective("auto", 10.0) == "fixed" and effective("fixed", 0.0) == "fixed"


@pytest.mark.parametrize("interval, every_min, every_steps, session, warned", [
    ("auto", 0.0, 0, True, None),
    ("fixed", 0.0, 0, True, "no periodic checkpoints"),
    ("fixed", 0.0, 100, True, None),
    ("fixed", 5.0, 0, True, None),
    ("auto", 0.0, 0, False, "train.py does not import runtime.session"),
    ("auto", 0.0, 0, None, None),
])
def test_a_run_that_will_not_checkpoint_is_told(interval, every_min, every_steps, session, warned):
    from hpc.contract.interval import no_checkpoint_warning

    line = no_checkpoint_warning(interval, every_min, every_steps, session, "train.py")
    assert (line is None) if warned is None else (warned in line and "\n" not in line)


def test_session_use_is_read_from_the_source():
    from hpc.contract.interval import uses_session

    assert uses_session("from runtime.session import Session\n")
    assert uses_session("import runtime.session as rs\n")
    assert uses_session("from runtime import sampler, session\n")
    assert not uses_session("import torch\nclass Session: pass\n")
    assert not uses_session((REPO / "examples" / "ddp_plain.py").read_text())
    assert uses_session((REPO / "examples" / "train_gpt.py").read_text())


def test_save_schedule_probe_is_one_extra_save():
    from runtime.checkpoint.manifest import SaveSchedule

    s = SaveSchedule(every_min=5.0, probe_step=20)
    due = [k for k in range(1, 60) if s.due(k, now=100.0, last_step=None, last_time=0.0)]
    assert due == [20]                                        # not every step after it
    assert not s.due(20, now=100.0, last_step=20, last_time=0.0)


class _Ckpt:
    """What the recorder reads of a Checkpointer (pure stand-in for its schedule)."""

    def __init__(self) -> None:
        from runtime.checkpoint.manifest import SaveSchedule

        self.schedule = SaveSchedule()

    def latest_step(self):
        return None

    def estimated_save_s(self) -> float:
        return 0.002


def _recorded(tmp_path, allocation: int):
    """A rank-0 recorder and the auto interval the Session pairs with it."""
    from runtime.checkpoint.auto_interval import AutoInterval
    from runtime.events import SessionRecorder

    rec = SessionRecorder(tmp_path, rank=0, allocation=allocation, restart=0, world_size=2)
    return rec, AutoInterval(tmp_path, rank=0, key=rec.key, emit=rec.emit)


def test_auto_on_a_first_allocation_probes_early_then_keeps_the_bounds(tmp_path):
    rec, auto = _recorded(tmp_path, 0)
    ckpt = _Ckpt()
    auto.restored(ckpt, 0, "auto")
    assert ckpt.schedule.probe_step == 20                       # nothing measured: save soon
    assert ckpt.schedule.every_min == yd.MIN_INTERVAL_S / 60    # and within the bounds
    rec.close(None, None, 0)
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["probe_step"] for e in events if e["ev"] == "ckpt_interval"] == [20]   # recorded
    # A later allocation with a measured save: no probe, the rule alone.
    with (tmp_path / "events.jsonl").open("a") as f:
        for e in ({"t": 1.0, "ev": "ckpt_save", "alloc": 0, "rank": 0, "restart": 0, "block_s": 0.01},
                  {"t": 2.0, "ev": "ckpt_commit", "alloc": 0, "rank": 0, "restart": 0, "save_s": 0.3}):
            f.write(json.dumps(e) + "\n")
    rec, auto = _recorded(tmp_path, 1)
    ckpt = _Ckpt()
    auto.restored(ckpt, 40, "auto")
    assert ckpt.schedule.probe_step is None and ckpt.schedule.every_min == 5.0
    rec.close(None, None, 40)
    ckpt = _Ckpt()
    _recorded(tmp_path, 2)[1].restored(ckpt, 40, "fixed")
    assert ckpt.schedule.every_min is None and ckpt.schedule.probe_step is None


def test_the_minute_interval_is_asked_only_when_timed(tmp_path):
    """The Session asks the clock (one broadcast under DDP) only at its agreement steps; in
    between only the step rules apply, with no collective."""
    import time as _time

    from runtime.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path / "ckpt", every_steps=50, every_min=5.0)
    later = _time.time() + 301
    assert ckpt.should_save(7, now=later) and not ckpt.should_save(7, now=later, timed=False)
    assert ckpt.should_save(50, now=later, timed=False)          # the step rule still applies
