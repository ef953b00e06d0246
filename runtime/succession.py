"""Rendezvous succession: when the rendezvous node is lost, the survivors pick a new one.

The c10d store lives on one node (node 0 of the allocation at first). When that node
crashes or is cut off, the other launchers lose the store and torch's agent gives up with a
rendezvous error; before this module, the job could only be requeued (back into the queue,
often for hours) although the survivors hold a valid allocation.

The protocol, run by each launcher whose agent lost the store (and whose old host recorded
no outcome of its own, i.e. did not simply end the job):

1. **Announce** on the shared job directory: ``JOB_DIR/.rdzv/alloc-A/epoch-E/<host>``,
   where E is the next epoch. A node that cannot reach Slurm's controller does not announce:
   it is the one cut off, not the survivors (a cut node loses its network, the controller
   with it).
2. **Wait** until every member of the previous epoch but the old host has announced, or a
   window that grows with the epoch's size has passed. Only the first survivors in order
   (:data:`DECIDERS`) list the announcements; the others look for the decision only.
3. **Decide once**: the first decider to get here links ``decision.json`` into place
   (exclusive); all others read it. The decision (:func:`elect`, pure) is a *strict majority* of the previous
   epoch's members and at least MIN nodes; the new host is the first survivor in the
   allocation's node order. Without a majority (2 nodes, one lost) nobody continues: the job
   is recorded and requeued as before, so two halves can never both train.
4. The members start a new agent with the new host and a new run id (``RUN-eE``); workers
   resume from the last checkpoint at the smaller world size. ``current.json`` names the
   epoch's host for launchers that start later (a node that joins as MAX grows again).

**Fencing.** The old host may be alive and cut off (its processes run on). It learns of the
newer epoch from the job directory (:meth:`Board.fenced`) and stops its workers; and every
checkpoint commit checks that its epoch is still the current one (``HPC_RDZV_EPOCH``), so a
fenced group can never commit a checkpoint even in the moment before it stops. The same holds
when the survivors found no majority and requeue the job: the old host sees the election it
was not part of and stops too. What this does
not cover: a partition of the shared filesystem itself (then neither side can commit, and the
job ends at its time limit or by Slurm); see docs/fault-tolerance.md.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc.contract import jobdir, jobpaths
from hpc.contract.jobpaths import JobPaths
from hpc.contract.environment import JobEnvironment

BOARD_DIR = jobpaths.RDZV_BOARD
ANNOUNCE_WINDOW_S = 8.0     # how long survivors wait for each other before deciding (at least)
DECIDERS = 3                # survivors that list the announcements and decide
DECIDER_STAGGER_S = 2.0     # the k-th decider's turn comes this much after the (k-1)-th's
LOOK_EVERY_S = 0.5          # how often a survivor that does not decide looks for the decision


@dataclass(frozen=True)
class Epoch:
    """One rendezvous epoch of an allocation: its host and its members (host names)."""

    index: int
    host: str
    members: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True)
class Election:
    """The outcome of :func:`elect`: the next epoch, or None with the reason why not."""

    epoch: Epoch | None
    reason: str


def elect(previous: Epoch, announced: Sequence[str], *, order: Sequence[str], min_nodes: int) -> Election:
    """Who hosts the next epoch, if anyone may continue (pure).

    Args:
        previous: The epoch whose host was lost.
        announced: Survivors that announced themselves for the next epoch.
        order: The allocation's nodes in Slurm's order (the succession order).
        min_nodes: The job's MIN nodes.
    """
    present, known = set(announced), set(order)     # sets: O(N), not O(N^2) (10,000 nodes)
    survivors = [h for h in order if h in present and h != previous.host]
    survivors += sorted(h for h in present if h not in known and h != previous.host)
    members = len(previous.members)
    if len(survivors) * 2 <= members:
        return Election(None, f"{len(survivors)} of {members} nodes survived the loss of "
                              f"{previous.host}: no majority, so no side may go on alone")
    if len(survivors) < min_nodes:
        return Election(None, f"{len(survivors)} surviving nodes are fewer than MIN {min_nodes}")
    nxt = Epoch(previous.index + 1, survivors[0], tuple(survivors),
                f"{previous.host} lost; {len(survivors)} of {members} nodes go on")
    return Election(nxt, nxt.reason)


class Board:
    """The succession files of one allocation on the shared job directory."""

    def __init__(self, job_dir: Path, allocation: int) -> None:
        self.paths, self.allocation = JobPaths(job_dir), allocation
        self.root = self.paths.rdzv_board(allocation)

    def _epoch_dir(self, index: int) -> Path:
        return self.paths.rdzv_epoch(self.allocation, index)

    def announce(self, index: int, host: str) -> None:
        d = self._epoch_dir(index)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        (d / host).touch()

    def announced(self, index: int) -> list[str]:
        d = self._epoch_dir(index)
        return sorted(p.name for p in d.iterdir() if not p.name.endswith(".json")) if d.is_dir() else []

    def decide(self, index: int, election: Election) -> Election:
        """Writes the decision for ``index`` unless one exists; returns the one that counts."""
        path = self.paths.rdzv_decision(self.allocation, index)
        data = {"epoch": asdict(election.epoch) if election.epoch else None, "reason": election.reason}
        # Written whole under a private name, then linked into place: the link fails if a
        # decision exists, and a reader never sees one half-written (an empty decision.json,
        # read between an O_EXCL create and its write, made survivors go on with their own
        # election: two member lists for one epoch, seen at 1,024 simulated nodes).
        tmp = path.with_name(f".{path.stem}-{socket.gethostname()}-{os.getpid()}-"
                             f"{threading.get_ident()}{path.suffix}")   # not an announcement
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return self.decision(index) or election
        finally:
            tmp.unlink(missing_ok=True)
        if election.epoch is not None:
            self.publish(election.epoch)
        return election

    def decision(self, index: int) -> Election | None:
        data = jobdir.read_json(self.paths.rdzv_decision(self.allocation, index))
        if data is None:
            return None
        ep = data.get("epoch")
        epoch = Epoch(ep["index"], ep["host"], tuple(ep["members"]), ep.get("reason", "")) if ep else None
        return Election(epoch, str(data.get("reason", "")))

    def publish(self, epoch: Epoch) -> None:
        """Names the current epoch and its host (for fencing and for later joiners)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        jobdir.write_atomic(self.paths.rdzv_current(self.allocation), json.dumps(asdict(epoch)) + "\n")

    def current(self) -> Epoch | None:
        data = jobdir.read_json(self.paths.rdzv_current(self.allocation))
        if not data:
            return None
        return Epoch(data["index"], data["host"], tuple(data["members"]), data.get("reason", ""))

    def fenced(self, index: int, host: str) -> str | None:
        """Why ``host``, a member of epoch ``index``, must stop now, or None.

        A newer epoch that left it out, or an election for the next epoch that it did not take
        part in (the others lost it as their host; without a majority they requeue the job, so
        it must not go on alone either).
        """
        cur = self.current()
        if cur is not None and cur.index > index and host not in cur.members:
            return (f"rendezvous epoch {index} was replaced by epoch {cur.index} (host {cur.host}, "
                    f"members {', '.join(cur.members)})")
        decided = self.decision(index + 1)
        if decided is None:
            return None
        announced = self.announced(index + 1)
        if host in announced or (decided.epoch is not None and host in decided.epoch.members):
            return None
        if decided.epoch is None and cur is not None and cur.index == index:
            # A minority that lost this side (a cut node, alone) found no majority and stops; the
            # side left out of its election still holds a strict majority of the epoch and goes on.
            left_out = [h for h in cur.members if h not in announced]
            if len(left_out) * 2 > len(cur.members):
                return None
        return f"the other nodes lost this one and decided without it: {decided.reason}"


