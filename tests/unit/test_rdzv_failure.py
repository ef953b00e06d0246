"""The reason a failed rendezvous on its own host records (runtime.launch.rdzv_failure).

Before: every failure of the host's round read "port in use by another job? Set --rdzv-port",
also when the store was up and nodes simply did not arrive within the join timeout.
"""

from __future__ import annotations

import pytest

from runtime.launch import rdzv_failure

pytestmark = pytest.mark.unit


class RendezvousTimeoutError(Exception):
    """Named as torch's (the reason is chosen by the error's type name, torch-free)."""


class RendezvousConnectionError(Exception):
    pass


def ev(name: str, node_rank: int, alloc: int = 0, epoch: int = 0) -> dict:
    return {"t": 1.0, "ev": name, "alloc": alloc, "epoch": epoch, "node_rank": node_rank}


def test_the_nodes_that_never_joined_are_named_with_the_timeout_and_its_flag() -> None:
    events = [ev("rdzv_join", 0), ev("rdzv_join", 2), ev("node_ready", 1),
              ev("rdzv_join", 1, alloc=1), ev("rdzv_join", 1, epoch=1)]   # other rounds
    joined = rdzv_failure.joined(events, allocation=0, epoch=0)
    assert joined == {0, 2}
    why = rdzv_failure.explain(RendezvousTimeoutError(), endpoint="node1:29400", timeout_s=600,
                               min_nodes=3, nodes=["node1", "node2", "node3"], joined=joined)
    assert "timed out" in why and "600 s" in why and "--rdzv-timeout" in why
    assert "never joined: node2 (node rank 1)" in why and "2 of 3 joined" in why
    assert "node1 (node rank 0)" not in why and "port in use" not in why


def test_a_timeout_with_every_node_joining_points_at_reaching_the_host() -> None:
    why = rdzv_failure.explain(RendezvousTimeoutError(), endpoint="node1:29400", timeout_s=60.5,
                               min_nodes=2, nodes=["node 0", "node 1"], joined={0, 1})
    assert "60.5 s" in why and "could not reach node1:29400" in why and "never joined" not in why


def test_a_store_that_could_not_be_served_still_names_the_port_flag() -> None:
    why = rdzv_failure.explain(RendezvousConnectionError("bind: address in use"),
                               endpoint="node1:29400", timeout_s=600, min_nodes=2,
                               nodes=["node1", "node2"], joined={0})
    assert "--rdzv-port" in why and "address in use" in why and "--rdzv-timeout" not in why


class RendezvousClosedError(Exception):
    pass


class RendezvousError(Exception):
    pass


@pytest.mark.parametrize("error, says", [
    (RendezvousTimeoutError("no decision within 10 s"), "fewer nodes than the job's MIN joined within 10 s (--rdzv-timeout"),
    (RendezvousClosedError("closed"), "the others closed the rendezvous, the job is ending"),
    (RendezvousError("bad config"), "a configuration or protocol error, not a lost node"),
], ids=["timeout", "closed", "other"])
def test_a_non_host_whose_host_answered_says_what_the_error_was_not_a_lost_host(error, says) -> None:
    reason = rdzv_failure.explain_non_host(error, endpoint="node1:29500", answered=True, timeout_s=10)
    assert reason is not None and says in reason, reason
    assert "while its host node1:29500 answered" in reason and "not lost" in reason, reason
    assert str(error) in reason, reason


def test_a_non_host_whose_host_did_not_answer_leaves_it_to_the_host_loss_path() -> None:
    for error in (RendezvousTimeoutError("t"), RendezvousConnectionError("c"), RendezvousClosedError("x")):
        assert rdzv_failure.explain_non_host(error, endpoint="n:1", answered=False, timeout_s=10) is None
