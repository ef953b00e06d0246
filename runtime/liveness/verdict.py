"""Is this node stalled, and who is the suspect? (pure)

Inputs are the local workers' heartbeats (with their alive beats), whether each process is
stopped (SIGSTOP, a tracer), the clock, what other nodes published, and what the stack dumps
show. A stall is decided on evidence, in two steps.

:func:`judge`, without stacks: *hard* faults are stalls at the short deadline, whatever the
ranks' stacks say: a process past its deadline that is stopped or whose alive beat fell
silent (:attr:`RankState.frozen`), and, at once, a peer node that stopped answering the
rendezvous store (:mod:`.peers`) while no local rank progressed for :data:`QUIET_S` seconds
(whatever the phase: a link cut during a checkpoint save must not wait for the save's
budget). Otherwise nothing is declared while *any* rank still makes progress (or is inside a
phase within its budget), or another node progressed or has a busy rank: training is
synchronous, so the others may be waiting for it. What is left (every local rank past its
deadline) is only a *candidate*.

:func:`weigh`, with the stacks of a candidate: a rank past its deadline whose process is
alive (its alive beat fresh, not stopped) and whose main thread is outside any collective is
*busy* (an evaluation, I/O, the user's own code not marked with ``session.phase``): it gets
the long ``busy_s`` budget (``--busy-timeout``) and is reported as running long, not killed.
When every local rank waits inside a collective, that collective is stalled (a peer elsewhere
froze or is gone) once it exceeded the short deadline, counted from when a rank was last seen
busy (it may just have joined) and, when other nodes watch too, after a short margin that
lets a node whose rank is busy say so first (:data:`PEER_REPORT_S`), unless another node's
watch already acted on a stall (its workers are being killed: no margin, the same moment).

The suspect is, in order: a stopped process; one whose alive beat fell silent; a rank whose
stack shows it outside any collective (it never reached the one its peers wait in: a rank
busy past ``busy_s``, or a script without alive beats stuck in its own code); the rank with
the lowest step; the oldest heartbeat. Each stall has a ``kind`` naming the evidence; only a
frozen process, a lost peer or a rank that could not even be dumped (:data:`HARDWARE_KINDS`)
mark a node as bad. When every local rank
waits in a collective and none is stopped, the stall comes from another node (a cut link, a
peer that froze there): the verdict says so instead of naming an innocent local rank.

:func:`desync`, whatever the deadlines (the first steps' long budget included): local ranks
whose main threads all wait, idle, in *different* collectives (rank 0 in DDP's all-reduce
inside ``backward``, rank 1 in a checkpoint's ``all_gather_object``) are deadlocked: each waits
for a collective the other never enters, so no budget can help. Decided on evidence only: every
main thread inside a collective, none of them using the CPU for :data:`DESYNC_S` (a rank that
computes, or whose process still moves data, is not waiting), at least two collectives, none a
point-to-point one (pipeline stages wait in different sends and receives by design).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runtime.liveness.deadline import OUTPUT, STEP, StallPolicy, deadline_s
from runtime.liveness.heartbeat import Heartbeat

# Frames (path fragments) that mean "this thread waits in a collective or in the autograd
# engine, where DDP/FSDP reduce gradients".
COLLECTIVE_FRAMES = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/",
                     "/torch/_tensor.py")
# Our own waits on a posted collective (the step boundary's stop agreement, the metrics'
# reduction): the top frame is ours, the wait itself is C code below it.
OWN_COLLECTIVE_FRAMES = ("runtime/liveness/posted.py",)
WORKER_FRAME = "runtime/worker/start.py"   # the bottom of every worker's main thread
TOP_FRAMES = 4
QUIET_S = 5.0   # no local progress for this long, with a peer node lost: stalled
IN_PROCESS_PHASES = ("recover", "join")   # the Session's phases of an in-process recovery
PEER_REPORT_S = 10.0   # extra wait before blaming another node, while other nodes watch too
DESYNC_S = 8.0    # local ranks idle this long in different collectives: a deadlock
# Collectives whose ranks legitimately wait in different calls (a pipeline's stages).
P2P_CALLS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
             "recv_object_list", "P2POp")
# Frames of decorators around torch's collectives: the call is the function they wrap.
WRAPPER_FUNCS = ("wrapper", "inner", "_fn", "decorate_context", "_call_impl", "_wrapped_call_impl")
# Kinds of stall (HangEvent.kind): which evidence decided it.
FROZEN, LOST, BUSY, USER, COLLECTIVE, QUIET = "frozen", "lost", "busy", "user", "collective", "quiet"
DESYNC = "desync"
POSTED = "a posted collective"   # waiting_call's name for our own wait (runtime.liveness.posted)
HARDWARE_KINDS = (FROZEN, LOST, QUIET)   # the kinds that exclude the suspect's node


@dataclass(frozen=True)
class RankState:
    """One local worker as judged now."""

    beat: Heartbeat
    stopped: bool
    age_s: float
    deadline_s: float
    alive_age_s: float | None = None   # seconds since its alive beat; None: it has none
    alive_s: float = 10.0              # an alive beat older than this is silent

    @property
    def overdue(self) -> bool:
        return self.age_s > self.deadline_s

    @property
    def silent(self) -> bool:
        """It has an alive beat, and the beat stopped (the process no longer runs)."""
        return self.alive_age_s is not None and self.alive_age_s > self.alive_s

    @property
    def frozen(self) -> bool:
        """Stopped, or its alive beat is silent: no work can be going on in it."""
        return self.stopped or self.silent

    @property
    def alive(self) -> bool:
        """Evidence that the process runs: a fresh alive beat and not stopped."""
        return self.alive_age_s is not None and not self.frozen

    def describe(self) -> str:
        b = self.beat
        flags = " STOPPED" if self.stopped else " SILENT" if self.silent else ""
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
    kind: str = ""          # which evidence decided a stall (FROZEN, LOST, BUSY, ...)
    busy: tuple[int, ...] = ()   # ranks found alive and working outside any collective

    @property
    def hard(self) -> bool:
        """A stall decided without stacks (a frozen process, a lost peer): no weighing."""
        return self.stalled and self.kind in (FROZEN, LOST)


def assess(beats: Sequence[Heartbeat], stopped: Mapping[int, bool], now: float,
           policy: StallPolicy, ran: Mapping[int, float] | None = None) -> tuple[RankState, ...]:
    """Each live worker's age and deadline (``stopped`` maps pid -> stopped).

    ``ran`` maps pid -> the last time the kernel saw the process work (its CPU time grew, or
    it was running or in I/O): the same evidence as a fresh alive beat, from outside the
    interpreter. A call that holds the interpreter's lock for a long time (a C extension, a
    ``json.dumps`` of a huge object) silences the alive beat thread, not the CPU.

    A stopped process makes no progress in any phase, however long its steps were: it gets
    the floor (or the fixed deadline). One whose alive beat is silent gets an ordinary step's
    deadline (a long call that holds the interpreter's lock silences the beat too).
    """
    out = []
    for b in sorted(beats, key=lambda b: b.rank):
        alive_age = b.alive_age_s(now)
        if alive_age is not None and ran is not None and b.pid in ran:
            alive_age = min(alive_age, max(0.0, now - ran[b.pid]))
        halted = bool(stopped.get(b.pid))
        cold = halted or (alive_age is not None and alive_age > policy.alive_s)
        limit = deadline_s(policy, phase=STEP if cold else b.phase,
                           steps_done=max(b.steps_done, policy.first_steps) if cold else b.steps_done,
                           p99_s=None if halted else b.p99_s, samples=b.samples,
                           budget_s=None if cold else b.budget_s,
                           measured_s=b.measured_s)
        out.append(RankState(b, halted, max(0.0, now - b.time), limit, alive_age, policy.alive_s))
    return tuple(out)


def judge(ranks: Sequence[RankState], *, peer_progress_age_s: float | None = None,
          lost_peers: Mapping[str, float] | None = None, peer_busy: str = "") -> Verdict:
    """Whether the node is stalled or a candidate (before any stack is taken).

    Args:
        ranks: From :func:`assess`.
        peer_progress_age_s: Seconds since the latest progress any other node published
            (None: no other node, or none that publishes): the local ranks may wait for it.
        lost_peers: Peer nodes (name -> seconds silent) that stopped answering the store.
        peer_busy: A busy rank another node reported (its description), or "".

    Returns:
        A hard stall (``kind`` FROZEN or LOST), no stall, or a candidate (``stalled`` with
        no kind yet) for :func:`weigh`.
    """
    # A rank recovering in-process (or joining) from that very loss is not stuck on it: its
    # phase's budget applies (--recovery inprocess, runtime.inprocess.worker).
    recovering = any(r.beat.phase in IN_PROCESS_PHASES and not r.stopped for r in ranks)
    if lost_peers and ranks and not recovering and min(r.age_s for r in ranks) >= QUIET_S:
        name, silent = max(lost_peers.items(), key=lambda kv: kv[1])
        quiet = min(r.age_s for r in ranks)
        return Verdict(True, tuple(ranks), None,
                       f"node {name} stopped answering the rendezvous store {silent:.0f}s ago and no "
                       f"rank here progressed for {quiet:.1f}s", lost_node=name, kind=LOST)
    overdue = [r for r in ranks if r.overdue]
    if not overdue:
        return Verdict(False, tuple(ranks))
    why = "; ".join(r.describe() for r in overdue)
    if any(r.frozen for r in overdue):
        return Verdict(True, tuple(ranks), reason=why, kind=FROZEN)
    alive = [r for r in ranks if not r.overdue]
    if alive:
        return Verdict(False, tuple(ranks), reason=f"may be waiting for {alive[0].describe()}")
    shortest = min(r.deadline_s for r in overdue)
    if peer_progress_age_s is not None and peer_progress_age_s < shortest:
        return Verdict(False, tuple(ranks), reason=f"another node progressed {peer_progress_age_s:.1f}s ago")
    if peer_busy:
        return Verdict(False, tuple(ranks), reason=f"may be waiting for {peer_busy}")
    return Verdict(True, tuple(ranks), reason=why)


def weigh(verdict: Verdict, stacks: Mapping[int, str], policy: StallPolicy, *,
          busy_seen_at: float | None = None, now: float, peers_watch: bool = False,
          peer_stall: str = "") -> Verdict:
    """A candidate of :func:`judge` weighed with the ranks' stacks (``rank -> text``).

    Args:
        verdict: A candidate (stalled, not hard).
        stacks: The dumps just taken.
        policy: For ``busy_s``.
        busy_seen_at: When a rank of this node was last found busy while the ranks made no
            progress since (None: never): a collective they all wait in now started after it.
        now: The clock of the heartbeats.
        peers_watch: Other nodes' stall watches publish (they may report a busy rank).
        peer_stall: A stall another node's watch acted on since these ranks last progressed
            (its summary), or "": the ranks here that wait in a collective wait for workers
            that are being killed.

    Returns:
        Not stalled (busy ranks within their budget, or a collective still within its
        bound), or stalled with ``kind`` BUSY (past ``busy_s``) or the blamed suspect.
    """
    assert verdict.stalled and not verdict.hard
    ranks = verdict.ranks
    busy = [r for r in ranks if r.overdue and r.alive
            and main_thread_in_collective(stacks.get(r.beat.rank, "")) is False]
    if busy:
        ids = tuple(r.beat.rank for r in busy)
        r = max(busy, key=lambda r: r.age_s)
        budget = max(policy.busy_s, r.deadline_s)
        where = f"in phase {r.beat.phase} at step {r.beat.step}"
        if r.age_s > budget:
            return Verdict(True, ranks, r.beat.rank,
                           f"rank {r.beat.rank} ran outside any collective {where} for "
                           f"{r.age_s:.0f}s without progress, alive, past its busy budget of "
                           f"{budget:.0f}s (--busy-timeout)", kind=BUSY, busy=ids)
        return Verdict(False, ranks, r.beat.rank,
                       f"rank {r.beat.rank} is running long: alive and working outside any "
                       f"collective {where} for {r.age_s:.0f}s (no progress past its "
                       f"{r.deadline_s:.0f}s step deadline; busy budget {budget:.0f}s, "
                       "--busy-timeout)", busy=ids)
    waiting = bool(ranks) and all(main_thread_in_collective(stacks.get(r.beat.rank, "")) for r in ranks)
    bound = min(r.deadline_s for r in ranks) if ranks else 0.0
    if waiting and peer_stall:
        return Verdict(True, ranks, None, f"every rank on this node waits in a collective and another "
                       f"node's watch acted: {peer_stall}", kind=COLLECTIVE)
    if busy_seen_at is not None and now - busy_seen_at <= bound:
        return Verdict(False, ranks, reason=f"no rank is busy any more (last seen {now - busy_seen_at:.0f}s "
                                            f"ago); its collective gets {bound:.0f}s from then")
    if waiting and peers_watch and min(r.age_s for r in ranks) <= bound + PEER_REPORT_S:
        return Verdict(False, ranks, reason="every rank here waits in a collective; the other "
                                            "nodes' stall watch may report a busy rank first")
    return blame(verdict, stacks)


def _main_frames(stack: str) -> list[str] | None:
    """The main thread's ``File ...`` lines of a faulthandler dump, most recent first (None:
    no main thread in it)."""
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
    return next((b for b in blocks if any(WORKER_FRAME in f for f in b)), None)


def main_thread_in_collective(stack: str) -> bool | None:
    """Whether a worker's faulthandler dump shows its main thread inside a collective.

    None when the dump is empty or has no main thread (the worker could not dump).
    """
    main = _main_frames(stack)
    if main is None:
        return None
    top = main[:TOP_FRAMES]
    return any(m in f for f in top for m in COLLECTIVE_FRAMES) or \
        any(m in top[0] for m in OWN_COLLECTIVE_FRAMES)


_FRAME = re.compile(r'File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')


def waiting_call(stack: str) -> tuple[str, str] | None:
    """The collective a worker's main thread waits in, and where it was called from:
    ``("all_gather_object", "runtime/checkpointer.py:315 <- runtime/session.py:834")``; None
    when the main thread is not inside a collective (or could not be dumped).

    The call is the outermost function of torch on the stack, the decorators around it
    skipped, or :data:`POSTED` for our own wait on a posted collective (the frame below it
    says which); the place is the first two frames outside them."""
    if not main_thread_in_collective(stack):
        return None
    call, where = "", []
    for text in _main_frames(stack) or []:
        m = _FRAME.search(text)
        if m is None:
            continue
        path = m["path"]
        ours = any(o in path for o in OWN_COLLECTIVE_FRAMES)
        if not where and ("/torch/" in path or ours):
            if m["func"] not in WRAPPER_FUNCS:
                call = POSTED if ours else m["func"]
            continue
        if WORKER_FRAME in path or len(where) == 2:
            break
        where.append(f"{'/'.join(path.split('/')[-2:])}:{m['line']}")
    return call or "?", " <- ".join(where)


def desync(ranks: Sequence[RankState], stacks: Mapping[int, str], idle_s: Mapping[int, float], *,
           bound_s: float = DESYNC_S, ordinary_s: Mapping[int, float] | None = None) -> Verdict | None:
    """Local ranks deadlocked in different collectives (see the module docstring), or None.

    Also, with ``ordinary_s``: ranks in their first steps (the long budget is for compilation
    and warm-up, work) that all wait, idle, in one collective past an ordinary step's
    deadline are stalled (kind COLLECTIVE): nothing here works, and the caller saw nothing
    elsewhere work either.

    Args:
        ranks: From :func:`assess` (this node's workers).
        stacks: ``rank -> dump``, just taken.
        idle_s: ``rank ->`` seconds its main thread used no CPU while its process moved
            nothing (the watchdog's reading of ``/proc``).
        bound_s: How long every rank must have been idle and without progress.
        ordinary_s: ``rank ->`` its ordinary step deadline (outside the first steps' budget).
    """
    if len(ranks) < 2 or any(r.frozen or r.beat.phase in IN_PROCESS_PHASES for r in ranks):
        return None
    if any(r.age_s < bound_s or idle_s.get(r.beat.rank, 0.0) < bound_s for r in ranks):
        return None
    calls = {r.beat.rank: waiting_call(stacks.get(r.beat.rank, "")) for r in ranks}
    if any(c is None for c in calls.values()):
        return None
    if any(c[0] in P2P_CALLS for c in calls.values() if c):
        return None
    by_call: dict[str, list[int]] = {}   # our own waits differ by where they were posted
    for rank, c in sorted(calls.items()):
        assert c is not None
        by_call.setdefault(c[0] if c[0] != POSTED else f"{c[0]} at {c[1].split(' <- ')[0]}", []).append(rank)
    quiet = min(min(r.age_s, idle_s[r.beat.rank]) for r in ranks)
    steps = "/".join(map(str, sorted({r.beat.step for r in ranks})))
    parts = []
    for rs in by_call.values():
        call, where = calls[rs[0]] or ("?", "")
        who = f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        parts.append(f"{who} in {call}" + (f" ({where})" if where else ""))
    if len(by_call) == 1:
        if ordinary_s is None or not all(
                r.beat.phase == STEP and r.deadline_s > ordinary_s.get(r.beat.rank, r.deadline_s)
                and quiet > ordinary_s.get(r.beat.rank, r.deadline_s) for r in ranks):
            return None
        bound = max(ordinary_s[r.beat.rank] for r in ranks)
        return Verdict(True, tuple(ranks), None,
                       f"every rank here waits in one collective, idle for {quiet:.0f}s at step {steps} "
                       f"(past an ordinary step's {bound:.0f}s; the first steps' budget is for work): "
                       f"{parts[0]}; no rank here or on another node works", kind=COLLECTIVE)
    odd = min(by_call.values(), key=lambda rs: (len(rs), rs[0]))[0]
    return Verdict(True, tuple(ranks), odd,
                   f"ranks wait in different collectives, idle for {quiet:.0f}s at step {steps}: "
                   f"{'; '.join(parts)}: a deadlock (each waits for a collective the others never "
                   "enter; a decision that differed between ranks)", kind=DESYNC)


def blame(verdict: Verdict, stacks: Mapping[int, str]) -> Verdict:
    """Names the suspect of a stalled node, using the stack dumps (``rank -> text``)."""
    assert verdict.stalled
    ranks = verdict.ranks

    def outside(r: RankState) -> bool:
        return main_thread_in_collective(stacks.get(r.beat.rank, "")) is False

    frozen = [r for r in ranks if r.stopped]
    if frozen:
        r = frozen[0]
        return _named(verdict, r, f"rank {r.beat.rank} is stopped (SIGSTOP or a tracer) at step "
                                  f"{r.beat.step}", FROZEN)
    silent = [r for r in ranks if r.silent and r.overdue]
    if silent:
        r = max(silent, key=lambda r: r.alive_age_s or 0.0)
        return _named(verdict, r, f"rank {r.beat.rank}'s process stopped running (its alive beat "
                                  f"is silent for {r.alive_age_s:.0f}s) at step {r.beat.step}", FROZEN)
    loose = [r for r in ranks if r.overdue and outside(r)]
    if loose:
        r = min(loose, key=lambda r: (r.beat.step, r.beat.time))
        return _named(verdict, r, f"rank {r.beat.rank} is stuck outside any collective in phase "
                                  f"{r.beat.phase} at step {r.beat.step} (its peers wait for it)", USER)
    if verdict.lost_node:
        return verdict
    waiting = [r for r in ranks if main_thread_in_collective(stacks.get(r.beat.rank, ""))]
    if ranks and len(waiting) == len(ranks):
        steps = sorted({r.beat.step for r in ranks})
        return Verdict(True, ranks, None, f"every rank on this node waits in a collective (step "
                       f"{'/'.join(map(str, steps))}): a peer on another node stopped answering",
                       kind=COLLECTIVE)
    r = min(ranks, key=lambda r: (r.beat.step, r.beat.time))
    return _named(verdict, r, f"rank {r.beat.rank} made no progress in phase {r.beat.phase} at step "
                              f"{r.beat.step} for {r.age_s:.1f}s", QUIET)


def _named(verdict: Verdict, r: RankState, why: str, kind: str) -> Verdict:
    if verdict.lost_node:
        why += f"; also: {verdict.reason}"
    return Verdict(True, verdict.ranks, r.beat.rank, why, verdict.lost_node,
                   kind=LOST if verdict.lost_node else kind, busy=verdict.busy)
