"""The fault campaign's numbers (benchmarks/campaign_metrics.py): schedule, baseline ledger, costs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import campaign_metrics as cm  # noqa: E402
from hpc.contract.ledger import build  # noqa: E402


def test_schedule_is_seeded_spaced_and_has_every_kind_once():
    a, b = cm.schedule(1, 240), cm.schedule(1, 240)
    assert a == b, "the same seed gives every contender the same schedule"
    assert a != cm.schedule(2, 240)
    steps = [s for s, _ in a]
    assert sorted(k for _, k in a) == sorted(cm.KINDS)
    assert steps == sorted(steps) and steps[0] >= 15 and steps[-1] <= 225
    assert all(y - x >= 30 for x, y in zip(steps, steps[1:]))


def test_schedule_refuses_what_cannot_fit_and_unknown_kinds():
    with pytest.raises(ValueError, match="need at least 180 steps"):
        cm.schedule(1, 100)
    with pytest.raises(ValueError, match="valid: preempt"):
        cm.schedule(1, 240, ("meteor",))


# A baseline run recorded as train_plain.py writes it: allocation 0 trains steps 1-4 (a save at
# 2), its workers are killed after step 4 (no end), torchrun restarts them, they resume at 2 and
# finish at 5. Slurm: one allocation of 2 nodes from t=0 to t=30.
RECORDS = [
    {"ev": "start", "t": 2.0, "t_proc": 1.0, "alloc": 0, "restart": 0, "node": "node1"},
    {"ev": "restored", "t0": 3.0, "t": 4.0, "step": 0, "alloc": 0, "restart": 0},
    {"ev": "step", "t": 5.0, "step": 1, "world": 2, "alloc": 0, "restart": 0},
    {"ev": "step", "t": 6.0, "step": 2, "world": 2, "alloc": 0, "restart": 0},
    {"ev": "save", "t0": 6.0, "t": 6.5, "step": 2, "alloc": 0, "restart": 0},
    {"ev": "step", "t": 7.5, "step": 3, "world": 2, "alloc": 0, "restart": 0},
    {"ev": "step", "t": 8.5, "step": 4, "world": 2, "alloc": 0, "restart": 0},
    {"ev": "start", "t": 15.0, "t_proc": 13.0, "alloc": 0, "restart": 1, "node": "node1"},
    {"ev": "restored", "t0": 16.0, "t": 17.0, "step": 2, "alloc": 0, "restart": 1},
    {"ev": "step", "t": 18.0, "step": 3, "world": 2, "alloc": 0, "restart": 1},
    {"ev": "step", "t": 19.0, "step": 4, "world": 2, "alloc": 0, "restart": 1},
    {"ev": "step", "t": 20.0, "step": 5, "world": 2, "alloc": 0, "restart": 1},
    {"ev": "end", "t": 21.0, "step": 5, "alloc": 0, "restart": 1},
]
RUNS = {0: {"start": 0.0, "end": 30.0, "nodes": ["node1", "node2"],
            "node_ends": {"node1": 30.0, "node2": 30.0}}}


def test_the_hpc_report_ledger_applies_to_the_baselines_step_records():
    ledger = build(cm.plain_events(RECORDS, RUNS), slurm_runs=RUNS)
    assert ledger.allocated_node_s == pytest.approx(60.0)
    assert ledger.lost_steps == 2, "steps 3 and 4 were computed twice"
    cats = ledger.categories
    assert sum(cats.values()) == pytest.approx(60.0)
    # Productive: the loops [4, 8.5] and [17, 20] less the lost steps 3-4 (6.5..8.5) and the
    # save's block (6.0..6.5), on 2 nodes.
    assert cats["productive"] == pytest.approx(2 * (2.0 + 3.0))
    assert cats["lost"] > 2 * 2.0 - 1e-9
    assert cats["checkpoint"] == pytest.approx(2 * 0.5)
    assert 0 < ledger.goodput < 0.5


def test_a_fault_costs_the_node_seconds_until_the_job_is_back_at_its_step():
    ledger = build(cm.plain_events(RECORDS, RUNS), slurm_runs=RUNS)
    # The fault at t=7 (step 3 done); group 0 still completes step 4 before it takes effect.
    trace = [(5.0, 1, 0), (6.0, 2, 0), (7.5, 3, 0), (8.5, 4, 0), (18.0, 3, 1), (19.0, 4, 1), (20.0, 5, 1)]
    [cost] = cm.fault_costs([{"kind": "worker_kill", "t": 7.0, "step": 2}], trace,
                            ledger.allocations, 30.0)
    assert cost["recovered"] and cost["back_s"] == pytest.approx(13.0), "back at step 5, beyond 4"
    assert cost["lost_node_s"] == pytest.approx(26.0), "2 nodes x (20 - 7) s"
    [never] = cm.fault_costs([{"kind": "freeze", "t": 25.0, "step": 9}], trace, ledger.allocations, 30.0)
    assert not never["recovered"] and never["lost_node_s"] == pytest.approx(10.0)


def test_recovery_in_place_is_back_at_the_first_step_beyond_the_fault():
    trace = [(1.0, 1, "g"), (2.0, 2, "g"), (9.0, 3, "g"), (10.0, 4, "g")]
    assert cm.back_at(trace, 2.5) == 9.0
    assert cm.back_at(trace, 11.0) is None


def test_queue_wait_between_allocations_costs_no_node_seconds():
    class A:
        def __init__(self, start, ends):
            self.start, self.node_ends = start, ends
    allocs = [A(0.0, {"n1": 10.0, "n2": 10.0}), A(20.0, {"n1": 30.0, "n2": 30.0, "n3": 25.0})]
    assert cm.node_seconds(allocs, 5.0, 22.0) == pytest.approx(2 * 5.0 + 3 * 2.0)


def test_summary_pairs_seeds_and_gives_ratios_to_the_baseline():
    def run(c, seed, goodput, costs, finished=True):
        return {"contender": c, "seed": seed, "goodput": goodput, "lost_steps": 3,
                "finished": finished, "weights_equal": False,
                "faults": [{"kind": k, "lost_node_s": v} for k, v in costs]}
    runs = [run("baseline", 1, 0.5, [("preempt", 100), ("freeze", 300)]),
            run("restart", 1, 0.8, [("preempt", 20), ("freeze", 20)]),
            run("baseline", 2, 0.4, [("preempt", 200), ("freeze", 200)], finished=False),
            run("restart", 2, 0.8, [("preempt", 40), ("freeze", 60)])]
    s = cm.summarize(runs)
    assert s["baseline"]["lost_node_s_per_fault"] == {"median": 200.0, "min": 200.0, "max": 200.0}
    assert s["restart"]["ratio_to_baseline"]["lost_node_s_per_fault"] == \
        {"median": pytest.approx(0.175), "min": pytest.approx(0.1), "max": pytest.approx(0.25)}
    assert s["restart"]["ratio_to_baseline"]["goodput"]["max"] == pytest.approx(2.0)
    assert s["baseline"]["finished"] == [True, False]
    assert s["restart"]["lost_node_s_by_kind"]["freeze"]["median"] == pytest.approx(40.0)
    table = cm.markdown(s)
    assert "| restart | 80.0% [80.0%, 80.0%] | 35.0 [20.0, 50.0] | 3 [3, 3] | 2/2 (2) |" in table
    assert "worker frozen (SIGSTOP)" in table


def test_the_run_table_marks_a_fault_never_recovered_and_the_faults_not_reached():
    run = {"contender": "baseline", "seed": 1, "finished": False, "resubmitted": [], "goodput": 0.056,
           "allocated_node_s": 1773.0, "lost_steps": 8, "worlds_seen": [3],
           "load_1m": {"median": 8.6, "min": 4.5, "max": 12.1},
           "faults": [{"kind": "node_crash", "step": 7, "lost_node_s": 185.2, "recovered": True},
                      {"kind": "freeze", "step": 15, "lost_node_s": 1482.0, "recovered": False}],
           "faults_not_reached": [[30, "preempt"]]}
    line = cm.runs_markdown([run]).splitlines()[-1]
    assert "node_crash @7: 185, freeze @15: 1482*; not reached: preempt" in line
    assert "| no | 0 | 5.6% | 1773 |" in line and "8.6 [4.5, 12.1]" in line


def test_an_inprocess_recovery_is_its_fault_s_not_a_later_requeue_s():
    # In-process recovery at t=4 from step 9 (group "a" goes on), then a preemption at t=20
    # whose requeue (group "b") resumes at t=50. The crash at t=1 was back at t=5 (step 10),
    # not at the requeue's first step beyond 30.
    trace = [(0.5, 9, "a"), (4.2, 9, "a"), (5.0, 10, "a"), (19.0, 30, "a"), (50.0, 30, "b"), (51.0, 31, "b")]
    assert cm.back_at(trace, 1.0) == 51.0, "without the recovery: the requeue's step (the old reading)"
    assert cm.back_at(trace, 1.0, [(4.0, 9)]) == 5.0
    assert cm.back_at(trace, 20.0, [(4.0, 9)]) == 51.0, "an earlier recovery is not a later fault's"
    # A rollback: the step done twice (10) is not "back"; 11 is.
    trace = [(0.5, 10, "a"), (4.2, 9, "a"), (5.0, 10, "a"), (5.5, 11, "a")]
    assert cm.back_at(trace, 1.0, [(4.0, 9)]) == 5.5


def _record(seed_runs, **config):
    return {"config": {"steps": 60, **config}, "runs": seed_runs, "machine": {"cpus": 2},
            "references": {"baseline-w3": "ab"}}


def _run(name, seed, lost, goodput=0.5):
    return {"contender": name, "seed": seed, "goodput": goodput, "lost_steps": 0, "finished": True,
            "weights_equal": False, "faults": [{"kind": "preempt", "lost_node_s": lost}]}


def test_merge_joins_one_seed_records_and_pairs_ratios_by_seed():
    merged = cm.merge([_record([_run("baseline", 1, 100.0), _run("inprocess", 1, 10.0)]),
                       _record([_run("baseline", 2, 200.0), _run("inprocess", 2, 40.0)])])
    assert merged["seeds"] == [1, 2]
    inproc = merged["contenders"]["inprocess"]
    assert inproc["seeds"] == [1, 2]
    # Ratios pair by seed: 10/100 and 40/200, not the medians' 25/150.
    assert inproc["ratio_to_baseline"]["lost_node_s_per_fault"] == pytest.approx(
        {"median": 0.15, "min": 0.1, "max": 0.2})
    assert len(merged["machine"]) == 2


def test_merge_refuses_different_settings_and_a_run_twice():
    with pytest.raises(ValueError, match="different configurations \\(steps\\)"):
        cm.merge([_record([_run("baseline", 1, 1.0)]), _record([_run("baseline", 2, 1.0)], steps=40)])
    with pytest.raises(ValueError, match="baseline seed 1 is in more than one record"):
        cm.merge([_record([_run("baseline", 1, 1.0)]), _record([_run("baseline", 1, 2.0)])])


def test_steps_twice_from_the_trace_counts_a_restart_below_the_last_step_seen():
    # Group A reached step 45; the rendezvous host crashed with rank 0's last events (the
    # ledger's count: 0); group B restarted from the step-40 save: 41..45 computed twice.
    trace = [(1.0, 30, "A"), (2.0, 45, "A"), (5.0, 41, "B"), (6.0, 50, "B"), (9.0, 51, "C")]
    assert cm.steps_twice(trace) == 5     # C started beyond every step done: nothing twice
    run = {"lost_steps": 0, "trace": [[t, s, 3, g] for t, s, g in trace]}
    once = cm.with_trace_steps_twice(run)
    assert (once["lost_steps"], once["lost_steps_ledger"]) == (5, 0)
    assert cm.with_trace_steps_twice(once) == once, "idempotent"
    assert cm.with_trace_steps_twice({"lost_steps": 8, "trace": run["trace"]})["lost_steps"] == 8


# A torchft run recorded as benchmarks/torchft/train_torchft.py writes it: 3 replica groups
# start (each writes start and restored), replica 0 is the participating rank 0 and logs steps
# 1-4 (a save at 2); replica 1's worker is killed after step 3, torchrun restarts it on its node
# (start, restored at the save's step 2), it is healed live to step 5 while the others go on,
# and from step 5 replica 2 logs the steps (the participating ranks changed).
TFT_RECORDS = [
    {"ev": "start", "t": 2.0, "t_proc": 1.0, "alloc": 0, "restart": 0, "replica": 0, "node": "node1"},
    {"ev": "start", "t": 2.2, "t_proc": 1.1, "alloc": 0, "restart": 0, "replica": 1, "node": "node2"},
    {"ev": "start", "t": 2.4, "t_proc": 1.2, "alloc": 0, "restart": 0, "replica": 2, "node": "node3"},
    {"ev": "restored", "t0": 3.0, "t": 4.0, "step": 0, "alloc": 0, "restart": 0, "replica": 0},
    {"ev": "restored", "t0": 3.1, "t": 4.1, "step": 0, "alloc": 0, "restart": 0, "replica": 1},
    {"ev": "restored", "t0": 3.2, "t": 4.2, "step": 0, "alloc": 0, "restart": 0, "replica": 2},
    {"ev": "step", "t": 5.0, "step": 1, "world": 3, "alloc": 0, "restart": 0, "replica": 0},
    {"ev": "step", "t": 6.0, "step": 2, "world": 3, "alloc": 0, "restart": 0, "replica": 0},
    {"ev": "save", "t0": 6.0, "t": 6.5, "step": 2, "alloc": 0, "restart": 0, "replica": 0},
    {"ev": "step", "t": 7.5, "step": 3, "world": 3, "alloc": 0, "restart": 0, "replica": 0},
    {"ev": "step", "t": 12.0, "step": 4, "world": 2, "alloc": 0, "restart": 0, "replica": 0},
    {"ev": "start", "t": 13.0, "t_proc": 11.0, "alloc": 0, "restart": 1, "replica": 1, "node": "node2"},
    {"ev": "restored", "t0": 13.5, "t": 14.0, "step": 2, "alloc": 0, "restart": 1, "replica": 1},
    {"ev": "heal", "t": 15.0, "step": 5, "alloc": 0, "restart": 1, "replica": 1},
    {"ev": "step", "t": 15.0, "step": 5, "world": 2, "alloc": 0, "restart": 0, "replica": 2},
    {"ev": "step", "t": 16.0, "step": 6, "world": 3, "alloc": 0, "restart": 0, "replica": 2},
    {"ev": "end", "t": 16.5, "step": 6, "alloc": 0, "restart": 0, "replica": 2},
]
TFT_RUNS = {0: {"start": 0.0, "end": 20.0, "nodes": ["node1", "node2", "node3"],
                "node_ends": {"node1": 20.0, "node2": 20.0, "node3": 20.0}}}


def test_a_torchft_replica_restarted_and_healed_live_is_no_new_worker_group_and_no_lost_step():
    recs = cm.torchft_records(TFT_RECORDS)
    assert [r["ev"] for r in recs[:2]] == ["start", "restored"], "each allocation's first start and restore"
    assert sum(r["ev"] in ("start", "restored") for r in recs) == 2
    assert all(r["restart"] == 0 for r in recs) and not any(r["ev"] == "heal" for r in recs)
    ledger = build(cm.plain_events(recs, TFT_RUNS), slurm_runs=TFT_RUNS)
    # Nothing was computed twice: the restarted replica was healed to the others' step.
    assert ledger.lost_steps == 0 and ledger.allocations[0].restarts == 0
    assert ledger.allocated_node_s == pytest.approx(60.0)
    # The pause the kill cost (steps 3 -> 4: 4.5 s on 3 nodes) is in the ledger's productive
    # time (the survivors were in their loop); the campaign charges it to the fault instead
    # (fault_costs: until a step beyond the one at the fault). Read as the baseline's records,
    # every replica's start (and the restarted one's restore at step 2) would be a worker group.
    raw = build(cm.plain_events(TFT_RECORDS, TFT_RUNS), slurm_runs=TFT_RUNS)
    assert raw.allocations[0].restarts > 0


def test_a_torchft_requeue_is_a_new_worker_group_per_allocation():
    second = [{**r, "alloc": 1, "t": r["t"] + 100.0, **({"t0": r["t0"] + 100.0} if "t0" in r else {})}
              for r in TFT_RECORDS[:6]]
    recs = cm.torchft_records(TFT_RECORDS[:10] + second)
    assert [(r["ev"], r["alloc"]) for r in recs if r["ev"] in ("start", "restored")] == [
        ("start", 0), ("restored", 0), ("start", 1), ("restored", 1)]


def test_a_torchft_fault_costs_the_stall_after_the_step_in_flight():
    # Recorded on the cluster (relative times): node2 crashed at 7.06 s, when the campaign had
    # seen step 14; the survivors finished step 15 at full strength (7.14 s), then stalled 5 s
    # until the quorum re-formed without node2: step 16 at world 2.
    recs = [{"ev": "step", "t": t, "step": s, "world": w, "job": "1", "alloc": 0}
            for t, s, w in [(6.55, 12, 3), (6.72, 13, 3), (6.96, 14, 3), (7.14, 15, 3), (12.29, 16, 2),
                            (12.44, 17, 2)]]
    recoveries = cm.torchft_recoveries(recs)
    assert [(round(t, 3), s) for t, s in recoveries] == [(12.29, 15)]
    trace = [(r["t"], r["step"], ("1", 0)) for r in recs]
    assert cm.back_at(trace, 7.06, recoveries) == 12.29, "back after the stall, at step 16"
    assert cm.back_at(trace, 7.06) == 7.14, "without it: the step in flight (the stall missed)"
    # The fault seen after its step was logged (nothing in flight), and a requeue later (a new
    # group, campaign seed 3): back at the first step of the new participants all the same,
    # not at the requeue's first step.
    later = trace + [(40.0, 15, ("1", 1)), (41.0, 18, ("1", 1))]
    assert cm.back_at(later, 7.2, recoveries) == 12.29
    assert cm.back_at(later, 7.2) == 41.0, "without it: charged until after the requeue"
    # A new allocation is no change of the participants.
    assert cm.torchft_recoveries(recs[:2] + [{**recs[2], "alloc": 1, "world": 2}]) == []


def test_the_preemptor_asks_only_for_the_jobs_nodes_that_are_up() -> None:
    nodes = ["node1", "node2", "node3"]
    healthy = {"node1": "mix", "node2": "alloc", "node3": "mix"}
    assert cm.nodes_up(nodes, healthy, set()) == nodes
    # node2 crashed by an earlier fault, not yet repaired: Slurm may not have noticed yet.
    assert cm.nodes_up(nodes, healthy, {"node2"}) == ["node1", "node3"]
    # Slurm noticed: down, not responding (*), failed or drained.
    for bad in ("down*", "mix*", "idle*", "fail", "drain"):
        assert cm.nodes_up(nodes, {**healthy, "node3": bad}, set()) == ["node1", "node2"], bad
    # Nothing up: all of them (the preemptor waits, as on a real cluster), never an empty -w.
    assert cm.nodes_up(nodes, {n: "down*" for n in nodes}, set()) == nodes


def test_faults_hit_nodes_that_are_up_and_the_host_loss_hits_the_host() -> None:
    nodes = ["node1", "node2", "node3"]
    up = ["node1", "node3"]                       # node2 crashed by an earlier fault, not repaired
    assert cm.fault_targets("worker_kill", nodes, "node1", up) == ["node3", "node1"]
    assert cm.fault_targets("freeze", nodes, "node3", up) == ["node1", "node3"]
    assert cm.fault_targets("node_crash", nodes, "node1", up) == ["node3"]
    assert cm.fault_targets("link_cut", nodes, "node1", up) == ["node3"]
    assert cm.fault_targets("rdzv_loss", nodes, "node2", up) == ["node2"]
    everything = ["node1", "node2", "node3"]
    assert cm.fault_targets("link_cut", nodes, "node1", everything) == ["node2", "node3"]
    # Only the host up: a worker fault hits it; a node fault hits a node down rather than the host
    # (a host loss is its own kind in the schedule).
    assert cm.fault_targets("worker_kill", nodes, "node1", ["node1"]) == ["node1"]
    assert cm.fault_targets("node_crash", nodes, "node1", ["node1"]) == ["node2", "node3"]
    # With nothing up (nodes_up then gives all), the old order.
    assert cm.fault_targets("freeze", nodes, "node1", []) == ["node2", "node3", "node1"]


def test_a_step_finished_in_flight_before_a_hang_is_no_recovery():
    # Campaign session 14, the baseline's seed 3: a worker frozen at step 54; the others finished
    # step 55 (in flight) and hung until the run's cap. Without the run's last step the metric
    # took step 55 for "back" (1 node-s); with it, the freeze is never recovered.
    trace = [(190.0, 53, "g"), (195.0, 54, "g"), (195.4, 55, "g")]
    assert cm.back_at(trace, 195.2) == 195.4, "without last_step: the old reading"
    assert cm.back_at(trace, 195.2, last_step=60) is None
    [cost] = cm.fault_costs([{"kind": "freeze", "t": 195.2, "step": 54}], trace, [], 600.0, last_step=60)
    assert not cost["recovered"] and cost["back_s"] == pytest.approx(600.0 - 195.2)
    # A recovery that goes on is still back at its first step; the last step counts on its own.
    on = trace + [(210.0, 56, "g"), (211.0, 60, "g")]
    assert cm.back_at(on, 195.2, last_step=60) == 195.4
    assert cm.back_at([(1.0, 58, "g"), (2.0, 59, "g"), (5.0, 60, "g")], 2.5, last_step=60) == 5.0
    # In place (an in-process recovery at 196 from step 54): back at 55 only if a step follows.
    assert cm.back_at(on[:2] + [(197.0, 55, "g"), (198.0, 56, "g")], 195.2, [(196.0, 54)], 60) == 197.0
    assert cm.back_at(on[:2] + [(197.0, 55, "g")], 195.2, [(196.0, 54)], 60) is None
