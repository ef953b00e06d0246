"""The launcher's fence names the rendezvous host lost only on evidence (runtime/launch/main.py).

The real fault (a silent host under ``--recovery inprocess``) is in
tests/distributed/test_inprocess_host_lost.py; here the rule's other side: a store that
answers, a launcher back from a gap of its own (starved, frozen) and the host itself are
never taken for a lost host, and the fallback's reason says what the user needs.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from runtime.inprocess.launcher.run import host_lost as inproc_host_lost
from runtime.launch.main import STORE_LOST_S, _Fence


def fence(*, is_host: bool = False, ok_ago: float | None) -> tuple[_Fence, SimpleNamespace]:
    tracker = SimpleNamespace(store_ok_at=None if ok_ago is None else time.monotonic() - ok_ago)
    return _Fence(None, 0, members=2, is_host=is_host, tracker=tracker), tracker


def test_a_silent_store_is_a_lost_host_and_an_answering_one_is_not():
    f, _ = fence(ok_ago=STORE_LOST_S + 1)
    assert "has not answered" in f._store_lost()
    f, _ = fence(ok_ago=0.5)
    assert f._store_lost() is None


def test_back_from_a_gap_of_its_own_the_fence_looks_again_before_naming_the_host():
    f, t = fence(ok_ago=STORE_LOST_S + 1)
    f._looked = time.monotonic() - 8.0   # this launcher was frozen 8 s: the beacon's clock is stale
    assert f._store_lost() is None
    t.store_ok_at = time.monotonic()   # its beacon answers again at once
    assert f._store_lost() is None


def test_the_host_never_names_itself_lost_and_without_slurm_no_majority_rule_runs():
    f, _ = fence(is_host=True, ok_ago=STORE_LOST_S + 30)
    assert f._store_lost() is None and f._majority_lost() is None


def test_the_fallback_reason_names_the_host_and_what_happens_next():
    why = inproc_host_lost("node1", "the rendezvous store has not answered for 11s", succession=True)
    assert why.startswith("the rendezvous host node1 is lost; its store carried the in-process membership")
    assert "new rendezvous host" in why and "last checkpoint" in why
    assert "node failure" in inproc_host_lost("127.0.0.1", "x", succession=False)
