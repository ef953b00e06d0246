"""The pure rules of FSDP2 peer copies: who keeps whose copy (a ring over nodes), which step every
shard still has after a loss, and the ranks a sharded re-form keeps."""

from __future__ import annotations

import pytest

from runtime.inprocess.protocol import JOINER_RANK, Arrival
from runtime.inprocess.rules import plan_members
from runtime.inprocess.worker.peers import LIVE, OWN, PEER, Holding, NoCopy, agree, holders, owners


def test_ring_over_two_nodes_of_two_keeps_each_copy_on_the_other_node():
    ring = holders(["a", "a", "b", "b"])
    assert ring == {0: 2, 1: 3, 2: 0, 3: 1}
    assert owners(ring, 0) == [2]


def test_ring_over_three_nodes_and_non_contiguous_ranks():
    assert holders(["a", "b", "c"]) == {0: 1, 1: 2, 2: 0}
    assert holders(["a", "b", "a", "b"]) == {0: 1, 2: 3, 1: 0, 3: 2}


def test_uneven_nodes_still_put_every_copy_on_another_node():
    nodes = ["a", "a", "a", "b"]
    ring = holders(nodes)
    assert all(nodes[h] != nodes[r] for r, h in ring.items())
    assert sorted(ring) == [0, 1, 2, 3]


def test_one_node_keeps_no_copy():
    assert holders(["a", "a", "a"]) == {}


def test_lost_rank_comes_from_its_copy_and_survivors_ahead_roll_back():
    # Rank 2 died at step 7 (the others at 7); copies were made at steps 4 and 6.
    held = [Holding(0, live=7, own=(4, 6), peer={2: (4, 6)}),
            Holding(1, live=7, own=(4, 6), peer={3: (4, 6)}),
            Holding(2),   # the joiner
            Holding(3, live=7, own=(4, 6), peer={1: (4, 6)})]
    plan = agree(held, 4, lost=[2])
    assert plan.step == 6
    assert plan.sources == {0: (0, OWN), 1: (1, OWN), 2: (0, PEER), 3: (3, OWN)}
    assert plan.sends() == [(0, 2)]


def test_the_newest_step_every_shard_has_wins_over_a_copy_still_in_flight():
    # Rank 0 received step 8's copy of rank 2; rank 1's copy of rank 3 is at 6 only.
    held = [Holding(0, live=8, own=(6, 8), peer={2: (6, 8)}),
            Holding(1, live=8, own=(6, 8), peer={3: (6,)}),
            Holding(2),
            Holding(3),
            ]
    plan = agree(held, 4)
    assert plan.step == 6 and plan.sources[3] == (1, PEER)


def test_no_loss_keeps_live_state():
    held = [Holding(r, live=5, own=(4,)) for r in range(2)]
    plan = agree(held, 2)
    assert plan.step == 5 and plan.sources == {0: (0, LIVE), 1: (1, LIVE)}


def test_both_copies_lost_names_the_shards_without_copy():
    held = [Holding(0), Holding(1, live=7, own=(6,), peer={3: (6,)}),
            Holding(2), Holding(3, live=7, own=(6,), peer={1: (6,)})]
    with pytest.raises(NoCopy) as e:
        agree(held, 4, lost=[0, 2])
    assert e.value.missing == (0, 2)
    assert "rank(s) 0, 2 have no copy left" in str(e.value)


def test_shards_at_different_steps_only_is_no_plan_either():
    held = [Holding(0, live=5), Holding(1, live=6)]
    with pytest.raises(NoCopy, match="no step is held for every shard"):
        agree(held, 2)


def _arr(uid: str, rank: int, step: int) -> Arrival:
    return Arrival(uid, rank, step, "h")


def test_sharded_re_form_keeps_ranks_and_the_joiner_takes_the_lost_one():
    arrivals = [_arr("s0", 0, 7), _arr("s1", 1, 7), _arr("s3", 3, 7), _arr("j", JOINER_RANK, -1)]
    kept = plan_members(1, arrivals, old=["s0", "s1", "s2", "s3"], reason="x", keep_ranks=True)
    assert kept.uids == ("s0", "s1", "j", "s3")
    plain = plan_members(1, arrivals, old=["s0", "s1", "s2", "s3"], reason="x")
    assert plain.uids == ("s0", "s1", "s3", "j")   # DDP: ranks close up, joiners last


