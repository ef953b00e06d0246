"""The recovery benchmark's judgment of a cell (benchmarks/recovery_cells.py), on job records.

The records are shaped as the runtime writes them (rank 0's ``progress.json`` fields, the
``inproc_*`` events of ``hpc/contract/events.py``): a cell must say how the job came back
(in-process, restarted, fallen back, or not at all) and count only steps truly done twice.
"""

from __future__ import annotations

import pytest

from benchmarks.recovery_cells import Watch, grown, merge, table

pytestmark = pytest.mark.unit

T = 1000.0


def prog(step: int, t: float, start: int = 0, world: int = 6) -> dict:
    return {"allocation": 0, "restart": 0, "step": step, "start_step": start, "world_size": world, "time": t}


def recovery(t: float, step: int, held: int) -> dict:
    return {"t": t, "ev": "inproc_recovery", "gen": 1, "world_size": 4, "old_world_size": 6, "step": step,
            "held": held, "t_detect": T + 0.3, "t_abort": T + 0.35, "t_reform": T + 1.0, "t_group": T + 1.2,
            "t_transfer": t}


def test_inprocess_recovery_is_timed_to_the_first_step_after_it():
    w = Watch(12, T)
    w.poll(prog(12, T - 0.1), [])
    w.poll(prog(13, T + 0.1), [])               # the step in flight at the fault finished
    evs = [recovery(T + 1.5, 13, 13)]
    w.poll(prog(13, T + 1.6, world=4), evs)     # the forced write right after the recovery
    assert not w.done
    w.poll(prog(14, T + 1.9, world=4), evs)
    r = w.result(120)
    assert r["how"] == "inprocess" and r["resume_s"] == 1.9 and r["steps_lost"] == 0
    assert r["detect_s"] == 0.3 and r["after_detect_s"] == 1.6
    assert r["phases_s"] == {"abort": 0.05, "reform": 0.65, "group": 0.2, "transfer": 0.3}
    assert r["world_size_after"] == 4 and not r["checkpoint_read"]


def test_a_rollback_counts_the_steps_done_twice():
    w = Watch(20, T)
    w.poll(prog(21, T + 0.2), [])
    evs = [recovery(T + 2.0, 20, 21)]
    w.poll(prog(21, T + 2.5), evs)
    assert w.result(120)["steps_lost"] == 1


def test_a_restart_from_the_checkpoint_counts_the_steps_since_it():
    w = Watch(10, T)
    w.poll(prog(11, T + 0.1), [])
    w.poll(prog(8, T + 7.0, start=8), [{"t": T + 6.0, "ev": "restore_end", "from_checkpoint": True, "step": 8}])
    assert not w.done                           # the restarted run's first record: no step yet
    w.poll(prog(9, T + 8.8, start=8), [])
    r = w.result(120)
    assert r["how"] == "restart" and r["resume_s"] == 8.8 and r["steps_lost"] == 3 and r["checkpoint_read"]


def test_an_inprocess_job_that_restarted_is_a_fallback_with_its_reason():
    w = Watch(10, T)
    evs = [{"t": T + 0.1, "ev": "inproc_detect", "pid": 5}, {"t": T + 0.2, "ev": "inproc_fallback",
                                                            "reason": "every local worker died"}]
    w.poll(prog(9, T + 9.0, start=8), evs)
    r = w.result(120)
    assert r["how"] == "fallback" and r["fallback_reasons"] == ["every local worker died"]
    assert r["inproc_detects"] == 1 and r["steps_lost"] == 2


def test_a_job_that_never_comes_back_is_a_timeout_that_says_what_was_seen():
    w = Watch(10, T)
    w.poll(prog(10, T - 0.1), [])
    r = w.result(120)
    assert r["how"] == "timeout" and r["resume_s"] is None and r["steps_lost"] is None
    assert "within 120 s" in r["reason"] and "step 10" in r["reason"] and "not seen" in r["reason"]


def test_events_before_the_fault_are_not_this_fault_s_recovery():
    w = Watch(30, T)
    w.poll(prog(31, T + 0.5), [recovery(T - 50, 3, 3)])    # an earlier generation (a join)
    assert not w.done and w.recovery is None


def test_merge_keeps_cells_not_measured_again_and_names_each_run():
    old = merge({}, {"started": "a"}, {"signal": {"signal_to_exit_s": 2.0}},
                [{"path": "restart", "fault": "freeze", "resume_s": 27.0, "run": "a"}])
    new = merge(old, {"started": "b"}, {}, [{"path": "inprocess", "fault": "freeze", "resume_s": 8.0, "run": "b"}])
    assert new["restart"]["freeze"]["run"] == "a" and new["inprocess"]["freeze"]["run"] == "b"
    assert new["signal"]["run"] == "a" and [r["started"] for r in new["runs"]] == ["a", "b"]
    assert "| inprocess | freeze |" in table(new)


def test_the_verdict_names_each_target_missed():
    from benchmarks.recovery_cells import verdict
    ok = {"how": "inprocess", "after_detect_s": 1.5, "resume_s": 1.9, "pids_kept": True, "steps_lost": 1}
    assert verdict("worker_kill", ok) == "meets"
    assert verdict("node_crash", {**ok, "after_detect_s": 3.4}) == "misses: after_detect_s 3.40 > 2"
    assert verdict("freeze", {**ok, "resume_s": 31.3, "pids_kept": False}) == \
        "misses: resume_s 31.30 > 10, survivors restarted"
    assert verdict("link_cut", {"how": "timeout", "resume_s": None}) == "misses: timeout"


def test_the_grow_after_a_shrink_is_the_first_joiner_recovery_after_the_fault():
    evs = [{"ev": "inproc_recovery", "t": 5.0, "t_detect": 4.0, "reason": "a joiner waits"},   # before
           {"ev": "inproc_recovery", "t": 11.0, "t_detect": 10.2, "reason": "fault announced: worker died"},
           {"ev": "inproc_recovery", "t": 19.0, "t_detect": 17.5, "reason": "a joiner waits", "world_size": 6}]
    assert grown(evs, 10.0) == evs[2]
    assert grown(evs[:2], 10.0) is None
