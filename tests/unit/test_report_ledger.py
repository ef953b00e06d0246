"""The goodput ledger on event streams: hand-built ones with known answers and one recorded
from a real ``hpc run`` (tests/fixtures/events/worker_fail_resume: a worker failure in step 25,
one elastic restart that fails again, a second run that resumes at 20 and finishes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc.contract.events import read_events
from hpc.contract.ledger import CATEGORIES, build
from hpc.report.table import format_table, to_json

pytestmark = pytest.mark.unit
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "events" / "worker_fail_resume"


def ev(t, name, alloc=0, rank=0, restart=0, node="n1", **kw):
    e = {"t": t, "ev": name, "alloc": alloc, "node": node, **kw}
    if rank is not None:
        e.update(rank=rank, restart=restart)
    return e


def launcher(t, name, alloc=0, node="n1", **kw):
    return ev(t, name, alloc=alloc, rank=None, node=node, **kw)


def clean_run(alloc=0, t=0.0, start_step=0, steps=100, restart=0):
    """100 s allocation: 10 s start-up, 2 s rendezvous, 3 s restore, 80 s of steps with a
    1 s blocking save at t+50, a 5 s teardown."""
    return [
        launcher(t + 0, "alloc_start", alloc),
        launcher(t + 4, "agent_rendezvous", alloc, t0=t + 3),
        ev(t + 8, "session_start", alloc, restart=restart, t_proc=t + 5),
        ev(t + 10, "rendezvous", alloc, restart=restart),
        ev(t + 11, "restore_begin", alloc, restart=restart),
        ev(t + 14, "restore_end", alloc, restart=restart, step=start_step),
        ev(t + 15, "loop_start", alloc, restart=restart, step=start_step),
        ev(t + 50, "ckpt_save", alloc, restart=restart, step=start_step + steps // 2, block_s=1.0),
        ev(t + 55, "steps", alloc, restart=restart, t0=t + 15, first=start_step + 1,
           last=start_step + steps // 2, count=steps // 2),
        ev(t + 95, "steps", alloc, restart=restart, t0=t + 55, first=start_step + steps // 2 + 1,
           last=start_step + steps, count=steps // 2),
        ev(t + 97, "session_end", alloc, restart=restart, ok=True),
        launcher(t + 100, "alloc_end", alloc, kind="finished", exit_code=0),
    ]


def test_clean_run_by_hand():
    led = build(clean_run())
    c = led.categories
    # start-up: [0,3] + [4,8] (launcher, agent, spawn, imports) + [10,11] + [14,15]
    assert c["startup"] == pytest.approx(3 + 4 + 1 + 1)
    assert c["rendezvous"] == pytest.approx(1 + 2)       # the agent's round + the process group
    assert c["restore"] == pytest.approx(3)
    assert c["checkpoint"] == pytest.approx(1)
    assert c["productive"] == pytest.approx(80 - 1)
    assert c["teardown"] == pytest.approx(5)
    assert c["unaccounted"] == pytest.approx(0)
    assert sum(c.values()) == pytest.approx(100) == led.allocated_node_s
    assert led.goodput == pytest.approx(0.79)
    assert led.lost_steps == 0 and led.interruptions == 0


def test_preemption_then_resume_loses_nothing_and_queue_comes_from_slurm():
    first = clean_run()[:-3] + [
        ev(96, "stop_begin", kind="preempted", signal="SIGTERM"),
        ev(98, "stop_end", kind="preempted", saved_step=100),
        ev(99, "session_end", ok=True),
        launcher(90.5, "signal", signal="SIGTERM"),
        launcher(100, "alloc_end", kind="preempted", exit_code=75),
    ]
    first = [e for e in first if not (e["ev"] == "steps" and e["t"] == 95)] + [
        ev(96, "steps", t0=55, first=51, last=100, count=50)]
    second = clean_run(alloc=1, t=200, start_step=100)
    runs = {0: {"submit": -30.0, "start": 0.0, "end": 100.0}, 1: {"submit": 100.0, "start": 200.0, "end": 300.0}}
    led = build(first + second, slurm_runs=runs)
    a0, a1 = led.allocations
    assert a0.categories["preemption"] == pytest.approx(2)
    assert a0.categories["teardown"] == pytest.approx(1 + 1)    # [98,99] + [99,100]
    assert led.lost_steps == 0 and a1.start_step == 100
    assert (a0.queue_s, a1.queue_s, led.queue_s) == (30.0, 100.0, 130.0)
    assert led.interruptions == 1
    assert [m.kind for m in a0.markers].count("signal") == 1
    assert sum(led.categories.values()) == pytest.approx(200)


def test_crash_and_restart_count_lost_steps_and_their_time():
    # Steps 1..60 in [15, 75] (1 s each), checkpoint at 50; crash in step 61 at 75.5;
    # the restart resumes at 50: steps 51..60 (10 s) and the step in flight (0.5 s) are lost.
    evs = clean_run()[:7] + [
        ev(75, "steps", t0=15, first=1, last=60, count=60),
        ev(75.5, "crash", step=60, error="RuntimeError: boom"),
        ev(76, "session_end", ok=False),
        launcher(78, "agent_rendezvous", t0=77),
        ev(80, "session_start", restart=1, t_proc=79),
        ev(81, "rendezvous", restart=1),
        ev(81, "restore_begin", restart=1),
        ev(82, "restore_end", restart=1, step=50),
        ev(82, "loop_start", restart=1, step=50),
        ev(132, "steps", restart=1, t0=82, first=51, last=100, count=50),
        ev(133, "session_end", restart=1, ok=True),
        launcher(135, "alloc_end", kind="finished", exit_code=0),
    ]
    led = build(evs)
    (a,) = led.allocations
    assert led.lost_steps == 10 == a.lost_steps and a.restarts == 1
    assert a.categories["lost"] == pytest.approx(10 + 0.5)
    # re-form: from the crash to the restarted worker's process start, then its PG set-up
    assert a.categories["rendezvous"] == pytest.approx((79 - 75.5) + 1 + (1 + 2))
    assert a.categories["productive"] == pytest.approx(60 - 10 + 50)
    assert sum(a.categories.values()) == pytest.approx(135)
    assert led.interruptions == 1
    assert any(m.kind == "failure" and "boom" in m.label for m in a.markers)


def test_a_worker_group_that_vanished_is_lost_time_and_an_interruption():
    evs = clean_run()[:7] + [ev(40, "steps", t0=15, first=1, last=25, count=25),
                             launcher(60, "alloc_end", kind="node_failure", exit_code=76)]
    led = build(evs, outcomes=[{"allocation": 0, "kind": "node_failure", "last_step": 27}])
    (a,) = led.allocations
    assert a.categories["lost"] == pytest.approx(20)          # last sign of life 40 -> end 60
    assert led.interruptions == 1 and a.kind == "node_failure" and a.last_step == 27


def test_node_seconds_weight_nodes_and_a_node_that_left_early():
    evs = clean_run() + [launcher(0, "alloc_start", node="n2"), launcher(40, "alloc_end", node="n2")]
    led = build(evs)
    (a,) = led.allocations
    assert a.nodes == ("n1", "n2") and a.node_s == pytest.approx(140)
    assert sum(a.categories.values()) == pytest.approx(140)
    assert a.categories["teardown"] == pytest.approx(5)       # only n1 was still there


def test_hang_from_the_watchdog_record():
    evs = clean_run()[:7] + [ev(30, "steps", t0=15, first=1, last=15, count=15),
                             {"t": 50, "ev": "hang", "alloc": 0, "node": "n1", "reason": "rank 1 stuck"},
                             ev(50.5, "crash", step=15, error="killed"), ev(51, "session_end", ok=False),
                             launcher(55, "alloc_end", kind="hang", exit_code=1)]
    (a,) = build(evs).allocations
    assert a.categories["hang"] == pytest.approx(20)
    assert any(m.kind == "hang" for m in a.markers)


def test_an_allocation_without_a_launcher_end_ends_at_its_last_event():
    evs = clean_run()[:-1]
    (a,) = build(evs).allocations
    assert a.end == 97 and sum(a.categories.values()) == pytest.approx(97)


def test_recorded_stream_worker_failure_and_resume():
    evs = read_events(FIXTURE)
    outcomes = [json.loads(x) for x in (FIXTURE / "outcomes.jsonl").read_text().splitlines()]
    led = build(evs, outcomes=outcomes)
    a0, a1 = led.allocations
    assert led.lost_steps == 10 and a0.restarts == 1 and a1.start_step == 20 and a1.last_step == 40
    for a in led.allocations:
        assert sum(a.categories.values()) == pytest.approx(a.wall_s, rel=1e-9)
        assert a.categories["unaccounted"] < 0.01 * a.wall_s
    assert (a0.kind, a1.kind) == ("app_error", "finished")
    assert [c for c in CATEGORIES if led.categories[c] > 0] == [
        "productive", "startup", "rendezvous", "restore", "checkpoint", "lost", "teardown"]


def test_json_and_table():
    led = build(read_events(FIXTURE))
    data = json.loads(to_json(led))
    assert set(data["categories"]) == set(CATEGORIES)
    assert data["allocated_node_s"] == pytest.approx(sum(data["categories"].values()))
    assert data["allocations"][0]["spans"][0][2] == "startup"
    assert data["checkpoint_interval"]["every_s"] > 0
    text = format_table(led, "job")
    assert "goodput" in text and "lost work (recomputed)" in text and "Young/Daly" in text


def test_sacct_runs_merge_a_resized_allocation_and_date_the_lost_node():
    from datetime import datetime

    from hpc.contract.slurm_parse import parse_sacct
    from hpc.report.load import runs_from_accounting

    text = (Path(__file__).resolve().parents[1] / "fixtures" / "slurm" /
            "sacct_preempted_then_resized.txt").read_text()
    runs = runs_from_accounting(parse_sacct(text), "45")
    ts = lambda s: datetime.fromisoformat(s).timestamp()  # noqa: E731
    assert list(runs) == [0, 1]
    assert runs[0]["start"] - runs[0]["submit"] == 1.0
    assert (runs[1]["submit"], runs[1]["start"], runs[1]["end"]) == (
        ts("2026-11-24T22:16:26"), ts("2026-11-24T22:16:32"), ts("2026-11-24T22:17:22"))
    assert runs[1]["node_ends"] == {"node1": ts("2026-11-24T22:17:22"), "node2": ts("2026-11-24T22:17:22"),
                                    "node3": ts("2026-11-24T22:17:04")}


def test_a_run_requeued_while_resized_is_its_own_allocation():
    """A ``--no-kill`` job resized twice (node2, then node1 lost), requeued, preempted, requeued:
    the record after the last ``RESIZING`` one starts 12 s later on a node it did not hold, so it
    is the next allocation. Merged (as before), the first allocation's frame ran on to the
    second's end and the campaign's ledger counted 4-5 nodes where Slurm had 2-3."""
    from datetime import datetime

    from hpc.contract.slurm_parse import parse_sacct
    from hpc.report.load import runs_from_accounting

    tag = "hpc-tag:0"
    text = "\n".join([
        f"183|183|train_gpt|debug|RESIZING|0:0|00:00:20|node[1-3]|2026-11-27T10:00:00|2026-11-27T10:00:20|2026-11-27T09:59:59|None|{tag}",
        f"183|183|train_gpt|debug|RESIZING|0:0|00:00:21|node[1,3]|2026-11-27T10:00:20|2026-11-27T10:00:41|2026-11-27T10:00:20|None|{tag}",
        f"183|183|train_gpt|debug|PREEMPTED|0:0|00:00:34|node[2-3]|2026-11-27T10:00:53|2026-11-27T10:01:27|2026-11-27T10:00:41|BeginTime|{tag}",
        f"183|183|train_gpt|debug|COMPLETED|0:0|00:00:23|node[1,3]|2026-11-27T10:01:50|2026-11-27T10:02:13|2026-11-27T10:01:27|BeginTime|{tag}",
    ])
    runs = runs_from_accounting(parse_sacct(text), "183")
    ts = lambda s: datetime.fromisoformat(f"2026-11-27T{s}").timestamp()  # noqa: E731
    assert [(r["start"], r["end"]) for r in runs.values()] == [
        (ts("10:00:00"), ts("10:00:41")), (ts("10:00:53"), ts("10:01:27")), (ts("10:01:50"), ts("10:02:13"))]
    assert runs[0]["node_ends"] == {"node1": ts("10:00:41"), "node2": ts("10:00:20"), "node3": ts("10:00:41")}
    assert runs[1]["node_ends"] == {"node2": ts("10:01:27"), "node3": ts("10:01:27")}
    # A resize's records meet exactly: still one allocation (the fixture of the test above).
    joined = parse_sacct(text.replace("10:00:53", "10:00:41"))
    assert len(runs_from_accounting(joined, "183")) == 3      # node2 was not in the record before
    joined = parse_sacct(text.replace("node[2-3]|2026-11-27T10:00:53", "node[3]|2026-11-27T10:00:41"))
    assert len(runs_from_accounting(joined, "183")) == 2


def test_a_node_that_died_silently_counts_until_slurm_dropped_it():
    evs = clean_run() + [launcher(0, "alloc_start", node="n2")]          # n2 never ends
    runs = {0: {"submit": 0.0, "start": 0.0, "end": 100.0, "node_ends": {"n1": 100.0, "n2": 30.0}}}
    (a,) = build(evs, slurm_runs=runs).allocations
    assert a.node_ends == {"n1": 100.0, "n2": 30.0} and a.node_s == pytest.approx(130)
    assert sum(a.categories.values()) == pytest.approx(130)
    assert a.node_dead == {}                  # no failure was seen: n2 just counts to 30


def test_a_dead_node_is_lost_from_the_failure_until_slurm_dropped_it():
    evs = clean_run()[:-3] + [launcher(0, "alloc_start", node="n2"),
                              ev(60, "crash", step=40, error="gloo: connection closed"),
                              ev(61, "session_end", ok=False),
                              launcher(100, "alloc_end", kind="app_error", exit_code=1)]
    runs = {0: {"submit": 0.0, "start": 0.0, "end": 100.0, "node_ends": {"n1": 100.0, "n2": 80.0}}}
    (a,) = build(evs, slurm_runs=runs).allocations
    assert a.node_dead == {"n2": 60.0} and a.node_s == pytest.approx(180)
    assert sum(a.categories.values()) == pytest.approx(180)
    # n2: [60, 80] lost on top of n1's share of the same time (the step in flight, then teardown)
    only_n1 = build([e for e in evs if e.get("node") != "n2"]).allocations[0].categories["lost"]
    assert only_n1 == pytest.approx(60 - 55)
    assert a.categories["lost"] == pytest.approx(2 * only_n1 + 20)


def test_recorded_cluster_stream_preemption_then_node_crash():
    """Recorded on the test cluster (tests/slurm/test_report_on_cluster.py): preempted at step 10,
    requeued, node3 killed at step 15; node1's agent re-formed *without* counting a restart, so
    both worker groups of allocation 1 have restart 0: groups are told apart by session_start."""
    from hpc.contract.slurm_parse import parse_sacct
    from hpc.report.load import runs_from_accounting

    d = FIXTURE.parent / "preempt_node_crash"
    outcomes = [json.loads(x) for x in (d / "outcomes.jsonl").read_text().splitlines()]
    runs = runs_from_accounting(parse_sacct((d / "sacct.txt").read_text()), "64")
    led = build(read_events(d), outcomes=outcomes, slurm_runs=runs)
    a0, a1 = led.allocations
    assert (a0.kind, a1.kind) == ("preempted", "finished")
    assert a0.last_step == 10 == a1.start_step and a0.lost_steps == 0
    assert a1.restarts == 1 and a1.lost_steps == 1 == led.lost_steps      # 15 done, resumed at 14
    assert a0.categories["preemption"] > 0 and a1.categories["rendezvous"] > 0
    assert set(a1.nodes) == {"node1", "node2", "node3"} and "node3" in a1.node_dead
    assert a1.node_ends["node3"] == runs[1]["node_ends"]["node3"] < a1.end
    assert (a0.queue_s, a1.queue_s) == (0.0, 6.0)
    for a, e in zip(led.allocations, (18, 38)):   # sacct: 18 s; 30 s + 8 s (the resize)
        assert sum(a.categories.values()) == pytest.approx(a.node_s, rel=1e-9)
        assert abs(a.wall_s - e) <= 2.0
        assert a.categories["unaccounted"] < 0.01 * a.node_s
    assert led.interruptions == 2
    assert [m.kind for m in a1.markers].count("restart") == 1


def test_slurm_runs_are_matched_by_time_not_by_order():
    # sacct lists an older job with the same id first (ids wrap; a test cluster restarts at 1)
    runs = {0: {"submit": -1000.0, "start": -900.0, "end": -800.0, "node_ends": {}},
            1: {"submit": -20.0, "start": 0.0, "end": 100.0, "node_ends": {}}}
    (a,) = build(clean_run(), slurm_runs=runs).allocations
    assert a.queue_s == 20.0 and a.start == 0.0
    (b,) = build(clean_run(), slurm_runs={0: runs[0]}).allocations   # only a stranger's run
    assert b.queue_s is None


def plain_run(t=0.0, restarts=0):
    """A script without the Session: only the launcher's frame. 2 s launcher start-up, a 1 s
    rendezvous round, workers from 3 to 93 s (a restart re-forms for 2 s at 50), end at 95."""
    evs = [launcher(t, "alloc_start", node_rank=0),
           launcher(t + 3, "agent_rendezvous", t0=t + 2, node_rank=0),
           launcher(t + 3, "workers_started", node_rank=0, agent_restarts=0)]
    if restarts:
        evs += [launcher(t + 52, "agent_rendezvous", t0=t + 50, node_rank=0),
                launcher(t + 52, "workers_started", node_rank=0, agent_restarts=1)]
    return evs + [launcher(t + 93, "workers_ended", node_rank=0, state="SUCCEEDED"),
                  launcher(t + 95, "alloc_end", node_rank=0, kind="finished", exit_code=0)]


def test_a_script_without_the_session_is_productive_while_it_runs():
    led = build(plain_run())
    c = led.categories
    assert c["productive"] == pytest.approx(90)            # 3..93: the workers ran
    assert c["startup"] == pytest.approx(2) and c["rendezvous"] == pytest.approx(1)
    assert c["teardown"] == pytest.approx(2)
    assert sum(c.values()) == pytest.approx(95)
    assert led.goodput == pytest.approx(90 / 95)
    assert len(led.notes) == 1 and "no Session events" in led.notes[0]
    assert "not seen" in format_table(led) and json.loads(to_json(led))["notes"] == led.notes


def test_a_script_without_the_session_restarted_re_forms_between_its_groups():
    led = build(plain_run(restarts=1))
    c = led.categories
    assert c["rendezvous"] == pytest.approx(1 + 2)         # the first round + the re-form
    assert c["productive"] == pytest.approx(47 + 41)       # 3..50 and 52..93
    assert led.allocations[0].restarts == 1
    assert [m.kind for m in led.allocations[0].markers] == ["restart"]


def test_session_runs_carry_no_note():
    assert build(clean_run()).notes == []


def test_a_job_requeued_after_a_resize_holds_each_second_of_its_nodes_once():
    """Recorded on the test cluster (campaign, session 13, one hot spare, seed 1): a node crash
    resized the job, a preemption requeued it, the rendezvous host's loss requeued it again.
    sacct ended the resized record when the *second* allocation ended and left the second
    record without an end: matched as they were, allocations 0 and 1 both held [0, 105] and the
    ledger counted 833 allocated node-s, where 3 nodes over the job's 161 s hold at most 483."""
    d = FIXTURE.parent / "spare_requeued_after_resize"
    outcomes = [json.loads(x) for x in (d / "outcomes.jsonl").read_text().splitlines()]
    runs = dict(enumerate(json.loads((d / "slurm_runs.json").read_text())))
    evs = read_events(d)
    led = build(evs, outcomes=outcomes, slurm_runs=runs)
    a0, a1, a2 = led.allocations
    span = max(e["t"] for e in evs) - min(e["t"] for e in evs)
    assert led.allocated_node_s <= 3 * span
    # one allocation at a time: each ends before the next begins; the first when Slurm requeued it
    assert max(a0.node_ends.values()) == runs[1]["submit"] <= a1.start
    assert max(a1.node_ends.values()) <= a2.start
    for a in led.allocations:
        assert sum(a.categories.values()) == pytest.approx(a.node_s, rel=1e-9)


