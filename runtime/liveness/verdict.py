"""Is this node stalled, and who is the suspect? (pure)

Inputs are the local workers' heartbeats, whether each process is stopped (SIGSTOP, a
tracer), the clock, the latest progress other nodes published, and optionally what the stack
dumps show. A node is *stalled* when every local rank is past the deadline of its phase and
no other node made progress within that deadline, or when a stopped process is past its
deadline, or at once when a peer node stopped answering the rendezvous store
(:mod:`.peers`) and no local rank made progress for :data:`QUIET_S` seconds (whatever the
phase: a link cut during a checkpoint save must not wait for the save's budget). Ranks that wait in a collective for a peer that saves, evaluates or just came out
of a long phase look exactly like stuck ones; but training is synchronous, so while *any*
rank still makes progress (or is inside a phase within its budget) the others may be waiting
for it, and nothing is declared.

The suspect is, in order: a stopped process; a rank whose stack shows it outside any
collective (it never reached the one its peers wait in: a data loader that hangs, a deadlock
in user code); the rank with the lowest step; the oldest heartbeat. When every local rank
waits in a collective and none is stopped, the stall comes from another node (a cut link, a
peer that froze there): the verdict says so instead of naming an innocent local rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runtime.liveness.deadline import OUTPUT, STEP, StallPolicy, deadline_s
from runtime.liveness.heartbeat import Heartbeat

# Frames (path fragments) that mean "this thread waits in a collective or in the autograd
# engine, where DDP/FSDP reduce gradients".
COLLECTIVE_FRAMES = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/",
                     "/torch/_tensor.py")
WORKER_FRAME = "runtime/worker.py"   # the bottom of every worker's main thread
TOP_FRAMES = 4
QUIET_S = 5.0   # no local progress for this long, with a peer node lost: stalled


@dataclass(frozen=True)
class RankState:
    """One local worker as judged now."""

    beat: Heartbeat
    stopped: bool
    age_s: float
    deadline_s: float

    @property
    def overdue(self) -> bool:
        return self.age_s > self.deadline_s

    def describe(self) -> str:
        b = self.beat
        flags = " STOPPED" if self.stopped else ""
        if b.phase == OUTPUT:   # no heartbeats: its output is all we know
            limit = f"deadline {self.deadline_s:.1f}s" if self.deadline_s != float("inf") else "no deadline"
            return (f"rank {b.rank} (local {b.local_rank}, pid {b.pid}){flags}: phase output, no "
                    f"output for {self.age_s:.1f}s ({limit})")
        return (f"rank {b.rank} (local {b.local_rank}, pid {b.pid}){flags}: phase {b.phase}, "
                f"step {b.step}, no progress for {self.age_s:.1f}s (deadline {self.deadline_s:.1f}s)")


@dataclass(frozen=True)
class Verdict:
    """What the watchdog concludes about its node."""

    stalled: bool
    ranks: tuple[RankState, ...]
    suspect_rank: int | None = None
    reason: str = ""
    lost_node: str = ""     # a peer node that stopped answering, when that is the evidence


def assess(beats: Sequence[Heartbeat], stopped: Mapping[int, bool], now: float,
           policy: StallPolicy) -> tuple[RankState, ...]:
    """Each live worker's age and deadline (``stopped`` maps pid -> stopped).

    A stopped process makes no progress in any phase: it gets an ordinary step's deadline.
    """
    out = []
    for b in sorted(beats, key=lambda b: b.rank):
        halted = bool(stopped.get(b.pid))
        limit = deadline_s(policy, phase=STEP if halted else b.phase,
                           steps_done=max(b.steps_done, policy.first_steps) if halted else b.steps_done,
                           p99_s=b.p99_s, samples=b.samples, budget_s=None if halted else b.budget_s,
                           measured_s=b.measured_s)
        out.append(RankState(b, halted, max(0.0, now - b.time), limit))
    return tuple(out)


def judge(ranks: Sequence[RankState], *, peer_progress_age_s: float | None = None,
          lost_peers: Mapping[str, float] | None = None) -> Verdict:
    """Whether the node is stalled (before any stack is taken).

    Args:
        ranks: From :func:`assess`.
        peer_progress_age_s: Seconds since the latest progress any other node published
            (None: no other node, or none that publishes): the local ranks may wait for it.
        lost_peers: Peer nodes (name -> seconds silent) that stopped answering the store.
    """
    if lost_peers and ranks and min(r.age_s for r in ranks) >= QUIET_S:
        name, silent = max(lost_peers.items(), key=lambda kv: kv[1])
        quiet = min(r.age_s for r in ranks)
        return Verdict(True, tuple(ranks), None,
                       f"node {name} stopped answering the rendezvous store {silent:.0f}s ago and no "
                       f"rank here progressed for {quiet:.1f}s", lost_node=name)
    overdue = [r for r in ranks if r.overdue]
    if not overdue:
        return Verdict(False, tuple(ranks))
    why = "; ".join(r.describe() for r in overdue)
    if any(r.stopped for r in overdue):
        return Verdict(True, tuple(ranks), reason=why)
    alive = [r for r in ranks if not r.overdue]
    if alive:
        return Verdict(False, tuple(ranks), reason=f"may be waiting for {alive[0].describe()}")
    shortest = min(r.deadline_s for r in overdue)
    if peer_progress_age_s is not None and peer_progress_age_s < shortest:
        return Verdict(False, tuple(ranks), reason=f"another node progressed {peer_progress_age_s:.1f}s ago")
    return Verdict(True, tuple(ranks), reason=why)


def main_thread_in_collective(stack: str) -> bool | None:
    """Whether a worker's faulthandler dump shows its main thread inside a collective.

    None when the dump is empty or has no main thread (the worker could not dump).
    """
    blocks, current = [], []
    for line in stack.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            if current:
                blocks.append(current)
            current = []
        elif line.strip().startswith("File "):
            current.append(line.strip())
    if current:
        blocks.append(current)
    main = next((b for b in blocks if any(WORKER_FRAME in f for f in b)), None)
    if main is None:
        return None
    return any(m in f for f in main[:TOP_FRAMES] for m in COLLECTIVE_FRAMES)


def blame(verdict: Verdict, stacks: Mapping[int, str]) -> Verdict:
    """Names the suspect of a stalled node, using the stack dumps (``rank -> text``)."""
    assert verdict.stalled
    ranks = verdict.ranks

    def outside(r: RankState) -> bool:
        return main_thread_in_collective(stacks.get(r.beat.rank, "")) is False

    frozen = [r for r in ranks if r.stopped]
    if frozen:
        r = frozen[0]
        return _named(verdict, r, f"rank {r.beat.rank} is stopped (SIGSTOP or a tracer) at step {r.beat.step}")
    loose = [r for r in ranks if r.overdue and outside(r)]
    if loose:
        r = min(loose, key=lambda r: (r.beat.step, r.beat.time))
        return _named(verdict, r, f"rank {r.beat.rank} is stuck outside any collective in phase "
                                  f"{r.beat.phase} at step {r.beat.step} (its peers wait for it)")
    if verdict.lost_node:
        return verdict
    waiting = [r for r in ranks if main_thread_in_collective(stacks.get(r.beat.rank, ""))]
    if ranks and len(waiting) == len(ranks):
        steps = sorted({r.beat.step for r in ranks})
        return Verdict(True, ranks, None, f"every rank on this node waits in a collective (step "
                       f"{'/'.join(map(str, steps))}): a peer on another node stopped answering")
    r = min(ranks, key=lambda r: (r.beat.step, r.beat.time))
    return _named(verdict, r, f"rank {r.beat.rank} made no progress in phase {r.beat.phase} at step "
                              f"{r.beat.step} for {r.age_s:.1f}s")


def _named(verdict: Verdict, r: RankState, why: str) -> Verdict:
    if verdict.lost_node:
        why += f"; also: {verdict.reason}"
    return Verdict(True, verdict.ranks, r.beat.rank, why, verdict.lost_node)
