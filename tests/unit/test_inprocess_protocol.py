"""The in-process recovery's store protocol: the leader's closing rule and the member plan (pure)."""

from __future__ import annotations

import pytest

from hpc.contract import recovery_settings
from runtime.inprocess import rules
from runtime.inprocess import protocol as proto
from hpc.contract.errors import SpecError
from runtime.inprocess.protocol import Arrival
from runtime.inprocess.rules import close_decision, plan_members

OLD = ("n1/10", "n1/11", "n2/20")


def test_closes_at_once_when_every_member_arrived_or_is_announced_dead():
    assert close_decision(OLD, OLD, now=0.1, opened=0.0, window_s=3).close
    d = close_decision(OLD, OLD[:2], dead=[OLD[2]], now=0.1, opened=0.0, window_s=3)
    assert d.close and d.waiting_for == ()


def test_a_silent_member_is_waited_for_the_window_only():
    d = close_decision(OLD, OLD[:2], now=2.9, opened=0.0, window_s=3)
    assert not d.close and d.waiting_for == (OLD[2],)
    assert close_decision(OLD, OLD[:2], now=3.1, opened=0.0, window_s=3).close


def test_a_member_in_an_announced_phase_or_on_its_way_is_waited_for_longer():
    busy = close_decision(OLD, OLD[:2], busy_until={OLD[2]: 50.0}, now=10.0, opened=0.0, window_s=3)
    assert not busy.close and busy.waiting_for == (OLD[2],)
    assert close_decision(OLD, OLD[:2], busy_until={OLD[2]: 50.0}, now=51.0, opened=0.0, window_s=3).close
    coming = close_decision(OLD, OLD[:2], coming=[OLD[2]], now=10.0, opened=0.0, window_s=3, coming_s=60)
    assert not coming.close
    assert close_decision(OLD, OLD[:2], coming=[OLD[2]], now=61.0, opened=0.0, window_s=3, coming_s=60).close


def test_ranks_keep_their_order_and_the_newest_step_is_the_source():
    arrivals = [Arrival("n2/20", 2, 9), Arrival("n1/10", 0, 8), Arrival("spare/5", 10**6, -1)]
    m = plan_members(4, arrivals, old=OLD, reason="peer lost")
    assert m.uids == ("n1/10", "n2/20", "spare/5")
    assert m.step == 9 and m.source == 1 and m.world_size == 3
    assert m.left == ("n1/11",)
    assert m.rank_of("spare/5") == 2 and m.rank_of("n1/11") is None
    assert proto.decode_members(proto.encode(m)) == m


def test_an_arrival_counted_twice_is_one_member_and_joiners_alone_hold_no_state():
    m = plan_members(1, [Arrival("a/1", 0, 3), Arrival("a/1", 0, 3)], old=("a/1",), reason="")
    assert m.uids == ("a/1",)
    with pytest.raises(ValueError, match="only joiners"):
        plan_members(1, [Arrival("s/1", 10**6, -1)], old=(), reason="")


def test_the_recovery_mode_is_validated_with_the_valid_ones_named():
    assert recovery_settings.parse_recovery(" InProcess ") == "inprocess"
    with pytest.raises(SpecError, match="restart or inprocess"):
        recovery_settings.parse_recovery("in-process")


def test_the_jobspec_refuses_an_unknown_recovery_naming_the_flag():
    from hpc.contract.jobspec import JobSpec

    assert JobSpec(script="train.py").recovery == "restart"
    assert JobSpec(script="train.py", recovery="inprocess").recovery == "inprocess"
    with pytest.raises(SpecError, match="restart, inprocess"):
        JobSpec(script="train.py", recovery="fast")


@pytest.mark.parametrize("mesh", [("--tp", "2"), ("--pp", "2"), ("--dp-replicate", "2"), ("--dp-shard", "2")])
def test_a_mesh_job_with_inprocess_recovery_is_refused_naming_the_flag_and_the_way_out(mesh):
    # In-process recovery carries DDP state only: a mesh's shards have no peer copy, so the
    # combination is refused at validation instead of failing in the workers.
    import subprocess
    import sys

    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "hpc", "render", "examples/train_gpt.py", "--nproc-per-node",
                        "2", *mesh, "--recovery", "inprocess"], capture_output=True, text=True,
                       timeout=60, cwd=repo)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--recovery 'inprocess' is invalid" in r.stderr and " ".join(mesh) in r.stderr, r.stderr
    assert "--recovery restart" in r.stderr and "plain data parallel (DDP)" in r.stderr, r.stderr
    ok = subprocess.run([sys.executable, "-m", "hpc", "render", "examples/train_gpt.py", "--nproc-per-node",
                         "2", *mesh, "--recovery", "restart"], capture_output=True, text=True,
                        timeout=60, cwd=repo)
    assert ok.returncode == 0, ok.stderr