def _repaint(segs: list[list], t0: float, t1: float, a, b, cat: str) -> list[list]:
    """The timeline's paint as it was: every segment visited, sorted and merged again."""
    if a is None or b is None:
        return segs
    a, b = max(a, t0), min(b, t1)
    if b <= a:
        return segs
    out = []
    for s0, s1, c in segs:
        if s1 <= a or s0 >= b:
            out.append([s0, s1, c])
            continue
        if s0 < a:
            out.append([s0, a, c])
        if s1 > b:
            out.append([b, s1, c])
    out.append([a, b, cat])
    out.sort(key=lambda s: s[0])
    merged: list[list] = []
    for s in out:
        if merged and merged[-1][2] == s[2] and abs(merged[-1][1] - s[0]) < 1e-9:
            merged[-1][1] = s[1]
        else:
            merged.append(s)
    return merged


def test_a_paint_that_touches_only_its_neighbours_leaves_the_segments_a_full_repaint_leaves():
    """The timeline's paint finds the segments it covers by bisection; its segments (their
    bounds to the object: 3 and 3.0 print apart in the JSON) are those of the full repaint
    over 2,000 random paints: overlapping, touching, nested, reversed, outside, None."""
    import random

    from hpc.contract.ledger import _Timeline

    rng = random.Random(29)
    for trial in range(20):
        t0, t1 = 0.0, 100.0
        tl, ref = _Timeline(t0, t1), [[t0, t1, "unaccounted"]]
        for _ in range(100):
            a, b = (rng.choice([None, rng.randint(-5, 105), float(rng.randint(-5, 105)), rng.uniform(-5, 105)])
                    for _ in range(2))
            cat = rng.choice(["startup", "rendezvous", "productive", "lost"])
            tl.paint(a, b, cat)
            ref = _repaint(ref, t0, t1, a, b, cat)
            assert [[(type(x), x) for x in s] for s in tl.segs] == [[(type(x), x) for x in s] for s in ref]


