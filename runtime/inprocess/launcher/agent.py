"""The launcher's part of ``--recovery inprocess``: announce a dead worker, restart nobody alive.

torch's elastic agent (``SimpleElasticAgent._invoke_run``) treats any failed worker as the
whole group's failure: it stops every local worker and starts them all again after a new
rendezvous (and its spawn context already kills the siblings when it polls a failed one), and it
restarts every worker when a new node waits to join. In in-process mode the survivors recover
by themselves (:mod:`runtime.inprocess.worker`), so this launcher must own that decision:

- it watches its workers itself (``/proc``: a dead child is a zombie until reaped, with its exit
  status in ``/proc/PID/stat``) and, when one dies, **announces it in the store at once**
  (``dead/UID`` and ``fault/G`` of :mod:`runtime.inprocess.protocol`): the survivors everywhere
  leave their step in milliseconds, and the re-form does not wait for the dead one;
- it **restarts the dead worker as a joiner** (``HPC_INPROC_JOIN=1``, the same command and
  environment torch gave it, bounded by ``--max-restarts``): with ``--replacement wait`` (the
  default) it promises the replacement in the store (``replace/UID``) before announcing the
  death, so the survivors' re-form waits for the joiner and the world keeps its size (the joiner
  is made from the node's warm standby when one is ready, :mod:`runtime.inprocess.launcher.standby`); with
  ``--replacement shrink`` it promises nothing, the survivors re-form at once without the dead
  worker and the joiner is taken in at a later step boundary (the hot spares' grow path). The
  joiner receives the state from the survivors' memory (:mod:`runtime.inprocess.worker`). Only
  the dead worker is started again;
- a worker stopped (SIGSTOP) for :data:`~runtime.inprocess.launcher.silent.STOPPED_S` is frozen:
  it is SIGKILLed and then announced and replaced like a dead one
  (:mod:`runtime.inprocess.launcher.silent`, which also announces a lost node's workers);
- while any local worker lives, the group is healthy to torch (no restart, no kill), and a node
  waiting to join does not restart anyone either;
- when every local worker has ended: all that did not die finished, so the node finished; if
  none is left that could (every local worker died), torch's restart path runs, and the log
  and ``events.jsonl`` say why (``inproc_fallback``);
- when the workers gave up in-process recovery (``fallback`` in the store: e.g. an FSDP2 shard
  with no peer copy left), a dead worker is not replaced and the waiting joiners are ended: the
  workers end and torch's restart path (the last checkpoint) runs, with an ``inproc_fallback``;
- after the rendezvous host's loss, a launcher restarted into the succession election with
  its workers kept (:mod:`runtime.inprocess.launcher.adopt`) *adopts* them in the new epoch's
  first round instead of starting workers, and names the round's store to them;
- when the dead worker was the last living member of the generation (every member died), no
  joiner is started and the waiting ones are ended: a joiner is taken in by a member, so it
  would wait forever; the workers end and torch's restart path (the last checkpoint) runs,
  with an ``inproc_fallback`` that says so.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from hpc.contract import environment as job_env
from hpc.contract import recovery_settings
from runtime.inprocess import protocol as proto
from runtime.inprocess.launcher import adopt as inprocess_adopt, announce, silent as inprocess_silent, standby
from runtime.liveness import proc

log = logging.getLogger("hpc.launch")


REPLACE_WAIT_S = 120.0   # how long the survivors' re-form waits for a promised replacement
EXIT_BARRIER_S = 20.0    # torch's exit barrier in this mode (its default 300 s)


def popen_status(code: int) -> int:
    """A ``Popen.returncode`` (negative: a signal) in ``waitpid`` form."""
    return -code if code < 0 else code << 8


def describe_exit(status: int) -> str:
    """``waitpid`` status in words: ``signal 9`` or ``exit code 1``."""
    return f"signal {status & 0x7F}" if status & 0x7F else f"exit code {status >> 8}"


@dataclass
class AgentSettings:
    """One run's settings of :class:`InProcessAgent` (its class attribute ``inproc``).

    Attributes:
        store_address: ``host:port`` of the rendezvous store the workers use.
        events: Where to record (``runtime.events.EventLog``), or None.
        node_rank: This node's rank (its workers are published under ``node/N`` for a peer
            that names this node lost: :mod:`runtime.inprocess.launcher.silent`).
        replacement: The job's ``--replacement``: ``wait`` promises a dead worker's joiner in
            the store (the survivors' re-form waits for it), ``shrink`` does not (the
            survivors go on without it; it is taken in at a later step boundary).
        adopt: Workers this launcher kept through the old host's loss (local rank -> PID):
            the first round adopts them instead of starting workers.
        epoch: The rendezvous epoch (named to the adopted workers with the new store).
        members: The epoch's nodes (host names; a worker on any other is lost).
        keep_on_loss: Asked when torch's agent fails (its store broke): True when the host is
            lost and the workers are to be kept for the next epoch; then the agent ends
            without stopping them and :attr:`kept` is True.
        stopping: True once the launcher is stopping (a forwarded SIGTERM, its fence): a
            worker that dies then is not replaced by a joiner.
        standby: The node's warm standby (a dead worker's joiner comes from it).
        kept: Set by the agent: it kept its workers through the host's loss.
        host: This node's host name.
    """

    store_address: str
    events: Any = None
    node_rank: int = 0
    replacement: str = recovery_settings.WAIT
    adopt: Mapping[int, int] | None = None
    epoch: int = 0
    members: Sequence[str] = ()
    keep_on_loss: Callable[[], bool] | None = None
    stopping: Callable[[], bool] | None = None
    standby: standby.Standby = field(default_factory=lambda: standby.Standby(standby.enabled(os.environ)))
    kept: bool = False
    host: str = field(default_factory=socket.gethostname)


class InProcessAgent:
    """The in-process part of the launcher's agent (:mod:`runtime.launch.agent` composes it
    before torch's ``LocalElasticAgent``): it announces dead workers and restarts no live ones
    (the module docstring says how). Its run's settings are the class attribute ``inproc``
    (:class:`AgentSettings`), set where the class is composed: torch makes the instance."""

    inproc: AgentSettings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)   # type: ignore[call-arg]
        self._hpc_store: Any = None   # (torch's agent has its own _store: the round's prefixed one)
        self._launch: dict[str, Any] = {}   # what torch started each local rank with
        self._gone: dict[int, int] = {}     # local rank -> exit status of a worker not replaced
        self._joiners: dict[int, subprocess.Popen] = {}   # local rank -> the joiner started for it
        self._seen: set[int] = set()        # the pids whose deaths were handled
        self._published: list[str] = []     # this node's workers' uids in node/N
        self._replaced = 0                  # joiners started (bounded by --max-restarts)
        self._adopted = False               # the kept workers were taken by this agent's first round
        self._gave_up = False               # the workers' fallback was recorded
        self._frozen = inprocess_silent.StoppedWorkers()
        # A lost node never comes to torch's exit barrier (its replacement, a spare, runs
        # no agent): the others would wait its 300 s at the end.
        self._exit_barrier_timeout = min(self._exit_barrier_timeout, EXIT_BARRIER_S)

    def _start_workers(self, worker_group: Any) -> Any:
        """torch's start, keeping each local rank's command and environment (a joiner
        that replaces a dead worker is started with them); the first round of a launcher
        that kept its workers adopts them instead."""
        if self.inproc.adopt and not self._adopted:
            return self._adopt(worker_group)
        pids = super()._start_workers(worker_group)   # type: ignore[misc]
        pc = self._pcontext   # torch's process context keeps what it started each rank with
        self._launch = {"entrypoint": pc.entrypoint, "args": pc.args, "envs": pc.envs}
        self._gone, self._joiners, self._seen, self._published = {}, {}, set(), []
        self._publish(worker_group, list(pids.values()))   # (torch sets worker.id after this)
        return pids

    def _adopt(self, worker_group: Any) -> dict[int, int]:
        """Takes the kept workers as this round's and names the round's store to them."""
        assert self.inproc.adopt
        pids = dict(self.inproc.adopt)
        self._adopted = True
        self._pcontext = inprocess_adopt.AdoptedProcesses(
            pids, finished=lambda: bool(self._space(worker_group).check([proto.DONE])))
        launches = inprocess_adopt.launch_of(pids, store=self.inproc.store_address,
                                             master_addr=worker_group.master_addr,
                                             master_port=worker_group.master_port, epoch=self.inproc.epoch)
        self._launch = launches
        self._gone, self._joiners, self._seen, self._published = {}, {}, set(), []
        self._publish(worker_group, list(pids.values()))
        space = proto.namespace(worker_group.master_addr, worker_group.master_port)
        path = inprocess_adopt.publish(os.getpid(), proto.Rebind(self.inproc.epoch, self.inproc.store_address, space,
                                                                 tuple(self.inproc.members)))
        log.warning("in-process recovery: rendezvous epoch %d: workers %s kept (not started "
                    "again); their new store %s named in %s", self.inproc.epoch,
                    ", ".join(map(str, pids.values())), self.inproc.store_address, path)
        if self.inproc.events is not None:
            self.inproc.events.emit("inproc_adopt", epoch=self.inproc.epoch, store=self.inproc.store_address,
                                    pids=sorted(pids.values()), members=list(self.inproc.members))
        return pids

    def _space(self, worker_group: Any) -> Any:
        """The workers' view of the store (this round's namespace)."""
        import torch.distributed as dist
        if self._hpc_store is None:
            h, _, p = self.inproc.store_address.rpartition(":")
            self._hpc_store = dist.TCPStore(h, int(p), is_master=False,
                                            timeout=timedelta(seconds=10), wait_for_workers=False)
        space = proto.namespace(worker_group.master_addr, worker_group.master_port)
        return dist.PrefixStore(space, self._hpc_store)

    def _publish(self, worker_group: Any, pids: list[int]) -> None:
        """Adds workers of this node to ``node/N`` (whom a peer announces if this node is lost)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        published = self._published
        published.extend(proto.uid(self.inproc.host, p) for p in pids)
        try:
            self._space(worker_group).set(proto.node_workers(self.inproc.node_rank), json.dumps(published))
        except SignalException:   # the launcher's own stop (its fence's SIGQUIT): not a store error
            raise
        except Exception as e:   # noqa: BLE001 - then a lost node here waits for the bound
            log.warning("in-process recovery: cannot publish this node's workers: %s", e)

    def _monitor_workers(self, worker_group: Any) -> Any:
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        self._tend_standby()
        gone, joiners, seen = self._gone, self._joiners, self._seen
        workers = {w.local_rank: w for w in worker_group.workers}
        status: dict[int, int | None] = {}
        pids: dict[int, int] = {}
        for lr, w in workers.items():
            if lr in joiners:   # this local rank's process now is a joiner we started
                code = joiners[lr].poll()
                status[lr], pids[lr] = (None if code is None else popen_status(code)), joiners[lr].pid
            elif w.id is not None:
                status[lr], pids[lr] = proc.exit_status(w.id), w.id
        if any(p.poll() is None for p in joiners.values()):
            self._end_orphaned(worker_group, joiners)   # (their deaths: the next look)
        frozen = self._frozen
        now = time.monotonic()
        for pid in frozen.frozen({pids[lr]: proc.state(pids[lr]) for lr, code in status.items()
                                  if code is None}, now):
            frozen.kill(pid, now)   # its death is announced at the next look (a zombie)
        for lr, code in status.items():
            if code is None or code == 0 or pids[lr] in seen:
                continue
            seen.add(pids[lr])
            replace = self._announce(worker_group, workers[lr], code, pid=pids[lr],
                                     replace=self._may_replace(worker_group),
                                     why=frozen.killed.get(pids[lr], ""))
            if replace is None:   # no member is left: nobody can take a joiner in
                gone[lr] = code
                _end(joiners)      # (ended, they are announced and counted gone next look)
                continue
            if replace and self._start_joiner(worker_group, lr):
                status[lr] = None
            else:
                gone[lr] = code
        if joiners and not gone:   # torch's view of the replaced workers is stale: ours
            if any(code is None for code in status.values()):
                return RunResult(state=WorkerState.HEALTHY)
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={w.global_rank: None for w in workers.values()})
        alive = [lr for lr, code in status.items() if code is None]
        if gone and alive:
            return RunResult(state=WorkerState.HEALTHY)
        if gone and len(gone) < len(status):   # the others finished: this node did
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={w.global_rank: None for w in workers.values()})
        if gone and self.inproc.stopping is not None and self.inproc.stopping():   # ended by the stop: no fallback
            gone.clear()
        elif gone:
            why = f"every worker on {self.inproc.host} is gone ({len(gone)}): torch's restart path"
            log.warning("in-process recovery: %s", why)
            if self.inproc.events is not None:
                self.inproc.events.emit("inproc_fallback", reason=why)
            gone.clear()
        return super()._monitor_workers(worker_group)

    def _end_orphaned(self, worker_group: Any, joiners: dict[int, subprocess.Popen]) -> None:
        """Ends this launcher's waiting joiners once no member of the generation is alive
        (or the workers gave up): nobody would take them in. A joiner is started when its
        worker's death is seen while another member lives; when that member's death comes
        from another node's launcher a moment later, the joiner waited forever and this
        node, healthy to torch, never took the restart path the others' round waited in."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        try:
            store = self._space(worker_group)
            gen, uids = inprocess_silent.generation(store)
            mine = {proto.uid(self.inproc.host, p.pid) for p in joiners.values()}
            if set(uids) & mine:
                return   # taken in: members now
            gave_up = store.check([proto.FALLBACK])
            if not gave_up and (not uids or not store.check([proto.dead(u) for u in uids])):
                return   # (one request: check is true only when every key is there)
        except SignalException:
            raise
        except Exception as e:   # noqa: BLE001 - the store's host is lost: its own rules hold
            log.debug("in-process recovery: joiners' generation unreadable: %s", e)
            return
        why = ("the workers gave up in-process recovery" if gave_up else
               f"every member of generation {gen} is dead ({len(uids)})")
        why += f": the waiting joiner(s) {', '.join(str(p.pid) for p in joiners.values())} have nobody " \
               "to take them in and are ended; torch's restart path from the last checkpoint"
        log.warning("in-process recovery: %s", why)
        if self.inproc.events is not None:
            self.inproc.events.emit("inproc_fallback", reason=why, gen=gen)
        _end(joiners)

    def _may_replace(self, worker_group: Any) -> bool:
        if self.inproc.stopping is not None and self.inproc.stopping():   # killed by the launcher's own stop
            return False
        return self._replaced < worker_group.spec.max_restarts

    def _start_joiner(self, worker_group: Any, lr: int) -> bool:
        """Starts local rank ``lr`` again as a joiner; False when it cannot."""
        launch = self._launch
        try:
            argv = [launch["entrypoint"], *launch["args"][lr]]
            env = {**os.environ, **launch["envs"][lr], **recovery_settings.InProcessEnvironment(join=True).to_env()}
        except (KeyError, TypeError) as e:
            log.warning("in-process recovery: cannot restart local rank %d as a joiner (%s)", lr, e)
            return False
        pcontext = getattr(self, "_pcontext", None)   # adopted workers: their files, from /proc
        out_path = getattr(pcontext, "stdouts", {}).get(lr) or (launch.get("outs") or {}).get(lr)
        err_path = getattr(pcontext, "stderrs", {}).get(lr) or out_path
        proc = self.inproc.standby.take(argv, env, str(out_path or ""), str(err_path or ""))
        if proc is None:
            out = _append(out_path)
            err = _append(getattr(pcontext, "stderrs", {}).get(lr)) or out
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, start_new_session=True)
        self._replaced += 1
        self._joiners[lr] = proc
        self._publish(worker_group, [proc.pid])
        started = "from the warm standby" if proc.pid in self.inproc.standby.handed else "cold"
        log.warning("in-process recovery: local rank %d started again as a joiner (pid %d, %s, "
                    "restart %d of %d); the others go on", lr, proc.pid, started,
                    self._replaced, worker_group.spec.max_restarts)
        if self.inproc.events is not None:
            self.inproc.events.emit("inproc_replace", local_rank=lr, pid=proc.pid,
                                    restart=self._replaced, warm=proc.pid in self.inproc.standby.handed)
        return True

    def _tend_standby(self) -> None:
        """Keeps this node's warm standby (:mod:`runtime.inprocess.launcher.standby`) once workers run."""
        if self.inproc.standby.settled():   # (every look at the workers: no environment merged for nothing)
            return
        launch = self._launch
        envs = launch.get("envs") or {}
        if not envs or not launch.get("entrypoint") or (self.inproc.stopping is not None and self.inproc.stopping()):
            return
        args = launch.get("args") or {}
        if min(envs) in args:
            beats = job_env.JobEnvironment.from_env(os.environ).heartbeat_dir
            spare = standby.at_launch(len(os.sched_getaffinity(0)), len(envs))
            self.inproc.standby.tend([launch["entrypoint"], *args[min(envs)]], {**os.environ, **envs[min(envs)]},
                      ready=lambda: spare or standby.training(beats))

    def _stop_workers(self, worker_group: Any) -> None:
        self.inproc.standby.close()
        _end(self._joiners)
        super()._stop_workers(worker_group)   # type: ignore[misc]

    def _invoke_run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._invoke_run(*args, **kwargs)
        except Exception as e:
            if self.inproc.keep_on_loss is not None and self.inproc.keep_on_loss():   # the host is lost: keep them
                self.inproc.kept = True
                inprocess_adopt.keep_handles(getattr(self, "_pcontext", None))
                log.warning("in-process recovery: the agent's store is lost (%s: %s); its "
                            "workers are kept for the next rendezvous epoch", type(e).__name__, e)
            raise

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        self.inproc.standby.close()
        if self.inproc.kept:   # torch's end of run(): the workers live on into the next epoch
            return
        _end(self._joiners)
        super()._shutdown(*args, **kwargs)   # type: ignore[misc]

    def _restart_workers(self, worker_group: Any) -> None:
        from torch.distributed.elastic.agent.server.api import WorkerState

        if getattr(worker_group, "state", None) == WorkerState.HEALTHY:
            log.info("in-process recovery: a node waits to join; the running workers are "
                     "not restarted for it")
            return
        self._gone = {}
        super()._restart_workers(worker_group)   # type: ignore[misc]

    def _announce(self, worker_group: Any, worker: Any, code: int, *, pid: int,
                  replace: bool = False, why: str = "") -> bool | None:
        """Announces a dead worker; returns whether a joiner replaces it (None: no member
        of the generation is left alive, so none can: torch's restart path)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        t = time.time()
        space = proto.namespace(worker_group.master_addr, worker_group.master_port)
        who = proto.uid(self.inproc.host, pid)
        why = f"launcher on {self.inproc.host}: worker {pid} (local rank {worker.local_rank}) " + \
              (why or f"died, {describe_exit(code)}") + ("; a joiner replaces it" if replace else "")
        try:
            store = self._space(worker_group)   # the workers' view
            gen, uids = inprocess_silent.generation(store)
            left = [u for u in uids if u != who and not store.check([proto.dead(u)])]
            gave_up = store.get(proto.FALLBACK).decode(errors="replace") \
                if store.check([proto.FALLBACK]) else ""
            if (uids and not left) or gave_up:
                replace = None
            if replace and self.inproc.replacement == recovery_settings.WAIT:   # before the death: the re-form waits for it
                store.set(proto.replace(who), f"{t + REPLACE_WAIT_S:.3f}")
            # (no fault when a lifeline announced it and the survivors re-formed already: gen is theirs, whole)
            announce.dead(store, [who], why, gen=gen if not uids or who in uids else None)
        except SignalException:   # the launcher's own stop (its fence's SIGQUIT): swallowed here,
            raise                 # a cut-off host once went on, replacing the workers it had killed
        except Exception as e:   # noqa: BLE001 - the survivors still see their collectives fail
            log.warning("in-process recovery: cannot announce the dead worker: %s", e)
            return False
        if replace is None and gave_up:   # the workers found the state not in memory
            if not self._gave_up:
                self._gave_up = True
                fallback = f"the workers gave up in-process recovery: {gave_up}"
                log.warning("in-process recovery: %s", fallback)
                if self.inproc.events is not None:
                    self.inproc.events.emit("inproc_fallback", reason=fallback[:800], gen=gen)
        elif replace is None:
            fallback = (f"every member of generation {gen} is dead ({len(uids)}; the last: {why}): "
                        "no process holds the state in memory, a joiner has no one to take it in "
                        "from; torch's restart path from the last checkpoint")
            log.warning("in-process recovery: %s", fallback)
            if self.inproc.events is not None:
                self.inproc.events.emit("inproc_fallback", reason=fallback, gen=gen)
        log.warning("in-process recovery: %s; announced (generation %d), the others go on", why, gen)
        log.info("in-process recovery: announced under %s", space)
        if self.inproc.events is not None:
            self.inproc.events.emit("inproc_detect", t=t, pid=pid, rank=worker.global_rank,
                        exit=describe_exit(code), gen=gen, replace=bool(replace))
        return replace


def _append(path: Any) -> Any:
    """The file at ``path`` opened for appending (a joiner writes where its worker did), or None."""
    if not path:
        return None
    try:
        return open(path, "ab")   # noqa: SIM115 - the child keeps it; closed with this process
    except OSError:
        return None


def _end(joiners: dict[int, subprocess.Popen], grace_s: float = 5.0) -> None:
    """Ends the joiners this launcher started (their own sessions: the whole group)."""
    end_processes(joiners.values(), grace_s)


def end_processes(procs: Iterable[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERMs each live process's group (started with ``start_new_session``), SIGKILLs what
    is left after ``grace_s``, and reaps them."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.time() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass


def worker_env(store_address: str, *, keeps: bool = False) -> dict[str, str]:
    """What the workers need for in-process recovery (the launcher sets it per agent run);
    ``keeps``: this launcher may keep them through the host's loss, and names the new epoch's
    store in the channel (a node-local file; it keeps its PID across its ``execv``)."""
    return recovery_settings.InProcessEnvironment(
        recovery=recovery_settings.INPROCESS, store=store_address,
        channel=str(inprocess_adopt.channel_path(os.getpid())) if keeps else None).to_env()

