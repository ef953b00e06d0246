"""The join protocol against a real torch store (``HashStore``), members and joiner in threads:
a joiner is taken into the next generation with the last rank, a second one waits while the
world is full, and a joiner the job did not need learns it when the job finishes."""

from __future__ import annotations

import threading

import torch.distributed as dist

from runtime.inprocess import protocol as proto
from runtime.inprocess.worker.membership import Membership, joiners_waiting


def test_a_joiner_is_taken_in_with_the_last_rank_and_a_spare_beyond_the_largest_world_waits():
    store = dist.HashStore()
    a, b = Membership(store, "n1/1", max_world=3), Membership(store, "n1/2", max_world=3)
    a.uids = b.uids = ("n1/1", "n1/2")
    assert not joiners_waiting(store, 2, 3)
    got: dict[str, object] = {}
    first = threading.Thread(target=lambda: got.update(j1=Membership(store, "s/1").join(timeout_s=20)))
    first.start()
    while not store.check([proto.join(0)]):
        pass
    assert joiners_waiting(store, 2, 3) and not joiners_waiting(store, 3, 3)
    second = Membership(store, "s/2")
    late = threading.Thread(target=lambda: got.update(j2=second.join(timeout_s=20)))
    late.start()
    t = threading.Thread(target=lambda: got.update(b=b.reform(5, 1, reason="grow")))
    t.start()
    got["a"] = a.reform(5, 0, reason="grow")
    t.join(10), first.join(10)
    m = got["a"]
    assert m.uids == ("n1/1", "n1/2", "s/1") and got["b"] == m and got["j1"] == m
    assert m.source == 0 and m.step == 5 and "joined: s/1" in m.reason
    assert int(store.get(proto.JOIN_ADMITTED)) == 1 and not joiners_waiting(store, 3, 3)
    store.set(proto.DONE, "1")   # the job finished: the spare was not needed
    late.join(10)
    assert got["j2"] is None
