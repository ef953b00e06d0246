"""A hot spare under ``--recovery inprocess``: its launcher starts joiners, not torch's agent.

With ``--recovery restart`` a spare node's launcher runs torch's agent, which waits on the c10d
rendezvous's redundancy list and is let in by a restart of every worker
(:mod:`runtime.launch.spares`). In in-process mode nobody restarts the members, so that door
never opens. Here the nodes beyond the job's largest size (node rank ``>= MAX``) are the
spares, by rank: their launchers do not join torch's rendezvous at all. Each starts its
``--nproc-per-node`` workers at once as *joiners* (``HPC_INPROC_JOIN=1``): they import torch,
build nothing yet and wait in the store (``join/N``, :mod:`runtime.inprocess.protocol`). When a
member node is lost, the survivors' re-form takes them in (up to the job's largest world), the
member holding the newest step broadcasts the state, and the world has its size again with no
checkpoint read. The launcher then records ``workers_started`` (the spare's join in the
goodput ledger, :mod:`hpc.contract.spare_waits`), announces its workers' deaths as a member node's
launcher does, kills a worker stopped (SIGSTOP) for
:data:`~runtime.inprocess.launcher.silent.STOPPED_S` as a member node's launcher does (then it is
announced dead: without that, a frozen taken-in worker held its peers in the step boundary's
broadcast until the allocation ended), and ends with them. A job that finishes first releases
the joiners (``done``): they exit 0, not needed. When the members leave in-process recovery
(``fallback`` in the store) the launcher ends its joiners and joins torch's rendezvous, as it
does when its workers, taken in, end with every member's; when every member starts again in a
new round without it, its joiners start again there (``spare_ready`` each time they all wait).

A spare's launcher watches its host's store as a member node's fence does
(:data:`runtime.launch.host_store.STORE_LOST_S`): the store carries the joiners' whole world,
so when it has not answered that long (and a request of its own confirms it), the host is lost:
the joiners are stopped, an ``inproc_fallback`` says why, and the launcher restarts itself into
the lost-host path (``relaunch``: a request to a silent store may never return, so the loop
that made it cannot be relied on to end) and ends as a node that lost its rendezvous host
(under Slurm: the succession; under hpc run: a node failure) instead of waiting on a silent
store with no end. A spare taken in takes the same path when its workers die and the store
does not answer (they died with the host, before the watch's bound).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from hpc.contract import recovery_settings
from runtime.inprocess import protocol as proto
from runtime.ending import outcome
from runtime.inprocess.launcher import agent as inprocess_agent, announce, silent as inprocess_silent
from runtime.launch import host_store
from runtime.liveness import proc

log = logging.getLogger("hpc.launch")
POLL_S = 0.5


def is_spare(spare_nodes: int, node_rank: int, max_nodes: int) -> bool:
    """Whether this node is one of the job's hot spares under in-process recovery (pure): the
    node ranks past the job's largest world."""
    return spare_nodes > 0 and node_rank >= max_nodes


