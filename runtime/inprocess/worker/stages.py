"""The in-process recovery, stage by stage: abort, re-form, new group, state transfer, re-wrap.

A Session in in-process mode (``HPC_RECOVERY=inprocess`` and a store in ``HPC_INPROC_STORE``)
holds one :class:`InProcess`. Its process group lives under a generation's prefix in the store
that outlives the workers; after a failed step (:mod:`runtime.inprocess.worker.guard`) or a failed
collective at a step boundary the Session calls :meth:`InProcess.recover`, which runs:

1. **abort**: announce the fault in the store, abort the old generation's NCCL communicators
   (CUDA: :mod:`runtime.inprocess.worker.nccl`), unregister every process group of the old
   generation (kept referenced, never destroyed) and break its gloo groups' connections
   (:mod:`runtime.inprocess.worker.sockets`): its operation still in flight, if any, ends now
   instead of at its bound or at a peer's exit, and peers still waiting on this rank in the
   old group fail at once;
2. **re-form**: arrive at the next generation and learn its members, ranks and the step to go
   on from (:mod:`runtime.inprocess.worker.membership`);
3. **group**: a new group of the new world under the generation's prefix (gloo; or NCCL bound
   to the rank's device, with a gloo side group for the control traffic and the transfer);
4. **transfer**: the member holding that step broadcasts model, optimizers, the registered
   small state and its RNG (:mod:`runtime.inprocess.worker.transfer`); no file is read;
5. **re-wrap**: each DDP model is rebuilt around the same module on the new group (same
   parameters, so the user's optimizer and references stay valid), with the guard's hook.

FSDP2 models (``s.wrap(model, fsdp=True)``, no mesh of their own) hold no replica anywhere:
each rank's shards are also kept in a rank's host memory on another node
(:mod:`runtime.inprocess.worker.shard_copy`), the re-form keeps every member's rank (joiners
fill the lost ranks), stage 4 becomes an agreement on the newest step every shard still has
(:mod:`runtime.inprocess.worker.peers`) with the lost ranks' shards sent by the holders of
their copies and survivors ahead of that step rolled back to their own snapshot, and stage 5
re-binds FSDP2 to the new group (:mod:`runtime.inprocess.worker.fsdp_guard`). A sharded world
that cannot keep its size, or a shard with no copy left (a rank and its copy's holder both
lost), raises :class:`~runtime.inprocess.worker.peers.ShardedFallback`: the disk checkpoint (the
restart path) is taken (:mod:`runtime.inprocess.worker.shard_transfer`).

A second fault during the recovery itself (a member of the new generation dies while its
group forms, while the models are re-wrapped, or during the state transfer; cascading faults,
a node's switch neighbour going seconds later) leads to another re-form without it, in the
same call (:meth:`InProcess.recover`). Each rank then says which step it still holds whole
(:func:`~runtime.inprocess.rules.held_after`): its own when the transfer had not touched it (a
receiver receives into buffers of its own), the agreed one when it had loaded it whole, none
when it had begun to load it (never a source; with no step held whole anywhere, the disk
checkpoint: :func:`~runtime.inprocess.rules.unsourced`). An FSDP2 recovery, whose shards may be
half moved, takes the disk checkpoint with the second fault as its reason.

A failure that repeats (a bad batch, a rank that fails the same step every time) would loop
through re-forms for ever: each generation counts how many generations in a row went on from
its step (``Members.in_row``, one agreement for every member), and past ``max_reforms``
(``HPC_INPROC_MAX_REFORMS``, default 3) the members give up in-process recovery as a sharded
world without a copy does (:func:`~runtime.inprocess.worker.shard_transfer.give_up`): the
launchers replace nobody and torch's restart path, bounded by ``--max-restarts``, goes on from
the last checkpoint. A step completed in between resets the count.

Each stage's end time is returned for ``events.jsonl`` (:class:`Recovered`).

The same stages admit a joiner (a worker its launcher restarted, a hot spare's): the members
open the next generation (at a fault's re-form, or at a step boundary when rank 0's fault watch
saw a joiner wait: :meth:`InProcess.grow`), and the joiner, in its Session's start, waits to be
listed (:meth:`InProcess.join_group`), forms the group, builds its model and receives the
state in its ``restore`` (:meth:`InProcess.receive`). The members' group-forming collectives
(the preemption agreement's group, DDP's bucket layout, the checkpointer's groups) run in the
order the joiner's start, ``wrap`` and ``restore`` run them, then the transfer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from pathlib import Path
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpc.contract import recovery_settings
from runtime.inprocess import rules
from runtime.inprocess import protocol as proto
from hpc.contract import jobsecret
from hpc.contract.jobpaths import JobPaths
from runtime.inprocess.protocol import Members
from runtime.worker import rng
from runtime.events import EventLog
from hpc.contract.environment import JobEnvironment
from runtime.inprocess.worker import (fsdp_guard, lifeline, nccl, peers, rebind, shard_copy, shard_transfer,
                                      sockets, transfer)
from runtime.inprocess.worker.guard import FaultWatch, StepGuard
from runtime.inprocess.worker.membership import Excluded, Membership, joiners_waiting
from runtime.inprocess.worker.peers import ShardedFallback

log = logging.getLogger("hpc.inprocess")
_OLD_GROUPS: list[Any] = []   # every generation's groups, kept alive (see InProcess._abort)
DRAIN_S = 10.0   # how long the Session's end waits for abandoned operations to finish
# A rank still forming its generation's groups this long after that generation's fault was
# announced is stuck in gloo's connect to a member that died after giving its address (gloo
# retries a refused connection for the group's timeout; nothing here can interrupt it): it
# leaves, and its launcher replaces it.
FORMING_GRACE_S = 5.0


def _job_key(environ: Mapping[str, str]) -> bytes | None:
    """The job's key (:mod:`hpc.contract.jobsecret`, made by the launcher), or None: then this
    worker opens no lifeline (a lost node is waited for by the join window, as without one)."""
    job_dir = JobEnvironment.from_env(environ).job_dir
    if not job_dir:
        return None
    try:
        return jobsecret.load(JobPaths(job_dir).secret)
    except (OSError, jobsecret.JobSecretError) as e:
        log.warning("in-process recovery: no lifeline for this worker: %s", e)
        return None


def connect(address: str, timeout_s: float = 60.0) -> Any:
    """A client of the store at ``host:port`` (the launcher's, or a test's)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{recovery_settings.STORE_ENV}={address!r}: expected host:port, e.g. node1:29400")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