def restarting_job(n: int) -> list[dict]:
    """``n`` nodes of one allocation whose worker group vanished and came back ``n // 25``
    times (each a hang, then no end: 10 steps lost each time); half the nodes end without a
    record of their own (silent)."""
    def rank0(t, name, restart, **kw):
        return {"t": t, "ev": name, "alloc": 0, "node": "n0", "rank": 0, "restart": restart, **kw}

    k = n // 25
    evs = [{"t": 0.001 * r, "ev": "alloc_start", "alloc": 0, "node": f"n{r}", "node_rank": r} for r in range(n)]
    for g in range(k):
        t, step = 10.0 + 100 * g, 50 * g
        evs += [rank0(t, "session_start", g, t_proc=t - 0.5), rank0(t + 1, "rendezvous", g),
                rank0(t + 1, "restore_begin", g), rank0(t + 2, "restore_end", g, step=step),
                rank0(t + 2, "loop_start", g, step=step),
                rank0(t + 60, "steps", g, t0=t + 2, first=step + 1, last=step + 60, count=60),
                {"t": t + 70, "ev": "hang", "alloc": 0, "node": "n1", "reason": "stall", "step": step + 60}]
    evs += [{"t": 10.0 + 100 * k, "ev": "alloc_end", "alloc": 0, "node": f"n{r}", "node_rank": r,
             "kind": "node_failure"} for r in range(0, n, 2)]
    return sorted(evs, key=lambda e: e["t"])


def test_the_ledger_is_linear_in_its_events_when_groups_hangs_and_silent_nodes_grow_with_them():
    """Each worker group looked for the next one that resumed among all after it, a vanished
    group for the next sign of anyone, a hang for its last step window, and each silent node
    for its first failure among all markers, each by a scan: O(groups x events), O(hangs x
    events), O(nodes x markers). Counted in lines of Python run (not timed) at 100 and 800
    nodes with their groups, hangs and silent nodes in proportion: eight times the events, at
    most ten times the work (it was 38 times)."""
    from tests.work import lines_run

    for n in (100, 800):
        (a,) = build(restarting_job(n)).allocations
        assert a.restarts == n // 25 - 1 and a.lost_steps == 10 * (n // 25 - 1)
        assert len(a.node_dead) == n // 2 - 1 and len(a.node_ends) == n   # n1 hung after the last failure
    small, big = (lines_run(lambda evs=restarting_job(n): build(evs)) for n in (100, 800))
    assert big <= 10 * small, (small, big)