def joiner_env(base: dict[str, str], store_address: str, *, local_rank: int, nproc: int,
               node_rank: int) -> dict[str, str]:
    """A spare's worker environment (pure): no rank of its own, the store, the join flag. No
    ``MASTER_PORT``: the running round's namespace is read from the store (``current``)."""
    env = {k: v for k, v in base.items() if k not in ("MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(inprocess_agent.worker_env(store_address))
    env.update(recovery_settings.InProcessEnvironment(join=True).to_env())
    env.update({"MASTER_ADDR": store_address.rpartition(":")[0], "RANK": "0",
                "WORLD_SIZE": "1", "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": str(node_rank), "TORCHELASTIC_RESTART_COUNT": "0"})
    return env


def run_spare(plan: Any, events: Any, relaunch: Callable[[], None]) -> outcome.AgentEnd | None:
    """Starts this spare node's joiners and watches them until they end.

    Args:
        plan: The node's :class:`runtime.launch.plan.LaunchPlan`.
        events: The launcher's ``EventLog``.
        relaunch: Replaces this launcher with one on the lost-host path (does not return);
            called from the store watch once the host is lost and the joiners are stopped.

    Returns:
        How the node ended; None when the members left in-process recovery for torch's
        restart path (``fallback`` in the store): the joiners are ended and this node joins
        torch's rendezvous as a member node would (the caller runs the agent). Without that,
        the members' new round waited for a node that never came: a node was lost while the
        spare's joiners still started, the FSDP2 world could not shrink, and the survivor's
        restart waited for the job's minimum of nodes until the rendezvous timeout.
    """
    import torch.distributed as dist

    started = time.time()
    nproc = plan.spec.nproc_per_node
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    procs = _start_joiners(plan, nproc)   # (replaced in place: the host watch holds the list)
    host, _, port = plan.rdzv_endpoint.rpartition(":")
    raw = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30),
                        wait_for_workers=False)
    me = socket.gethostname()
    uids = {proto.uid(me, p.pid) for p in procs}
    joined, ready, announced = False, False, set()
    store, space = None, None
    watch = _HostWatch(plan.rdzv_endpoint, lambda silent: _host_lost(plan, events, procs, silent, relaunch))
    watch.start()
    frozen = inprocess_silent.StoppedWorkers()
    while any(p.poll() is None for p in procs):
        now = time.monotonic()   # a stopped worker is frozen: killed, then announced dead below
        for pid in frozen.frozen({p.pid: proc.state(p.pid) for p in procs
                                  if p.poll() is None}, now):
            frozen.kill(pid, now)
        try:
            current = raw.check([proto.ROOT + proto.CURRENT])
            watch.answered_at = time.monotonic()
            now_space = raw.get(proto.ROOT + proto.CURRENT).decode() if current else None
            if store is not None and not joined and now_space != space:
                # Every member started again through torch's restart path (a new round, in a
                # new namespace) without needing this node: the joiners wait in the old one,
                # where nobody would take them in. New joiners wait in the new round.
                log.warning("in-process hot spare: the members started again in a new round (%s); "
                            "the joiners start again in it", now_space)
                inprocess_agent.end_processes(procs)
                procs[:] = _start_joiners(plan, nproc)
                uids, ready, announced = {proto.uid(me, p.pid) for p in procs}, False, set()
                frozen = inprocess_silent.StoppedWorkers()
                store = None
            if store is None and now_space:
                store, space = dist.PrefixStore(now_space, raw), now_space
            gave_up = _fallback(store)
            if gave_up is not None:
                watch.stop()
                _to_restart_path(events, procs, gave_up)
                return None
            if store is not None and not ready and _waiting(store, uids) == len(uids):
                ready = True   # (tests wait for it before a fault meant for the spare)
                events.emit("spare_ready", joiners=len(uids), waited_s=round(time.time() - started, 3))
                log.info("in-process hot spare: %d joiner(s) wait in the store, %.1fs after they started",
                         len(uids), time.time() - started)
            if store is not None and not joined and _taken_in(store, uids):
                joined = True
                events.emit("workers_started", nodes=None, spare=True, inproc=True)
                log.warning("in-process hot spare: taken in (a node was lost); training")
            for p in procs:
                if p.poll() not in (None, 0) and p.pid not in announced and store is not None:
                    announced.add(p.pid)
                    why = f"launcher on {me}: worker {p.pid} " + (
                        frozen.killed.get(p.pid) or "died, " +
                        inprocess_agent.describe_exit(inprocess_agent.popen_status(p.returncode)))
                    gen = (int(store.get(proto.GENERATION)) if store.check([proto.GENERATION]) else 0) \
                        if joined else None
                    announce.dead(store, [proto.uid(me, p.pid)], why, gen=gen)
        except Exception as e:   # noqa: BLE001 - the store host is gone: the workers end by themselves
            log.debug("in-process hot spare: store: %s", e)
        time.sleep(POLL_S)
    watch.stop()
    return _ended(plan, events, procs, store, joined=joined, started=started, relaunch=relaunch,
                  silent_s=time.monotonic() - watch.answered_at)


def _ended(plan: Any, events: Any, procs: list[subprocess.Popen], store: Any, *, joined: bool,
           started: float, relaunch: Callable[[], None], silent_s: float) -> outcome.AgentEnd | None:
    """How the spare node ended once its joiners have (see :func:`run_spare`'s return)."""
    gave_up = _fallback(store)
    if gave_up is not None:   # (a joiner taken in ended with the members' ShardedFallback)
        _to_restart_path(events, procs, gave_up)
        return None
    codes = tuple(p.returncode for p in procs)
    if all(c == 0 for c in codes):
        if not joined:
            log.info("hot spare not needed: the job ended while this node waited")
        return outcome.AgentEnd("succeeded", "", started, ended=time.time())
    if joined and host_store.answers(plan.rdzv_endpoint):
        # Taken in, this node is a member: its workers ended with the others' (every member
        # died), and the members' torch agents start again in a new round that counts it.
        log.warning("in-process hot spare: its workers (a member's since they were taken in) "
                    "ended (exit statuses %s): the node joins torch's restart path", codes)
        if events is not None:
            events.emit("inproc_fallback", spare=True, reason=f"the spare's workers, taken in, ended "
                        f"(exit statuses {codes}): the node joins torch's rendezvous")
        return None
    if not host_store.answers(plan.rdzv_endpoint):
        # The workers died with the host (their group and store were on it), before the store
        # watch's bound: the host's loss, not theirs. Ended as a failed node instead, the last
        # launcher of a MIN-2 job left nobody to elect a host or requeue (a fault campaign,
        # seed 3: the allocation held one idle node until the run's cap).
        _host_lost(plan, events, procs, silent_s, relaunch)
    return outcome.AgentEnd("failed", f"a hot spare's worker failed (exit statuses {codes})", started,
                            exit_codes=tuple(c for c in codes if c), ended=time.time())


