"""What to tell the user when the rendezvous on this node fails (on its host, or another node).

The rendezvous host's own round can fail in two ways that call for different actions. Either
the store could not be served here (the port is taken by another job, the address is wrong):
the user picks another ``--rdzv-port``. Or the store was up and fewer than MIN nodes joined
within the join timeout: some nodes never arrived (a launcher that did not start, a node slow
to boot or to pull its container, a node that cannot reach the host), and the user needs to
know which ones, how long we waited, and that ``--rdzv-timeout`` sets it. Before this module
both read "port in use? set --rdzv-port", which sent the user after the wrong thing.

Which nodes arrived: each launcher records ``rdzv_join`` in ``events.jsonl`` (allocation,
rendezvous epoch, node rank) just before its agent joins the round. :func:`joined` reads them,
:func:`explain` (pure) writes the reason the outcome records.

On any other node a rendezvous error is the host's loss only when the host's store does not
answer (:func:`runtime.launch.host_store.answers`); when it does, :func:`explain_non_host`
(pure) says what the error was instead, and the node follows the host's recorded outcome.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

JOIN_EVENT = "rdzv_join"
"""``events.jsonl``: a launcher's agent joins the rendezvous of (``alloc``, ``epoch``)."""

TIMEOUT_FLAG = "--rdzv-timeout"


def joined(events: Iterable[Mapping[str, Any]], allocation: int, epoch: int) -> set[int]:
    """The node ranks whose launcher joined the rendezvous of ``allocation``/``epoch`` (pure)."""
    return {int(e["node_rank"]) for e in events
            if e.get("ev") == JOIN_EVENT and e.get("alloc") == allocation and e.get("epoch") == epoch
            and isinstance(e.get("node_rank"), int)}


def explain(error: BaseException, *, endpoint: str, timeout_s: float, min_nodes: int,
            nodes: Sequence[str], joined: set[int]) -> str:
    """The reason a failed rendezvous on its own host records (pure).

    Args:
        error: What torch's agent raised (a ``RendezvousTimeoutError`` when the wait ran out).
        endpoint: ``host:port`` of the rendezvous.
        timeout_s: The join timeout the agent had (``--rdzv-timeout``, plus its share per node).
        min_nodes: The job's MIN nodes.
        nodes: The allocation's nodes by node rank (host names under Slurm, else ``node N``).
        joined: Node ranks that recorded joining this round (:func:`joined`).
    """
    if type(error).__name__ != "RendezvousTimeoutError":
        return (f"the rendezvous on this node ({endpoint}) failed: {error}. Is the port in use "
                "by another job? Set --rdzv-port")
    missing = [f"{name} (node rank {rank})" for rank, name in enumerate(nodes) if rank not in joined]
    waited = (f"the rendezvous on this node ({endpoint}) timed out: fewer than {min_nodes} "
              f"node{'s' if min_nodes != 1 else ''} joined within {timeout_s:g} s "
              f"({TIMEOUT_FLAG} sets it)")
    if missing:
        arrived = len(nodes) - len(missing)
        return (f"{waited}; {arrived} of {len(nodes)} joined, never joined: {', '.join(missing)} "
                f"(did their launchers start? see their logs; a node slow to start needs a "
                f"longer {TIMEOUT_FLAG})")
    return (f"{waited}; every node's launcher set out to join, so they could not reach {endpoint} "
            f"or left the round (see their logs; `hpc doctor` checks the network)")


def explain_non_host(error: BaseException, *, endpoint: str, answered: bool, timeout_s: float) -> str | None:
    """The reason a node other than the host records for a failed rendezvous, or None when
    the host's store did not answer (then the host is lost: succession, or a node failure) (pure).

    Args:
        error: What torch's agent raised.
        endpoint: ``host:port`` of the rendezvous.
        answered: Whether the host's store answered just after the error.
        timeout_s: The join timeout the agent had.
    """
    if not answered:
        return None
    name = type(error).__name__
    head = f"the rendezvous failed while its host {endpoint} answered, so the host is not lost ({name}: {error})"
    if "Closed" in name or "GracefulExit" in name:
        return f"{head}: the others closed the rendezvous, the job is ending; this node follows node 0's outcome"
    if name == "RendezvousTimeoutError":
        return (f"{head}: fewer nodes than the job's MIN joined within {timeout_s:g} s ({TIMEOUT_FLAG} "
                "sets it); the host's outcome names the nodes that did not")
    return f"{head}: a configuration or protocol error, not a lost node (see this node's log)"