@dataclass
class Recovered:
    """One recovery: the new generation and when each stage ended (wall times)."""

    members: Members
    rank: int
    reason: str
    t_detect: float
    t_abort: float = 0.0
    t_reform: float = 0.0
    t_group: float = 0.0
    t_transfer: float = 0.0
    bytes_moved: int = 0
    received: bool = False
    nccl_aborted: int = 0     # NCCL backends of the old generation aborted at the recovery
    stages: dict[str, float] = field(default_factory=dict)
    retries: list[dict[str, Any]] = field(default_factory=list)   # failed tries (a second fault)
    shards: dict[int, tuple[int, str]] = field(default_factory=dict)   # FSDP2: shard -> (rank, from)


class InProcess:
    """The in-process recovery of one worker.

    Args:
        store: The store that outlives the workers.
        rank: This worker's starting rank.
        world_size: The starting world size.
        timeout: The process groups' timeout (a backstop; training all-reduces are bounded
            by the guard).
        step_bound_s: ``() -> seconds``: the bound of one training all-reduce now.
        window_s: How long a re-form waits for silent members.
        backend: The training group's backend, ``gloo`` or ``nccl`` (:func:`nccl.plan`).
        device: This rank's CUDA device (NCCL: the groups are bound to it).
        plan: The plan, when not ``backend``'s own (:func:`nccl.plan_for`: tests).
    """

    def __init__(self, store: Any, *, rank: int, world_size: int, timeout: timedelta,
                 step_bound_s: Callable[[], float], window_s: float = recovery_settings.DEFAULT_WINDOW_S,
                 reconnect: Callable[[], Any] | None = None, joining: bool = False,
                 max_world: int = 0, max_reforms: int = recovery_settings.DEFAULT_MAX_REFORMS,
                 backend: str = "gloo", device: Any = None, plan: nccl.Plan | None = None) -> None:
        self.plan = plan or nccl.plan(backend)
        self.device = device
        self.side: Any = None   # NCCL: the generation's gloo group (control traffic, state transfer)
        self.store = store
        self.reconnect = reconnect
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout
        self.joining = joining            # this process joins a running generation
        self.max_reforms = max_reforms    # re-forms in a row at one step before the restart path
        self.host = socket.gethostname()
        self.me = proto.uid(self.host, os.getpid())
        self.membership = Membership(store, self.me, host=self.host, window_s=window_s,
                                     max_world=max_world or (0 if joining else world_size))
        self.joined: Members | None = None      # the generation this joiner was taken into
        self.session_state: Callable[[], dict[str, Any]] | None = None   # the source sends it
        self.received_session: dict[str, Any] = {}
        self.guard = StepGuard({}, timeout_s=step_bound_s, rank=rank)
        self.guard.uid = self.me
        if not self.plan.op_timeout:   # NCCL: the all-reduces' bound is a thread's, not a timeout
            self.guard.bound = nccl.Bound(self._overdue)
        self.models: list[Any] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.small: dict[str, Any] = {}
        self.copies: shard_copy.PeerCopies | None = None   # FSDP2: the peer copies of the shards
        self._plan: peers.Plan | None = None                # FSDP2: the last recovery's agreement
        self._events: Any = None
        self._watch: FaultWatch | None = None
        self._before = sockets.eventpolls()  # epolls older than this job's groups: never broken
        self._breaking = threading.Lock()    # a fault watch's break against a recovery's new groups
        self._line: Any = None               # this worker's lifeline (runtime.inprocess.worker.lifeline)
        self.key: bytes | None = None        # the job's key: signs the lifeline's hello
        self._epochs: rebind.EpochWatch | None = None   # a new epoch's store after the host's loss
        self._forming: tuple[int, list[int]] = (-1, [])   # a generation's own store connection (its fds)
        self._forming_gen = -1                 # the generation whose groups this rank is making
        self._broken_gen = -1                  # the last generation whose fault was announced here
        self._stage = ""                       # the recovery's stage running (group, re-wrap, transfer)
        self._phase = proto.UNTOUCHED          # how far a transfer overwrote this rank's state

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, rank: int, world_size: int,
                 timeout: timedelta, step_bound_s: Callable[[], float], backend: str = "gloo",
                 device: Any = None) -> InProcess | None:
        """The recovery this worker was started for, or None (the restart path). On NCCL
        it sets the variables the NCCL path needs in this process (:func:`nccl.apply_env`),
        before any group is made."""
        env = recovery_settings.InProcessEnvironment.from_env(environ)
        if not env.inprocess:
            return None
        plan = nccl.plan_for(backend, environ)
        if plan.backend == "nccl":
            nccl.apply_env(os.environ)
        address = env.store or ""
        if not address:
            raise RuntimeError(f"{recovery_settings.RECOVERY_ENV}=inprocess needs {recovery_settings.STORE_ENV}=host:port "
                               "(the launcher sets it); set it or use --recovery restart")
        fixed = env.timeout_s
        bound = (lambda: fixed) if fixed is not None else step_bound_s
        raw = connect(address)
        if environ.get("MASTER_PORT"):
            space = proto.namespace(environ.get("MASTER_ADDR", ""), environ["MASTER_PORT"])
        else:   # a hot spare's joiner: the running round's, published by its rank 0
            raw.wait([proto.ROOT + proto.CURRENT], timedelta(days=30))
            space = raw.get(proto.ROOT + proto.CURRENT).decode()

        def store() -> Any:
            return dist.PrefixStore(space, connect(address))
        made = cls(dist.PrefixStore(space, raw), rank=rank, world_size=world_size, timeout=timeout,
                   step_bound_s=bound, window_s=env.window_s, reconnect=store, joining=bool(env.join),
                   max_world=env.max_world or 0, max_reforms=env.max_reforms, backend=backend, device=device, plan=plan)
        made.space, made.raw, made.address = space, raw, address
        made.key = _job_key(environ)
        channel = env.channel or ""
        if channel:   # the launcher keeps this worker through the rendezvous host's loss
            made._epochs = rebind.EpochWatch(Path(channel), JobEnvironment.from_env(environ).rdzv_epoch or 0,
                                             address=lambda: made.address, on_new=made._break_all)
            made._epochs.start()
        return made

    @property
    def gen(self) -> int:
        return self.membership.gen

    @property
    def cpu_group(self) -> Any:
        """The generation's group for CPU tensors: the training group on gloo, its gloo side
        group on NCCL."""
        return self.side if self.side is not None else dist.group.WORLD

    # -- start -----------------------------------------------------------------------------
    def init_group(self) -> None:
        """The starting generation's process group, on the store (not on rank 0's own store,
        which would die with rank 0)."""
        self._init_pg(0, self.rank, self.world_size)
        self._start_bound()
        self.membership.start(self.rank, self.world_size)
        if self.rank == 0 and getattr(self, "raw", None) is not None:   # where a spare's joiners look
            self.raw.set(proto.ROOT + proto.CURRENT, self.space)
        self._open_line()
        self._watch_faults()

    def join_group(self, timeout_s: float) -> Members | None:
        """A joiner: waits until a generation takes it in and forms its group; None when the
        job finished first. ``self.rank``/``self.world_size`` are then the new ones; the state
        comes in :meth:`receive`."""
        members = self.membership.join(timeout_s=timeout_s)
        if members is None:
            return None
        self._give_up_if_repeating(members)
        rank = members.rank_of(self.me)
        assert rank is not None
        self.rank, self.world_size, self.guard.rank = rank, members.world_size, rank
        self.guard.reset(members.gen)
        self._forming_gen = members.gen   # until receive(): the Session's groups and DDP's too
        self._watch_faults()   # (before the group forms: a member lost meanwhile ends its wait)
        self._init_pg(members.gen, rank, members.world_size)
        self._start_bound()
        self._open_line()
        self.joined = members
        return members

    def receive(self) -> tuple[int, int]:
        """A joiner, after its model, optimizers and small state are attached: receives the
        source's state (no file is read). Returns (the step to go on from, bytes moved)."""
        assert self.joined is not None, "receive() is for a joiner, after join_group()"
        self._forming_gen = -1
        if self.copies is not None:
            step, moved = self._transfer_shards(self.joined, held=None)
            self.joining = False
            return step, moved
        moved = self._transfer(self.joined, held=-1)
        self.joining = False
        return self.joined.step, moved
    def _open_line(self) -> None:
        """A member now: its death is announced by its lifeline's closing (a lost node at once)."""
        if self._line is None and getattr(self, "raw", None) is not None and self.key is not None:
            self._line = lifeline.open_line(self.raw, self.address, me=self.me, space=self.space,
                                            key=self.key)

    def _watch_faults(self) -> None:
        """Starts the fault watch of the current generation (the previous one is stopped)."""
        if self._watch is not None:
            self._watch.stop()
        self.guard.gen = self.gen
        if self.reconnect is not None:
            membership = self.membership
            joins = (lambda store: joiners_waiting(store, len(membership.uids), membership.max_world)) \
                if self.rank == 0 else None
            self._watch = FaultWatch(self.reconnect, self.gen, self.guard, joins=joins,
                                     on_fault=self._break_generation)
            self._watch.start()

    def _break_generation(self, gen: int) -> None:
        """A fault of generation ``gen`` was announced (the fault watch's thread): breaks the
        connections of every group of that generation, so this rank's wait in any of them
        (a save's gather, a step-boundary agreement, a silent peer's all-reduce) ends now with
        an error that leads to the re-form, instead of at the group's timeout."""
        with self._breaking:
            if self.guard.gen != gen:   # the recovery has begun: its new groups are not to break
                return
            self._broken_gen = gen   # (a store connection for its groups made after this is refused)
            aborted = nccl.abort_all() if self.plan.abort_nccl else 0
            n = sockets.break_connections(sockets.devices(self._before))
            if self._forming[0] == gen:   # its store waits (a group forming without a lost member)
                n += sockets.shutdown(self._forming[1])
            if self._forming_gen == gen:   # a connect to the lost member is out of reach: bounded
                threading.Timer(FORMING_GRACE_S, self._leave_if_forming, args=(gen, time.time())).start()
        log.info("in-process recovery: fault of generation %d announced: %d NCCL backend(s) "
                 "aborted, %d connection(s) of its gloo groups shut down", gen, aborted, n)

    def _leave_if_forming(self, gen: int, announced: float) -> None:
        """The bound of :data:`FORMING_GRACE_S` (a timer's thread): a rank still making the
        failed generation ``gen``'s groups ends its process (exit 1); its launcher announces
        it and, under ``--replacement wait``, starts a joiner. Its peers re-form without it."""
        if self._forming_gen != gen:
            return
        log.error("in-process recovery: generation %d failed %.0f s ago and this rank is still "
                  "forming its groups (gloo connecting to a member that died after giving its "
                  "address, until the group's timeout): leaving, so that its launcher replaces it",
                  gen, time.time() - announced)
        logging.shutdown()
        os._exit(1)

    def _overdue(self, gen: int, bound_s: float) -> None:
        """NCCL (the bound's thread): an all-reduce of generation ``gen`` ran past its bound
        (a silent peer): the step fails and the generation's communicators are aborted, so
        this rank's wait on that all-reduce ends now and the re-form follows."""
        self.guard.fail(f"all-reduce did not finish within its bound ({bound_s:.1f}s): a silent peer",
                        gen=gen)
        self._break_generation(gen)

    def _start_bound(self) -> None:
        bound = self.guard.bound
        if bound is not None and not bound.is_alive() and not bound.stopped.is_set():
            bound.start()

    def _init_pg(self, gen: int, rank: int, world_size: int) -> None:
        """The generation's process group (and, on NCCL, its gloo side group, made here so a
        joiner makes it in the same order), on the generation's own store connection."""
        prefixed = dist.PrefixStore(proto.pg_prefix(gen), self._generation_store(gen))
        # torch names the group by a count it raises before it forms the group, and sets back to
        # 0 only when a formed group is destroyed: after a try whose group never formed (a member
        # lost meanwhile) this rank would name the next one differently from its peers and a
        # fresh joiner, and they would wait for each other under different names for ever.
        dist.distributed_c10d._world.group_count = 0
        if self.plan.device_bound:
            dist.init_process_group(self.plan.backend, store=prefixed, rank=rank, world_size=world_size,
                                    timeout=self.timeout, device_id=self.device)
        else:
            dist.init_process_group(self.plan.backend, store=prefixed, rank=rank, world_size=world_size,
                                    timeout=self.timeout)
        if self.plan.side_group:
            self.side = dist.new_group(backend="gloo", timeout=self.timeout)

    def _generation_store(self, gen: int) -> Any:
        """A store connection for generation ``gen``'s groups alone (this one and every group
        made after it: torch makes them on the default group's store).

        A group forms in the store: each rank waits there, for the group's timeout, until every
        other rank has written its address. A member that dies after the generation closed
        never writes it, and the others would wait the whole timeout (a second fault right
        after a re-form). Shutting this connection down when the generation's fault is
        announced (:meth:`_break_generation`) ends those waits at once; the next re-form makes
        a new one. A test's store without an address is shared (nothing to break)."""
        address, space = getattr(self, "address", None), getattr(self, "space", None)
        if not address or space is None:
            return self.store
        before = sockets.tcp_sockets()
        raw = connect(address)
        _OLD_GROUPS.append([raw])   # kept for the generation's groups, never destroyed
        with self._breaking:
            self._forming = (gen, sorted(sockets.tcp_sockets() - before))
            if self._broken_gen == gen:
                # Its fault was announced before this connection existed (a member died just
                # as this rank left the re-form): nothing would end the wait for that member's
                # address but the group's timeout.
                raise RuntimeError(f"generation {gen} failed before its groups formed (its fault "
                                   "was announced)")
        return dist.PrefixStore(space, raw)

    def attach(self, state: Mapping[str, Any]) -> None:
        """Takes the registered state: DDP models get the guard's hook, optimizers its wrap,
        the rest is the small state the guard copies at each step."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.models, self.optimizers, self.small = [], [], {}
        sharded: list[torch.nn.Module] = []
        for name, obj in state.items():
            if isinstance(obj, DDP):
                self.models.append(obj)
                obj.register_comm_hook(None, self.guard.comm_hook)
            elif isinstance(obj, torch.nn.Module):
                if _sharded(obj):
                    fsdp_guard.install(obj, self.guard)
                    sharded.append(obj)
                self.models.append(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                self.optimizers.append(obj)
                self.guard.guard_optimizer(obj)
            else:
                self.small[name] = obj
        self.guard.small_state = dict(self.small)
        if sharded:
            every, max_bytes = shard_copy.options(os.environ)
            self.copies = shard_copy.PeerCopies(sharded, self.optimizers, self.small, every=every,
                                                max_bytes=max_bytes, node=shard_copy.node_key(os.environ),
                                                timeout_s=self.timeout.total_seconds())
            self.store.set(proto.SHARDED, "1")   # re-forms keep ranks (rank r owns shard r)

    def after_step(self, step: int, step_s: float | None = None) -> None:
        """The step boundary after ``step`` steps (every rank): the FSDP2 peer copy when due."""
        if self.copies is not None:
            self.copies.after_step(step, step_s)

    # -- recovery --------------------------------------------------------------------------
    def recover(self, step: int, why: str, *, dirty: bool,
                groups: list[Any] = (),   # type: ignore[assignment]
                regroup: Callable[[], None] | None = None, planned: bool = False,
                release: Callable[[], list[Any]] | None = None) -> Recovered:
        """Leaves the failed generation and goes on in a new one (see the module docstring).

        A fault during the recovery's own collectives (a member of the new generation dies
        while the group forms, while the models are re-wrapped, or during the state transfer)
        leads to another re-form without it (:meth:`_retry`), bounded by ``max_reforms`` like
        any repeated re-form at one step. What this rank then says it holds follows
        :func:`~runtime.inprocess.rules.held_after`: a rank that had begun to load the
        received state holds no step whole and is never the source.

        Args:
            step: The step this rank holds whole (the failed step's start when ``dirty``).
            why: What failed.
            dirty: The step failed part way: put the small state back first.
            groups: Extra groups of the old generation to drop (the Session's own).
            regroup: Forms the new generation's other groups and re-wraps the models, in the
                order a joiner's Session forms them (default: :meth:`rewrap`).
            planned: Nothing failed (joiners are taken in): no fault is announced.
            release: ``() -> groups``: the Session's own groups of a generation whose
                recovery failed (dropped, kept referenced, at the next re-form).

        Returns:
            The recovery's record; ``self.rank``/``self.world_size`` are the new ones.

        Raises:
            ShardedFallback: In-process recovery gives up (the restart path): a failure that
                repeats, no member holds the state whole, or an FSDP2 recovery failed part way.
        """
        rec = Recovered(members=None, rank=-1, reason=why, t_detect=time.time())  # type: ignore[arg-type]
        if dirty:
            self.guard.rollback()
        old_world = self.world_size
        with self._breaking:
            if self._watch is not None:
                self._watch.stop()
            self.guard.gen = -1   # nothing said about the failed generation counts any more
        if not planned:
            self.membership.announce_fault(why)
        rec.nccl_aborted = self._abort(list(groups))
        rec.t_abort = time.time()
        held, reason = step, why
        while True:
            members = self._reform(held, self.rank, reason)
            rec.t_reform = time.time()
            self._give_up_if_repeating(members)
            self._phase, self._stage = proto.UNTOUCHED, "group"
            try:
                self._attempt(rec, members, held=held, old_world=old_world, regroup=regroup)
                break
            except (Excluded, ShardedFallback):
                raise
            except Exception as e:   # noqa: BLE001 - a member of the new generation failed: re-form again
                held, reason = self._retry(rec, members, e, held=held, stage=self._stage,
                                           groups=release() if release is not None else [])
        rec.t_transfer = time.time()
        rec.rank = self.rank
        return rec

    def _attempt(self, rec: Recovered, members: Members, *, held: int, old_world: int,
                 regroup: Callable[[], None] | None) -> None:
        """Stages 3-5 in the closed generation ``members`` (``self._stage`` names the stage
        running and ``self._phase`` how far this rank's state was overwritten, for
        :meth:`_retry`). Fills ``rec``."""
        rank = members.rank_of(self.me)
        assert rank is not None
        self.rank, self.world_size = rank, members.world_size
        self.guard.rank = rank
        self._stage = "group"
        self.guard.reset(members.gen)
        self._forming_gen = members.gen
        self._watch_faults()   # (before the group forms: a member lost meanwhile ends its wait)
        self.guard.inject_in_group(members.gen)
        self._init_pg(members.gen, rank, members.world_size)
        self._open_line()   # (after a move to a new epoch's store: to its host)
        self._stage = "re-wrap"
        (regroup or self.rewrap)()
        rec.t_group = time.time()
        self._forming_gen = -1
        self._stage = "transfer"
        if self.copies is not None:
            if members.world_size != old_world:
                raise shard_transfer.give_up(
                    self.store, f"the FSDP2 model's world would change from {old_world} to {members.world_size} "
                    "ranks (no replacement joined); in-process recovery carries sharded state only "
                    "at the same world size: the restart path from the last checkpoint")
            s_step, rec.bytes_moved = self._transfer_shards(members, held=held)
            rec.shards = dict(self._plan.sources) if self._plan is not None else {}
            members = dataclasses.replace(members, step=s_step)
            rec.received = rec.bytes_moved > 0
        else:
            rec.received = rank != members.source
            rec.bytes_moved = self._transfer(members, held=held)
        rec.members = members

    def _retry(self, rec: Recovered, members: Members, error: BaseException, *, held: int, stage: str,
               groups: list[Any]) -> tuple[int, str]:
        """The recovery into ``members`` failed in ``stage`` (a member died, or its node was
        lost): announces the fault of that generation (its other members' waits end now),
        drops its groups and returns (the step this rank still holds whole, the reason) for
        the next re-form. An FSDP2 recovery gives up instead: the disk checkpoint.

        Raises:
            ShardedFallback: The model is sharded (its shards may be half moved).
        """
        self._forming_gen = -1   # (it left the forming by itself)
        why = (f"a second fault during the recovery into generation {members.gen} ({stage}): "
               f"{_first_line(error)}")
        now = rules.held_after(held, members.step, self._phase)
        log.warning("in-process recovery: %s; this rank held step %d, now holds %s; re-forming again",
                    why, held, now if now >= 0 else "no step whole (its state was half loaded)")
        with self._breaking:
            if self._watch is not None:
                self._watch.stop()
            self.guard.gen = -1
        self.membership.announce_fault(why)
        rec.nccl_aborted += self._abort(list(groups))
        rec.retries.append({"gen": members.gen, "stage": stage, "reason": why[:300],
                            "held": held, "holds": now})
        if self.copies is not None:
            raise shard_transfer.give_up(
                self.store, f"{why}; the FSDP2 shards may be half moved, so the state is not taken "
                "from memory: the restart path from the last checkpoint")
        return now, why

    def _reform(self, step: int, old_rank: int, why: str) -> Members:
        """The re-form (:meth:`Membership.reform`), in a new rendezvous epoch's store when the
        launcher named one (the old store's host is lost, :mod:`runtime.inprocess.worker.rebind`):
        at once when it is already named, else after a failed store request, waited for."""
        while True:
            if self._epochs is not None and self._epochs.pending():
                self._rebind(self._epochs.take())
            try:
                return self.membership.reform(step, old_rank, reason=why)
            except Excluded:
                raise
            except Exception as e:   # noqa: BLE001 - the store is gone: a new epoch's, or this error
                self._rebind(rebind.wait_for(self._epochs, e))

    def _rebind(self, rec: proto.Rebind | None) -> None:
        """Moves to the new epoch's store: it has no history, so the members of the last
        generation on lost nodes are marked dead there (the leader does not wait for them)."""
        if rec is None:
            return
        address, space = rec.store, rec.space
        self.raw = connect(address)
        self.store = dist.PrefixStore(space, self.raw)
        self.membership.store = self.store
        self.address, self.space = address, space
        self.reconnect = lambda: dist.PrefixStore(space, connect(address))
        lost = rules.lost_uids(self.membership.uids, rec.members)
        for u in lost:
            self.store.set(proto.dead(u), f"lost with its node: not in rendezvous epoch {rec.epoch}")
        if self.copies is not None:
            self.store.set(proto.SHARDED, "1")
        if self._line is not None:   # its listener died with the old host: a new line after the re-form
            try:
                self._line.close()
            except OSError:
                pass
            self._line = None
        JobEnvironment(rdzv_epoch=rec.epoch).export(os.environ)   # the checkpointer's fence: this epoch's group
        log.warning("in-process recovery: re-forming in rendezvous epoch %d's store %s (%s); lost "
                    "with their nodes: %s", rec.epoch, address, space, ", ".join(lost) or "none")

    def _break_all(self) -> None:
        """The old store is lost: every group's connections are broken (a step or a save
        waiting on a lost peer ends now and leads to the re-form)."""
        with self._breaking:
            aborted = nccl.abort_all() if self.plan.abort_nccl else 0
            n = sockets.break_connections(sockets.devices(self._before))
        log.info("in-process recovery: the rendezvous host is lost: %d NCCL backend(s) aborted, "
                 "%d connection(s) of its gloo groups shut down", aborted, n)

    def _give_up_if_repeating(self, members: Members) -> None:
        """Every member of ``members`` alike (the count is in the agreed record): past
        ``max_reforms`` re-forms in a row at one step, gives up in-process recovery.

        Raises:
            ShardedFallback: The failure repeats (names the count, the step and the error), or
                no member holds the state whole (:func:`~runtime.inprocess.rules.unsourced`).
        """
        why = rules.repeats(members, self.max_reforms)
        if why is not None:
            raise shard_transfer.give_up(self.store, why)

    def _abort(self, extra: list[Any]) -> int:
        """Aborts the old generation's NCCL communicators (NCCL: :func:`nccl.abort_all`),
        unregisters every group of it, keeps them, and breaks the connections of its gloo
        groups (:func:`runtime.inprocess.worker.sockets.devices`). Returns how many NCCL
        backends were aborted.

        Gloo cannot be aborted (pytorch#130345; its ``abort()`` returns without ending an
        operation). The old groups stay referenced here (never destroyed: a destructor waits
        for operations in flight). The training group's connections are shut down, so its
        operation in flight (the released all-reduce) ends now, with its Python callback, and
        not on gloo's thread during the interpreter's exit, which ended the process
        (:mod:`runtime.inprocess.worker.sockets`). The cost is a few threads per recovery.
        """
        old: list[Any] = list(extra)
        aborted = nccl.abort_all() if self.plan.abort_nccl else 0   # before any group is unregistered
        if self.side is not None:
            old.append(self.side)
            self.side = None
        if self.copies is not None:
            old.append(self.copies.unbind())
        for m in self.models:
            for attr in ("reducer", "logger", "process_group"):
                if attr in m.__dict__:
                    old.append(m.__dict__.pop(attr))
        if dist.is_initialized():
            old.append(dist.group.WORLD)
            try:
                dist.destroy_process_group()
            except Exception as e:   # noqa: BLE001 - a broken group may fail its own shutdown
                log.warning("unregistering the old process group: %s", e)
        _OLD_GROUPS.append(old)
        broken = sockets.break_connections(sockets.devices(self._before))
        broken += sockets.shutdown(self._forming[1])   # its store waits too
        self._forming = (-1, [])
        log.info("in-process recovery: the old generation's %d NCCL backend(s) aborted, %d gloo "
                 "connection(s) shut down", aborted, broken)
        return aborted

    def _transfer(self, members: Members, *, held: int) -> int:
        """Every member loads the source's state (the source sends)."""
        state = None
        if self.rank == members.source:
            state = {
                "models": [_module(m).state_dict() for m in self.models],
                "optims": [o.state_dict() for o in self.optimizers],
                "small": {k: v.state_dict() for k, v in self.small.items()},
                "rng": rng.capture(),
                "step": members.step,
                "session": self.session_state() if self.session_state is not None else {},
            }
        received, moved = transfer.broadcast_state(state, src=members.source, rank=self.rank,
                                                   group=self.side,
                                                   between=lambda: self.guard.inject_in_transfer(members.gen))
        if self.rank != members.source:
            self._phase = proto.LOADING   # from here until loaded, this rank holds no step whole
            for m, sd in zip(self.models, received["models"]):
                _module(m).load_state_dict(sd)
            for o, sd in zip(self.optimizers, received["optims"]):
                o.load_state_dict(sd)
            for k, sd in received["small"].items():
                if k in self.small:
                    self.small[k].load_state_dict(sd)
            if held != members.step:   # behind: the source's random streams go on
                rng.restore(received["rng"])
            self.received_session = dict(received.get("session") or {})
            self._phase = proto.LOADED
        return moved

    def _transfer_shards(self, members: Members, *, held: int | None) -> tuple[int, int]:
        """FSDP2's stage 4 (:mod:`runtime.inprocess.worker.shard_transfer`), then the source's
        session state to a joiner. Returns (the agreed step, bytes moved)."""
        assert self.copies is not None
        self._plan, moved = shard_transfer.recover_shards(
            self.copies, self.store, rank=self.rank, world=self.world_size, held=held,
            between=lambda: self.guard.inject_in_transfer(members.gen))
        box = [self.session_state() if self.session_state is not None and self.rank == members.source
               else None]
        dist.broadcast_object_list(box, src=members.source)
        if self.joining:
            self.received_session = dict(box[0] or {})
        return self._plan.step, moved

    def rewrap(self) -> None:
        """Rebuilds each DDP wrapper in place on the new default group, with the guard's hook."""
        from runtime.worker import ddp as ddp_build

        for m in self.models:
            if _sharded(_module(m)):
                fsdp_guard.rebind(m)
                continue
            rebuild = getattr(m, "rebuild", None)
            if rebuild is not None:
                rebuild()
                m.register_comm_hook(None, self.guard.comm_hook)
                ddp_build.fix_bucket_layout(m)


    def close(self, finished: bool = False) -> None:
        """Stops the fault watch and waits for the old generations' operations to finish
        (the Session's end: none may finish during the interpreter's exit); rank 0 of a
        finished job tells waiting joiners (hot spares) that they are not needed."""
        if self._watch is not None:
            self._watch.stop(join=True)
        if self.guard.bound is not None:
            self.guard.bound.stop()
        if self._epochs is not None:
            self._epochs.stop()
        lifeline.close_line(self._line)   # ends on purpose: not a death
        self._line = None
        if self.copies is not None:   # a peer copy in flight must not end during the exit
            self.copies.settle(timeout_s=DRAIN_S)
        left = self.guard.drain(DRAIN_S, before_gen=self.gen)
        if left:
            log.warning("in-process recovery: %d all-reduce(s) of an old generation still running "
                        "after %.0fs; gloo may end this process at exit", left, DRAIN_S)
        if finished and self.rank == 0:
            try:
                self.store.set(proto.DONE, "1")
            except Exception as e:   # noqa: BLE001 - the store may be gone at the very end
                log.warning("cannot tell waiting joiners that the job finished: %s", e)

    def record(self, job_dir: Any, allocation: int, rec: Recovered, *, old_rank: int,
               old_world: int, held: int, dirty: bool) -> None:
        """The new rank 0 records the recovery's phases in ``events.jsonl`` (``inproc_recovery``)."""
        if rec.rank != 0:
            return
        if self._events is None:
            self._events = EventLog(job_dir, allocation=allocation, rank=0, sync_every_s=0)
        m = rec.members
        self._events.emit(
            "inproc_recovery", t=rec.t_transfer, gen=m.gen, reason=rec.reason[:300],
            world_size=m.world_size, old_world_size=old_world, old_rank=old_rank, step=m.step,
            held=held, dirty=dirty, source=m.source, left=list(m.left), t_detect=round(rec.t_detect, 4),
            t_abort=round(rec.t_abort, 4), t_reform=round(rec.t_reform, 4),
            t_group=round(rec.t_group, 4), t_transfer=round(rec.t_transfer, 4),
            bytes=rec.bytes_moved, backend=self.plan.backend,
            **({"retries": rec.retries} if rec.retries else {}),
            **({"nccl_aborted": rec.nccl_aborted} if self.plan.abort_nccl else {}),
            **({"shards": {str(k): list(v) for k, v in rec.shards.items()}} if rec.shards else {}))


    def record_join(self, job_dir: Any, allocation: int, *, t_asked: float, t_taken: float,
                    t_received: float, bytes_moved: int) -> None:
        """A joiner records its join in ``events.jsonl`` (``inproc_join``: asked, taken in,
        state received; the goodput ledger's and ``hpc report``'s)."""
        m = self.joined
        assert m is not None
        EventLog(job_dir, allocation=allocation, rank=self.rank, sync_every_s=0).emit(
            "inproc_join", t=t_received, pid=os.getpid(), host=self.host, gen=m.gen,
            world_size=m.world_size, step=m.step, source=m.source, t_asked=round(t_asked, 4),
            t_taken=round(t_taken, 4), wait_s=round(t_taken - t_asked, 3),
            receive_s=round(t_received - t_taken, 3), bytes=bytes_moved)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _module(m: Any) -> torch.nn.Module:
    return getattr(m, "module", m)


def _sharded(m: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in m.parameters())
