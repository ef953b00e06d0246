"""Bad nodes stay out, and stragglers are named: the pure decisions.

Exclusions: one per node (its latest), capped so the job keeps at least MIN nodes of its
partition, oldest lapsing first; an allocation gives back excluded nodes but never drops
below MIN nor its batch host (Slurm refuses that). Stragglers: the others' median, a margin,
and nothing on uniform ranks.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpc.contract.jobdir import Outcome, append_outcome, read_outcomes
from runtime import exclusions
from runtime.exclusions import Exclusion, effective, plan_release, shell_lines
from runtime.liveness.stragglers import RankPace, Straggler, find, paces_from_records

pytestmark = pytest.mark.unit


def ex(node: str, t: float, kind: str = "stall") -> Exclusion:
    return Exclusion(node=node, kind=kind, reason="why", allocation=0, time=t)


def test_one_exclusion_per_node_the_latest_oldest_first():
    got = effective([ex("n2", 1), ex("n3", 2), ex("n2", 3, "lost")], min_nodes=1, partition_nodes=None)
    assert [(e.node, e.kind) for e in got] == [("n3", "stall"), ("n2", "lost")]


@pytest.mark.parametrize("partition,min_nodes,want", [
    (4, 2, ["n3", "n4"]),     # room for 2: the oldest (n2) lapses
    (4, 3, ["n4"]),
    (4, 4, []),               # a job that needs the whole partition excludes nothing
    (3, 5, []),
    (10, 2, ["n2", "n3", "n4"]),
])
def test_cap_leaves_the_job_its_minimum_in_the_partition(partition, min_nodes, want):
    records = [ex("n2", 1), ex("n3", 2), ex("n4", 3)]
    assert [e.node for e in effective(records, min_nodes=min_nodes, partition_nodes=partition)] == want


def test_release_gives_back_excluded_nodes_above_min():
    plan = plan_release(["n1", "n2", "n3"], [ex("n3", 1)], min_nodes=2, batch_host="n1")
    assert plan.kept == ("n1", "n2") and plan.released == ("n3",) and not plan.notes


def test_release_never_below_min_the_oldest_exclusion_lapses_first():
    plan = plan_release(["n1", "n2", "n3"], [ex("n2", 1), ex("n3", 2)], min_nodes=2, batch_host="n1")
    assert plan.released == ("n3",) and "n2 is excluded but kept" in plan.notes[0]


def test_release_keeps_the_batch_host_and_says_so():
    plan = plan_release(["n1", "n2", "n3"], [ex("n1", 1)], min_nodes=1, batch_host="n1")
    assert plan.released == () and "batch host" in plan.notes[0]


def test_shell_lines_describe_the_shrunk_allocation():
    out = subprocess.run(["bash", "-c", shell_lines(["n1", "n2"]) + 'echo "$SLURM_JOB_NODELIST $SLURM_NNODES"'],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "n1,n2 2"


def test_recorded_exclusions_round_trip_and_show_in_the_outcome(tmp_path: Path):
    exclusions.add(tmp_path, "node3", "stall", "node node3 stopped answering", 0)
    exclusions.add(tmp_path, "?", "stall", "unknown peer", 0)          # not a name: ignored
    got = exclusions.read(tmp_path)
    assert [(e.node, e.kind) for e in got] == [("node3", "stall")]
    append_outcome(tmp_path, Outcome(allocation=0, kind="finished", exit_code=0,
                                     excluded=(got[0].describe(),), stragglers=("rank 1 on node2",)))
    o = read_outcomes(tmp_path)[0]
    assert o.excluded == (got[0].describe(),)
    assert "excluded next time: node3 (stall" in o.describe() and "straggler: rank 1 on node2" in o.describe()


def test_enforce_outside_slurm_or_without_exclusions_prints_nothing(tmp_path: Path):
    assert exclusions.enforce(tmp_path, {}) == ""
    assert exclusions.enforce(tmp_path, {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]"}) == ""


# --- stragglers ---------------------------------------------------------------------------
def pace(rank: int, s: float, node_rank: int | None = None) -> RankPace:
    return RankPace(rank, f"node{rank}", rank if node_rank is None else node_rank, s)


def test_a_rank_slower_than_one_and_a_half_the_others_is_named():
    got = find([pace(0, 0.10), pace(1, 0.11), pace(2, 0.30), pace(3, 0.09)])
    assert [(p.rank, round(m, 3)) for p, m in got] == [(2, 0.1)]


def test_two_ranks_compare_with_the_other():
    assert [p.rank for p, _ in find([pace(0, 0.03), pace(1, 0.28)])] == [1]


@pytest.mark.parametrize("paces", [
    [pace(0, 0.10), pace(1, 0.14), pace(2, 0.12)],          # jitter under 1.5x
    [pace(0, 0.001), pace(1, 0.004)],                        # 4x, but 3 ms: noise
    [pace(0, 0.2)],                                          # nobody to compare with
])
def test_no_straggler_in_ordinary_spread(paces):
    assert find(paces) == []


def test_paces_are_read_from_the_nodes_records_and_bad_ones_skipped():
    recs = [{"node": "node1", "node_rank": 0, "pace": [{"rank": 0, "compute_s": 0.1}, {"rank": 1}]},
            {"node": "node2", "node_rank": 1, "pace": [{"rank": 2, "compute_s": "x"}, {"rank": 3, "compute_s": 0.5}]}]
    assert paces_from_records(recs) == [RankPace(0, "node1", 0, 0.1), RankPace(3, "node2", 1, 0.5)]


def test_straggler_summary_names_rank_node_and_ratio():
    s = Straggler(0, 3, "node2", 1, 0.3, 0.1, 12, 0.0)
    assert s.summary().startswith("rank 3 on node2 (node rank 1): 0.300s") and "3.0x" in s.summary()
