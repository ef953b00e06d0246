"""FSDP2 shards kept in a peer node's host memory, so a lost rank's shards are still somewhere.

Under in-process recovery with an FSDP2 model, every ``every`` steps (``HPC_INPROC_COPY_EVERY``,
default 1) each rank, at the step boundary after the optimizer step:

1. **snapshots** its own shards into host memory: each parameter's local tensor, the optimizer
   state's local tensors (DTensors as their local tensor), the registered small state
   (sampler, scheduler), its RNG, and the step. This is the only part on the step's path (a
   copy of this rank's shards, on GPU a device-to-host copy); it is also the rank's own
   rollback buffer;
2. hands the snapshot to a **side thread** that sends it, on a gloo group of its own (so the
   training group's collectives never queue behind it), to its holder: the rank at the same
   place on the next node (:func:`runtime.inprocess.worker.peers.holders`), and receives the
   copies it keeps for its owners.

**Double-buffered**: each rank keeps its two newest own snapshots (a new snapshot is written
into the buffers of the older one: no allocation on the step's path once warm) and, per owner,
the newest *complete* copy plus the one in flight; a copy replaces the older one only once it
arrived whole, so a fault during an exchange leaves the previous copy intact. At most one exchange is
in flight: a boundary that finds the previous one unfinished waits for it (every rank sends at
the same steps, so none may skip alone). With one node there is no other node: no copy is kept,
and the log says so once.

**Bounded**: the copies' host memory per rank (two own snapshots and two copies per owner) is
checked against ``HPC_INPROC_COPY_MAX_MB`` (default 4096) at every snapshot; beyond it the job
stops with the value and the limit, instead of swapping a node to death.

After a loss, :meth:`PeerCopies.holding` says what this rank holds for the agreement
(:func:`~runtime.inprocess.worker.peers.agree`), :meth:`snapshot_of` gives a buffered state,
and :meth:`load` puts a state into the live model and optimizer in place (the user's objects
stay the same objects).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpc.contract import recovery_settings
from runtime.worker import rng
from runtime.inprocess.worker import peers, transfer

log = logging.getLogger("hpc.inprocess")
_DT = "__dtensor_local__"   # marks a DTensor's local tensor in a snapshot's optimizer state
KEEP = 2                    # snapshots (own) and copies (per owner) kept: double buffering
OVERHEAD_TARGET = 0.01      # the Session's step overhead target: the snapshot's share is said above it


class CopyLimit(ValueError):
    """The copies would take more host memory than the job allows (a setting, not a fault)."""


def options(environ: Mapping[str, str]) -> tuple[int, int]:
    """(copy every N steps, the memory bound in bytes) from the job's environment.

    Raises:
        ValueError: A value that is not a positive number, naming the variable.
    """
    env = recovery_settings.InProcessEnvironment.parsed(environ)
    return env.copy_every, int(env.copy_max_mb * 2**20)


def check_bound(size: int, *, kept: int, max_bytes: int, rank: int) -> int:
    """The host memory of the copies for shards of ``size`` bytes (two own snapshots and two
    copies of each of ``kept`` owners).

    Raises:
        CopyLimit: Over ``max_bytes``, naming the value, the limit and its variable.
    """
    total = size * KEEP * (1 + kept)
    if total > max_bytes:
        raise CopyLimit(
            f"the FSDP2 peer copies need {total / 2**20:.1f} MB of host memory on rank {rank} "
            f"({size / 2**20:.1f} MB of shards x {KEEP} buffers x (own + {kept} kept)), over the "
            f"limit {recovery_settings.COPY_MAX_MB_ENV}={max_bytes / 2**20:g} MB: raise the limit, or use "
            "--recovery restart")
    return total


def advised_every(snapshot_s: float, step_s: float, every: int, target: float = OVERHEAD_TARGET) -> int | None:
    """The copy interval that keeps the snapshots within ``target`` of the step time, or None
    when ``every`` already does.

    Args:
        snapshot_s: One snapshot's time, on the step's path.
        step_s: One step's time without a snapshot in it (a step that follows a snapshot holds
            it: the Session times a step from one boundary to the next).
        every: The interval now (copies every that many steps).
    """
    if step_s <= 0 or snapshot_s <= target * every * step_s:
        return None
    return math.ceil(snapshot_s / (target * step_s))


def nbytes(state: Any) -> int:
    """The bytes of the tensors in a nest of dicts, lists and tuples."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    return 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if type(t).__name__ == "DTensor" else t   # type: ignore[attr-defined]