def test_copy_options_default_and_refuse_bad_values_naming_the_variable():
    from runtime.inprocess.worker.shard_copy import options

    assert options({}) == (1, 4096 * 2**20)
    assert options({"HPC_INPROC_COPY_EVERY": "5", "HPC_INPROC_COPY_MAX_MB": "0.5"}) == (5, 2**19)
    with pytest.raises(ValueError, match="HPC_INPROC_COPY_EVERY='0'"):
        options({"HPC_INPROC_COPY_EVERY": "0"})


def test_copies_over_the_memory_bound_are_refused_with_the_value_and_the_limit():
    from runtime.inprocess.worker.shard_copy import CopyLimit, check_bound

    assert check_bound(2**20, kept=1, max_bytes=4 * 2**20, rank=3) == 4 * 2**20   # 2 own + 2 kept
    with pytest.raises(CopyLimit) as e:
        check_bound(2**20, kept=1, max_bytes=3 * 2**20, rank=3)
    assert "need 4.0 MB" in str(e.value) and "HPC_INPROC_COPY_MAX_MB=3 MB" in str(e.value) \
        and "rank 3" in str(e.value)


def test_a_snapshot_over_one_percent_of_the_steps_between_copies_is_said_once_with_the_interval(caplog):
    from runtime.inprocess.worker.shard_copy import PeerCopies

    copies = PeerCopies([], [], {}, every=2, max_bytes=1, node="a")
    copies.snapshot_s, copies.snapshots = 0.006, 3        # 2 ms a snapshot
    copies._check_overhead(0.1)                            # every 2 steps of 100 ms: 1 %, fine
    assert not caplog.records
    copies.every = 1                                       # 2 % of one step
    copies._check_overhead(0.1)
    copies._check_overhead(0.1)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "HPC_INPROC_COPY_EVERY=2 or more" in said[0], said


def test_the_advised_copy_interval_keeps_the_snapshot_within_one_percent_of_a_step_without_it():
    from runtime.inprocess.worker.shard_copy import advised_every

    assert advised_every(0.002, 0.1, every=2) is None          # 1 % exactly: fine
    assert advised_every(0.002, 0.1, every=1) == 2
    assert advised_every(0.040, 0.1, every=1) == 40            # checkpoint_bench run 6: 132 MB of shards
    assert advised_every(0.040, 0.1, every=40) is None
    assert advised_every(0.001, 0.0, every=1) is None          # no step time: nothing to say


def test_a_copy_every_step_is_advised_against_the_step_without_its_snapshot(caplog, monkeypatch):
    """The Session times a step from one boundary to the next, so with a copy every step the
    step time it hands over holds the previous snapshot: 40 ms of snapshot in 140-ms steps is
    4 % of the 100-ms step, and needs a copy every 40 steps (29 was advised: 1.4 %)."""
    from runtime.inprocess.worker import shard_copy

    clock = [0.0]
    monkeypatch.setattr(shard_copy.time, "perf_counter", lambda: clock[0])
    copies = shard_copy.PeerCopies([], [], {}, every=1, max_bytes=2**30, node="a")
    copies._bound_once, copies.ring, copies.rank = True, {0: 1, 1: 0}, 0

    def snapshot(step, reuse=None):
        clock[0] += 0.040
        return {"step": step}
    monkeypatch.setattr(copies, "snapshot", snapshot)
    monkeypatch.setattr(copies, "_exchange", lambda step, snap: None)
    for step in range(1, 6):
        copies.after_step(step, step_s=0.140)
    copies.settle()
    said = [r.getMessage() for r in caplog.records if "HPC_INPROC_COPY_EVERY" in r.getMessage()]
    assert len(said) == 1 and "HPC_INPROC_COPY_EVERY=40 or more" in said[0] and "of 100 ms" in said[0], said
