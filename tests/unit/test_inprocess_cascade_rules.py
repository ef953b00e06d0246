"""What a rank holds after a recovery failed part way, and who may then be the source (issue 26).

A second fault during an in-process recovery (a member of the new generation dies during the
state transfer) leads to another re-form, where the newest step held whole decides the
source. A rank that had begun to load the received state holds a mix of two steps: it must say
it holds nothing whole, never be chosen as the source, and when no survivor holds any step
whole the generation closes without a source and every member gives up in-process recovery
(the restart path from the disk checkpoint, with the reason). The real transfer and re-forms are
in ``tests/distributed/test_inprocess_cascade.py``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from runtime.inprocess import rules
from runtime.inprocess import protocol as proto
from runtime.inprocess.protocol import Arrival, Members
from runtime.inprocess.rules import plan_members

pytestmark = pytest.mark.unit


def test_a_rank_holds_its_old_step_untouched_the_agreed_one_loaded_and_nothing_half_loaded():
    assert rules.held_after(7, 9, proto.UNTOUCHED) == 7
    assert rules.held_after(7, 9, proto.LOADED) == 9
    assert rules.held_after(7, 9, proto.LOADING) == proto.HOLDS_NOTHING == -1
    with pytest.raises(ValueError, match="phase 'half'.*untouched, loading or loaded"):
        rules.held_after(7, 9, "half")


def test_a_half_loaded_rank_is_never_the_source_even_at_the_lowest_rank():
    # Generation 1 agreed on step 9 (its source, old rank 3, then died mid-transfer): old rank 0
    # had begun to load it, old rank 1 had not (still 7), old rank 2 had loaded it whole.
    arrivals = [Arrival("a/1", 0, rules.held_after(7, 9, proto.LOADING)),
                Arrival("b/1", 1, rules.held_after(7, 9, proto.UNTOUCHED)),
                Arrival("c/1", 2, rules.held_after(7, 9, proto.LOADED))]
    m = plan_members(2, arrivals, old=["a/1", "b/1", "c/1", "d/1"], reason="second fault")
    assert (m.step, m.source, m.uids[m.source]) == (9, 2, "c/1")
    # Without the loaded one, the untouched rank's older step is the one every rank goes on from.
    m = plan_members(2, arrivals[:2], old=["a/1", "b/1", "c/1"], reason="second fault")
    assert (m.step, m.source, m.uids[m.source]) == (7, 1, "b/1")
    assert rules.repeats(m, 3) is None


def test_with_no_step_held_whole_the_generation_has_no_source_and_every_member_gives_up():
    from runtime.inprocess.worker.membership import Membership
    from runtime.inprocess.worker.peers import ShardedFallback
    from runtime.inprocess.worker.stages import InProcess

    store = dist.HashStore()
    inp = InProcess(store, rank=0, world_size=1, timeout=timedelta(seconds=5), step_bound_s=lambda: 5.0)
    inp.membership = Membership(store, inp.me, host="host", window_s=1.0, max_world=1)
    inp.membership.start(0, 1)
    members = inp.membership.reform(proto.HOLDS_NOTHING, 0, reason="a second fault during the transfer")
    assert members.source == -1 and members.uids == (inp.me,)
    with pytest.raises(ShardedFallback, match="no member holds the training state whole.*a second fault "
                                              "during the transfer.*restart path from the last checkpoint"):
        inp._give_up_if_repeating(members)
    assert b"no member holds the training state whole" in store.get(proto.FALLBACK)   # the launchers' word
    assert proto.decode_members(proto.encode(members)) == members   # followers read the same record


def test_the_transfer_marks_a_receiver_half_loaded_until_its_whole_state_is_loaded(monkeypatch):
    # The received state is loaded part by part after the broadcast: a failure in between
    # leaves the model overwritten and the optimizer not, which the phase must say.
    from runtime.inprocess.worker import stages
    from runtime.inprocess.worker.stages import InProcess

    torch.manual_seed(0)
    inp = InProcess(dist.HashStore(), rank=1, world_size=2, timeout=timedelta(seconds=5),
                    step_bound_s=lambda: 5.0)
    model = torch.nn.Linear(3, 2)
    inp.models, inp.optimizers = [model], [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    source = torch.nn.Linear(3, 2)
    sent = {"models": [source.state_dict()], "optims": [{"state": {}, "param_groups": []}],
            "small": {}, "rng": None, "step": 9, "session": {}}
    monkeypatch.setattr(stages.transfer, "broadcast_state", lambda *a, **k: (sent, 0))
    members = Members(gen=1, uids=("a/1", "b/1"), step=9, source=0)
    with pytest.raises(ValueError):   # the optimizer's part does not load
        inp._transfer(members, held=9)
    assert torch.equal(model.weight, source.weight), "the model part was loaded"
    assert inp._phase == proto.LOADING
    assert rules.held_after(9, members.step, inp._phase) == proto.HOLDS_NOTHING

    sent["optims"] = [inp.optimizers[0].state_dict()]
    inp._phase = proto.UNTOUCHED
    inp._transfer(members, held=9)
    assert inp._phase == proto.LOADED

    inp.rank, inp._phase = 0, proto.UNTOUCHED   # the source sends and keeps its state
    sent_by_source = []
    monkeypatch.setattr(stages.transfer, "broadcast_state",
                        lambda state, **k: (sent_by_source.append(state), (state, 0))[1])
    monkeypatch.setattr(stages.rng, "capture", lambda: None)
    inp._transfer(members, held=9)
    assert inp._phase == proto.UNTOUCHED and sent_by_source[0]["step"] == 9


def test_the_report_says_a_recovery_re_formed_again_after_a_second_fault():
    from hpc.report.inproc import recoveries, story

    ev = {"ev": "inproc_recovery", "t": 10.0, "gen": 2, "world_size": 2, "old_world_size": 4, "step": 7,
          "reason": "all-reduce: connection closed", "t_detect": 1.0, "t_abort": 1.1, "t_reform": 8.0,
          "t_group": 8.1, "t_transfer": 10.0,
          "retries": [{"gen": 1, "stage": "transfer", "reason": "a second fault ...", "held": 7, "holds": 7}]}
    [rec] = recoveries([ev])
    assert rec.retries == ("1 (transfer)",)
    assert story([ev])[0].endswith("re-formed again after a second fault in generation(s) 1 (transfer)")
    del ev["retries"]
    assert "second fault" not in story([ev])[0]