def announce_window_s(members: int) -> float:
    """How long the deciders wait for the others' announcements: longer for larger epochs
    (their launchers lose the store over a spread of beats, and announce over a loaded
    filesystem): 8 s up to ~100 nodes, 16 s at 1,024."""
    return ANNOUNCE_WINDOW_S + members / 128


def decider_rank(previous: Epoch, host: str, order: Sequence[str]) -> int:
    """``host``'s place among the survivors that may decide: the members of ``previous`` but
    its host, in the allocation's order (a host not among them comes last)."""
    members = set(previous.members)   # a set: every survivor calls this (O(N^2) with the tuple)
    candidates = [h for h in order if h in members and h != previous.host]
    return candidates.index(host) if host in candidates else len(candidates)


def run_election(board: Board, previous: Epoch, host: str, *, order: Sequence[str], min_nodes: int,
                 window_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> Election:
    """Announces ``host`` for the next epoch, waits for the others, and decides (once, for all).

    Only the first :data:`DECIDERS` survivors in order list the announcements (the k-th from
    ``k x DECIDER_STAGGER_S`` on, in case those before it are gone too) and decide; the others
    only look for the decision, one file read per look. Every survivor listing an N-entry
    directory five times a second was O(N^2) on the filesystem and outran the window at 1,024
    simulated nodes. Should no decider decide, the others decide themselves after the window
    and every decider's turn (the decision is exclusive: the first one counts).
    """
    index = previous.index + 1
    window_s = announce_window_s(len(previous.members)) if window_s is None else window_s
    board.announce(index, host)
    expected = {h for h in previous.members if h != previous.host}
    k = decider_rank(previous, host, order)
    start = clock()
    turn = start + (k * DECIDER_STAGGER_S if k < DECIDERS else window_s + DECIDERS * DECIDER_STAGGER_S)
    end = start + window_s + min(k, DECIDERS) * DECIDER_STAGGER_S
    seen: set[str] = set()
    while True:
        existing = board.decision(index)
        if existing is not None:
            return existing
        now = clock()
        if now >= turn:
            seen = set(board.announced(index))
            if expected <= seen or now >= end:
                break
        sleep(0.2 if now >= turn else LOOK_EVERY_S)
    return board.decide(index, elect(previous, sorted(seen), order=order, min_nodes=min_nodes))


def epoch_zero(host: str, members: Sequence[str]) -> Epoch:
    """The allocation's first epoch: its first node hosts the rendezvous."""
    return Epoch(0, host, tuple(members), "allocation start")


def fence_reason(env: Mapping[str, str]) -> str | None:
    """Why this worker's group must not commit a checkpoint (a newer rendezvous epoch of its
    allocation exists), or None; None too outside a launcher (no epoch in ``env``)."""
    job = JobEnvironment.from_env(env)
    if job.rdzv_epoch is None or not job.job_dir or job.allocation is None:
        return None
    return check_not_fenced(Path(job.job_dir), job.allocation, job.rdzv_epoch, socket.gethostname())


def check_not_fenced(job_dir: Path, allocation: int, epoch: int, host: str) -> str | None:
    """Why ``host``'s group of ``epoch`` must not commit a checkpoint, or None."""
    why = Board(job_dir, allocation).fenced(epoch, host)
    return None if why is None else f"this group is fenced off ({why})"