def test_the_python_api_refuses_a_mesh_with_inprocess_recovery_in_its_terms():
    from hpc.contract.jobspec import JobSpec

    with pytest.raises(SpecError, match=r"recovery 'inprocess' is invalid: restart with a device mesh \(tp 2\)"):
        JobSpec(script="train.py", nproc_per_node=2, tp=2, recovery="inprocess")
    assert JobSpec(script="train.py", nproc_per_node=2, tp=2).recovery == "restart"


def test_a_promised_replacement_is_waited_for_until_it_joins_or_its_time_runs_out():
    # n2/20 died and its launcher promised a joiner until t=120: the world keeps its size.
    promised = {OLD[2]: 120.0}
    d = close_decision(OLD, OLD[:2], dead=[OLD[2]], promised=promised, joiners=0, now=5.0, opened=0.0,
                       window_s=3)
    assert not d.close and d.waiting_for == (f"replacement of {OLD[2]}",)
    assert close_decision(OLD, OLD[:2], dead=[OLD[2]], promised=promised, joiners=1, now=5.0,
                          opened=0.0, window_s=3).close
    assert close_decision(OLD, OLD[:2], dead=[OLD[2]], promised=promised, joiners=0, now=121.0,
                          opened=0.0, window_s=3).close   # it never came: shrink
    # A promise is only for a member announced dead (no waiting on a stale key).
    assert close_decision(OLD, OLD, promised=promised, now=5.0, opened=0.0, window_s=3).close


def test_joiners_fill_the_world_up_to_its_largest_size_in_join_order_the_dead_skipped():
    js = [Arrival("s/1", proto.JOINER_RANK, -1), Arrival("s/2", proto.JOINER_RANK + 1, -1),
          Arrival("s/3", proto.JOINER_RANK + 2, -1)]
    assert rules.admit(js, members=2, max_world=3) == (js[0],)   # a hot spare stays a spare
    assert rules.admit(js, members=2, max_world=4, dead=["s/1"]) == (js[1], js[2])
    assert rules.admit(js, members=4, max_world=4) == ()
    m = plan_members(2, [Arrival("n1/10", 0, 7), *rules.admit(js, members=1, max_world=2)],
                     old=("n1/10",), reason="joined")
    assert m.uids == ("n1/10", "s/1") and m.source == 0 and m.step == 7


def test_the_replacement_mode_is_validated_naming_the_flag_and_the_valid_ones():
    from hpc.contract.jobspec import JobSpec

    assert JobSpec(script="train.py", recovery="inprocess").replacement == "wait"   # the default: bit-equal
    assert JobSpec(script="train.py", recovery="inprocess", replacement="shrink").replacement == "shrink"
    with pytest.raises(SpecError, match=r"replacement 'later' is invalid: one of wait, shrink"):
        JobSpec(script="train.py", recovery="inprocess", replacement="later")
    # A replacement that joins later exists only in-process: refused with the way out named.
    with pytest.raises(SpecError, match=r"replacement 'shrink' is invalid.*recovery restart.*recovery=\"inprocess\""):
        JobSpec(script="train.py", replacement="shrink")


def test_the_cli_refuses_a_bad_replacement_naming_the_flag_and_the_valid_ones(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = subprocess.run([sys.executable, "-m", "hpc", "render", str(script), "--recovery", "inprocess",
                        "--replacement", "soon"], capture_output=True, text=True)
    assert r.returncode != 0 and "--replacement 'soon' is invalid: one of wait, shrink" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "hpc", "render", str(script), "--replacement", "shrink"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--recovery inprocess --replacement shrink" in r.stderr, r.stderr


def test_a_closed_lifeline_names_a_worker_dead_only_on_evidence_that_no_replacement_is_coming():
    closed = {"n2/11": "n2/10", "n3/21": "n3/20"}   # worker -> its launcher
    # wait: a live launcher promises a joiner and announces itself; a gone launcher cannot
    assert rules.lifeline_dead(closed, set(), replacement="wait") == []
    assert rules.lifeline_dead(closed, {"n3/20"}, replacement="wait") == ["n3/21"]
    # shrink: nobody waits for a replacement, so a closed line is enough
    assert rules.lifeline_dead(closed, set(), replacement="shrink") == ["n2/11", "n3/21"]
    # a line still open (slow, stopped, cut off) is never in ``closed``: never named
    assert rules.lifeline_dead({}, {"n3/20"}, replacement="shrink") == []
    hello = proto.Hello("worker", "n2/11", parent="n2/10", space="hpc/inproc/n1:29500")
    key = bytes(range(32))
    assert proto.Hello.parse(hello.line(key), key) == hello