class PeerCopies:
    """This rank's snapshots and the copies it keeps of its owners' shards.

    Args:
        models: The FSDP2 models (their parameters are DTensors).
        optimizers: Their optimizers.
        small: The registered small state (``state_dict``/``load_state_dict``).
        every: Copy every this many steps.
        max_bytes: The bound of this rank's copies in host memory.
        node: This rank's node (ranks of one node share it).
        timeout_s: The bound of one exchange (a silent peer ends it; the copy is then dropped).
    """

    def __init__(self, models: list[Any], optimizers: list[torch.optim.Optimizer],
                 small: Mapping[str, Any], *, every: int, max_bytes: int, node: str,
                 timeout_s: float = 300.0) -> None:
        self.models, self.optimizers, self.small = models, optimizers, dict(small)
        self.every, self.max_bytes, self.node, self.timeout_s = every, max_bytes, node, timeout_s
        self.own: dict[int, dict[str, Any]] = {}                 # step -> this rank's snapshot
        self.kept: dict[int, dict[int, dict[str, Any]]] = {}     # owner -> step -> its copy
        self.ring: dict[int, int] = {}
        self.rank = -1
        self.bytes_per_copy = 0
        self.copies_made = 0
        self.copy_s = 0.0            # the side thread's time, summed
        self.copy_cpu_s = 0.0        # the side thread's CPU time, summed
        self.snapshot_s = 0.0        # the step path's time (the snapshots), summed
        self.snapshots = 0
        self._warned = False
        self._last_snapshot: tuple[int, float] | None = None   # (step, seconds) of the newest
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._said_one_node = False
        self._bound_once = False     # bound in this generation (lazily, at the first copy step)

    # -- the group ---------------------------------------------------------------------------
    def bind(self) -> None:
        """On the current generation's world (every rank, a collective): the side group and
        the ring of holders."""
        world, self.rank = dist.get_world_size(), dist.get_rank()
        nodes: list[Any] = [None] * world
        dist.all_gather_object(nodes, self.node)
        self.ring = peers.holders([str(n) for n in nodes])
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s)) \
            if self.ring else None
        if not self.ring and not self._said_one_node and self.rank == 0:
            self._said_one_node = True
            log.warning("in-process recovery: all %d ranks are on one node: no peer copy of the FSDP2 "
                        "shards is kept (it would die with the node); a lost rank's shards come from "
                        "the disk checkpoint (the restart path)", world)

    def unbind(self) -> Any:
        """Leaves the old generation: returns the side group to keep (never destroyed; see
        ``InProcess._abort``, which then breaks its connections, so an exchange in flight
        ends; the agreement waits for it, :meth:`settle`)."""
        group, self._group, self._bound_once = self._group, None, False
        return group

    # -- the copies --------------------------------------------------------------------------
    def after_step(self, step: int, step_s: float | None = None) -> None:
        """At the step boundary after ``step`` steps: snapshot and send when due (every rank).

        Args:
            step: Steps done.
            step_s: The last step's time, if known (the previous boundary's snapshot
                included): a snapshot costing more than :data:`OVERHEAD_TARGET` of the steps
                between copies is said once, with the ``HPC_INPROC_COPY_EVERY`` that would
                meet it (:func:`advised_every`).
        """
        if step % self.every:
            return
        if not self._bound_once:
            self.bind()
            self._bound_once = True
        if not self.ring:
            return
        self.settle()   # at most one exchange in flight
        t0 = time.perf_counter()
        size = self.live_bytes()
        check_bound(size, kept=len(peers.owners(self.ring, self.rank)), max_bytes=self.max_bytes,
                    rank=self.rank)
        with self._lock:   # the oldest own snapshot's buffers take the new one (double buffering)
            spare = self.own.pop(min(self.own)) if len(self.own) >= KEEP else None
        snap = self.snapshot(step, reuse=spare)
        with self._lock:
            self.own[step] = snap
        self.bytes_per_copy = size
        took = time.perf_counter() - t0
        self.snapshot_s += took
        self.snapshots += 1
        # The step just timed ran after the previous boundary: its snapshot, if that one made
        # one, is in ``step_s`` (a copy every step), and is no part of the step it is a share of.
        last, self._last_snapshot = self._last_snapshot, (step, took)
        self._check_overhead(step_s, last[1] if last is not None and last[0] == step - 1 else 0.0)
        self._thread = threading.Thread(target=self._exchange, args=(step, snap), daemon=True,
                                        name="hpc-peer-copy")
        self._thread.start()

    def _check_overhead(self, step_s: float | None, included_s: float = 0.0) -> None:
        if self._warned or step_s is None or self.snapshots < 3:
            return
        mean = self.snapshot_s / self.snapshots
        need = advised_every(mean, step_s - included_s, self.every)
        if need is not None:
            self._warned = True
            base = step_s - included_s
            log.warning("in-process recovery: the FSDP2 peer copy's snapshot takes %.1f ms on the step's "
                        "path every %d step(s) of %.0f ms (%.1f %% of the step time, over %.0f %%): set "
                        "%s=%d or more (a lost rank then goes back up to that many steps)", mean * 1e3,
                        self.every, base * 1e3, mean / (self.every * base) * 100, OVERHEAD_TARGET * 100,
                        recovery_settings.COPY_EVERY_ENV, need)

    def settle(self, timeout_s: float | None = None) -> None:
        """Waits for the exchange in flight (all of it, or ``timeout_s``)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None

    def _exchange(self, step: int, snap: dict[str, Any]) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        group, ring, rank = self._group, self.ring, self.rank
        tag = step % (1 << 20)
        try:
            # Lower rank of each pair sends first (gloo's send blocks until it is received).
            dst, srcs = ring[rank], peers.owners(ring, rank)
            if rank < dst:
                transfer.send_state(snap, dst=dst, group=group, tag=tag)
                got = {src: transfer.recv_state(src=src, group=group, tag=tag) for src in srcs}
            else:
                got = {src: transfer.recv_state(src=src, group=group, tag=tag) for src in srcs}
                transfer.send_state(snap, dst=dst, group=group, tag=tag)
        except Exception as e:   # noqa: BLE001 - a peer lost mid-exchange: the older copy stays
            log.warning("in-process recovery: the peer copy of step %d did not complete (%s); the "
                        "previous copy is kept", step, str(e).splitlines()[0][:200] if str(e) else e)
            return
        with self._lock:
            for src, state in got.items():
                kept = self.kept.setdefault(src, {})
                kept[int(state["step"])] = state
                for old in sorted(kept)[:-KEEP]:
                    del kept[old]
        self.copies_made += 1
        self.copy_s += time.perf_counter() - t0
        self.copy_cpu_s += time.thread_time() - cpu0

    def live_bytes(self) -> int:
        """The bytes of this rank's shards now (parameters and optimizer state, local parts)."""
        params = sum(_local(p).numel() * _local(p).element_size() for m in self.models for p in m.parameters())
        optim = sum(_local(v).numel() * _local(v).element_size() for o in self.optimizers
                    for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        return params + optim

    def snapshot(self, step: int, reuse: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """This rank's whole state at ``step`` (copies, in host memory), into the buffers of
        ``reuse`` (an older snapshot) where they fit: no allocation in the steady state."""
        old_params = reuse["params"] if reuse else [[] for _ in self.models]
        old_optims = reuse["optims"] if reuse else [None for _ in self.optimizers]
        with torch.no_grad():
            params = [[_into(old[i] if i < len(old) else None, _local(p)) for i, p in enumerate(m.parameters())]
                      for m, old in zip(self.models, old_params)]
            optims = [_clone_optim(o.state_dict(), old) for o, old in zip(self.optimizers, old_optims)]
        return {"step": step, "params": params, "optims": optims,
                "small": {k: copy.deepcopy(v.state_dict()) for k, v in self.small.items()},
                "rng": rng.capture()}

    def held_bytes(self) -> int:
        """The host memory this rank's snapshots and kept copies take now."""
        with self._lock:
            return sum(nbytes(s) for s in self.own.values()) + \
                sum(nbytes(s) for k in self.kept.values() for s in k.values())

    # -- after a loss --------------------------------------------------------------------------
    def holding(self, rank: int, live: int | None) -> peers.Holding:
        """What this rank holds, for the agreement (after the exchange in flight settled)."""
        with self._lock:
            return peers.Holding(rank, live=live, own=tuple(sorted(self.own)),
                                 peer={o: tuple(sorted(k)) for o, k in self.kept.items() if k})

    def snapshot_of(self, owner: int | None, step: int) -> dict[str, Any]:
        """This rank's own snapshot (``owner`` None) or its copy of ``owner``'s, at ``step``."""
        with self._lock:
            return self.own[step] if owner is None else self.kept[owner][step]

    def load(self, state: Mapping[str, Any]) -> None:
        """Puts ``state`` into the live models and optimizers in place, and the small state
        and RNG (the user's objects stay the same objects)."""
        with torch.no_grad():
            for m, params in zip(self.models, state["params"]):
                for p, t in zip(m.parameters(), params):
                    _local(p).copy_(t)
        for o, sd in zip(self.optimizers, state["optims"]):
            o.load_state_dict(_as_dtensors(sd, o))
        for k, sd in state["small"].items():
            if k in self.small:
                self.small[k].load_state_dict(copy.deepcopy(sd))
        rng.restore(state["rng"])

    def drop_after(self, step: int) -> None:
        """Forgets snapshots and copies newer than ``step`` (the generation went back to it)."""
        with self._lock:
            for s in [s for s in self.own if s > step]:
                del self.own[s]
            for kept in self.kept.values():
                for s in [s for s in kept if s > step]:
                    del kept[s]

    def forget_owners(self) -> None:
        """The ring changes with the generation: copies of ranks this rank no longer keeps go."""
        with self._lock:
            mine = set(peers.owners(self.ring, self.rank)) if self.ring else set(self.kept)
            for o in [o for o in self.kept if o not in mine]:
                del self.kept[o]


def _into(dst: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
    """``src`` copied into ``dst`` when it fits (same shape and dtype), else into a new CPU tensor."""
    if dst is not None and dst.shape == src.shape and dst.dtype == src.dtype:
        return dst.copy_(src)
    return src.detach().to("cpu", copy=True)


def _clone_optim(sd: Mapping[str, Any], reuse: Mapping[str, Any] | None = None) -> dict[str, Any]:
    old = reuse["state"] if reuse else {}
    state = {}
    for idx, entry in sd["state"].items():
        was = old.get(idx, {})
        out = {}
        for k, v in entry.items():
            prev = was.get(k)
            if type(v).__name__ == "DTensor":
                out[k] = {_DT: _into(prev.get(_DT) if isinstance(prev, dict) else None, _local(v))}
            elif isinstance(v, torch.Tensor):
                out[k] = _into(prev if isinstance(prev, torch.Tensor) else None, v)
            else:
                out[k] = copy.deepcopy(v)
        state[idx] = out
    return {"state": state, "param_groups": copy.deepcopy(sd["param_groups"])}


def _as_dtensors(sd: Mapping[str, Any], optim: torch.optim.Optimizer) -> dict[str, Any]:
    """A snapshot's optimizer state with each DTensor rebuilt on its parameter's mesh and
    placements (a joiner's optimizer has no state yet to copy into)."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optim.param_groups for p in g["params"]]
    state: dict[Any, Any] = {}
    for idx, entry in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {k: (DTensor.from_local(v[_DT].to(_local(p).device), p.device_mesh, p.placements,
                                             run_check=False, shape=p.shape, stride=p.stride())
                          if isinstance(v, dict) and _DT in v else v) for k, v in entry.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def node_key(environ: Mapping[str, str]) -> str:
    """This rank's node: its host and torch's node rank (``GROUP_RANK``; several local "nodes"
    share a host in tests, and a hot spare's worker may have no node rank)."""
    import socket

    return f"{socket.gethostname()}/{environ.get('GROUP_RANK', '') or '-'}"