def _start_joiners(plan: Any, nproc: int) -> list[subprocess.Popen]:
    """Starts this node's ``nproc`` joiners (each in its own session, logs appended)."""
    procs = []
    for lr in range(nproc):
        env = joiner_env(dict(os.environ), plan.rdzv_endpoint, local_rank=lr, nproc=nproc,
                         node_rank=plan.node_rank)
        out = open(plan.log_dir / f"spare-node{plan.node_rank}-local{lr}.log", "ab")   # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, *plan.argv], env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    log.info("in-process hot spare: %d joiner(s) started (pids %s); they wait for a lost node",
             nproc, ", ".join(str(p.pid) for p in procs))
    return procs


class _HostWatch(threading.Thread):
    """Calls ``on_lost(silent_s)`` once the store has not answered :data:`host_store.STORE_LOST_S`
    (the spare's loop sets ``answered_at`` after each answer) and a probe of its own confirms it."""

    def __init__(self, endpoint: str, on_lost: Callable[[float], None]) -> None:
        super().__init__(name="hpc-spare-store-watch", daemon=True)
        self.endpoint, self.on_lost = endpoint, on_lost
        self.answered_at = time.monotonic()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(1.0):
            silent = time.monotonic() - self.answered_at
            if silent < host_store.STORE_LOST_S:
                continue
            if host_store.answers(self.endpoint):
                self.answered_at = time.monotonic()   # slow, not silent
            elif not self._stop_event.is_set():
                self.on_lost(silent)
                return

    def stop(self) -> None:
        self._stop_event.set()


def _host_lost(plan: Any, events: Any, procs: list[subprocess.Popen], silent: float,
               relaunch: Callable[[], None]) -> None:
    """The host's store is silent: stops the joiners, then this launcher (``relaunch``)."""
    host = plan.rdzv_endpoint.rpartition(":")[0]
    why = (f"the rendezvous store has not answered for {silent:.0f}s: its host {host} is lost; "
           f"this hot spare's joiners waited in it and are stopped")
    log.warning("in-process hot spare: %s", why)
    if events is not None:
        events.emit("inproc_fallback", reason=why, spare=True)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)   # its own session (start_new_session)
        except ProcessLookupError:
            pass
    for p in procs:   # reaped before the exec: no zombie left under the new image
        try:
            p.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            pass
    relaunch()


def _to_restart_path(events: Any, procs: list[subprocess.Popen], gave_up: str) -> None:
    """The members gave up in-process recovery: ends the joiners (nobody takes them in now)."""
    why = (f"the members left in-process recovery for torch's restart path ({gave_up[:300]}): this "
           "hot spare's joiners are ended and the node joins torch's rendezvous")
    log.warning("in-process hot spare: %s", why)
    if events is not None:
        events.emit("inproc_fallback", reason=why, spare=True)
    inprocess_agent.end_processes(procs)


def _fallback(store: Any) -> str | None:
    """Why the members gave up in-process recovery (``fallback``), or None."""
    try:
        if store is not None and store.check([proto.FALLBACK]):
            return store.get(proto.FALLBACK).decode(errors="replace")
    except Exception as e:   # noqa: BLE001 - the store is gone: the host watch decides
        log.debug("in-process hot spare: store: %s", e)
    return None


def _waiting(store: Any, uids: set[str]) -> int:
    """How many of ``uids`` have written their join record (they wait to be taken in)."""
    count = store.add(proto.JOIN_COUNT, 0)
    keys = [proto.join(i) for i in range(count)]
    present = [k for k in keys if store.check([k])]
    found = {proto.decode_arrival(v).uid for v in store.multi_get(present)} if present else set()
    return len(uids & found)


def _taken_in(store: Any, uids: set[str]) -> bool:
    if not store.check([proto.GENERATION]):
        return False
    gen = int(store.get(proto.GENERATION))
    if not store.check([proto.members(gen)]):
        return False
    return bool(uids & set(proto.decode_members(store.get(proto.members(gen))).uids))
