"""The launcher's part of ``--recovery inprocess``: announce a dead worker, restart nobody alive.

torch's elastic agent (``SimpleElasticAgent._invoke_run``) treats any failed worker as the
whole group's failure: it stops every local worker and starts them all again after a new
rendezvous (and its spawn context already kills the siblings when it polls a failed one), and it
restarts every worker when a new node waits to join. In in-process mode the survivors recover
by themselves (:mod:`runtime.worker.inprocess`), so this launcher must own that decision:

- it watches its workers itself (``/proc``: a dead child is a zombie until reaped, with its exit
  status in ``/proc/PID/stat``) and, when one dies, **announces it in the store at once**
  (``dead/UID`` and ``fault/G`` of :mod:`hpc.contract.inprocess`): the survivors everywhere
  leave their step in milliseconds, and the re-form does not wait for the dead one;
- while any local worker lives, the group is healthy to torch (no restart, no kill), and a node
  waiting to join does not restart anyone either;
- when every local worker has ended: all that did not die finished, so the node finished; if
  none is left that could (every local worker died), torch's restart path runs, and the log
  and ``events.jsonl`` say why (``inproc_fallback``).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

from hpc.contract import inprocess as proto

log = logging.getLogger("hpc.launch")


def proc_exit(pid: int) -> int | None:
    """A child's exit status (``waitpid`` form: a signal in the low 7 bits, else code << 8)
    once it has ended and before it is reaped; None while it runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0   # reaped already: torch saw it end
    if fields[0] != "Z":
        return None
    return int(fields[-1]) if len(fields) >= 50 else 0


def describe_exit(status: int) -> str:
    """``waitpid`` status in words: ``signal 9`` or ``exit code 1``."""
    return f"signal {status & 0x7F}" if status & 0x7F else f"exit code {status >> 8}"


@contextmanager
def owning_recovery(store_address: str, events: Any = None) -> Iterator[None]:
    """While inside, torch's agent (built by ``launch_agent`` by its module-global name) is
    one that announces dead workers and restarts no live ones (see the module docstring).

    Args:
        store_address: ``host:port`` of the rendezvous store the workers use.
        events: Where to record (``runtime.events.EventLog``), or None.
    """
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.launcher import api as launcher_api

    base = launcher_api.LocalElasticAgent
    host = socket.gethostname()

    class InProcessAgent(base):  # type: ignore[misc, valid-type]
        _gone: dict[int, int]
        _hpc_store: Any = None   # (torch's agent has its own _store: the round's prefixed one)

        def _monitor_workers(self, worker_group: Any) -> Any:
            gone = self.__dict__.setdefault("_gone", {})
            workers = {w.local_rank: w for w in worker_group.workers}
            status = {lr: proc_exit(w.id) for lr, w in workers.items() if w.id is not None}
            for lr, code in status.items():
                if code is not None and code != 0 and lr not in gone:
                    gone[lr] = code
                    self._announce(worker_group, workers[lr], code)
            alive = [lr for lr, code in status.items() if code is None]
            if gone and alive:
                return RunResult(state=WorkerState.HEALTHY)
            if gone and len(gone) < len(status):   # the others finished: this node did
                return RunResult(state=WorkerState.SUCCEEDED,
                                 return_values={w.global_rank: None for w in workers.values()})
            if gone:
                why = f"every worker on {host} is gone ({len(gone)}): torch's restart path"
                log.warning("in-process recovery: %s", why)
                if events is not None:
                    events.emit("inproc_fallback", reason=why)
                gone.clear()
            return super()._monitor_workers(worker_group)

        def _restart_workers(self, worker_group: Any) -> None:
            if getattr(worker_group, "state", None) == WorkerState.HEALTHY:
                log.info("in-process recovery: a node waits to join; the running workers are "
                         "not restarted for it")
                return
            self.__dict__["_gone"] = {}
            super()._restart_workers(worker_group)

        def _announce(self, worker_group: Any, worker: Any, code: int) -> None:
            t = time.time()
            space = proto.namespace(worker_group.master_addr, worker_group.master_port)
            who = proto.uid(host, worker.id)
            why = f"launcher on {host}: worker {worker.id} (rank {worker.global_rank}) died, " \
                  f"{describe_exit(code)}"
            try:
                import torch.distributed as dist
                if self._hpc_store is None:
                    h, _, p = store_address.rpartition(":")
                    self._hpc_store = dist.TCPStore(h, int(p), is_master=False,
                                                timeout=timedelta(seconds=10), wait_for_workers=False)
                store = dist.PrefixStore(space, self._hpc_store)   # the workers' view
                store.set(proto.dead(who), why)
                gen = int(store.get(proto.GENERATION)) if store.check([proto.GENERATION]) else 0
                store.set(proto.fault(gen), why)
            except Exception as e:   # noqa: BLE001 - the survivors still see their collectives fail
                log.warning("in-process recovery: cannot announce the dead worker: %s", e)
                return
            log.warning("in-process recovery: %s; announced (generation %d), the others go on", why, gen)
            log.info("in-process recovery: announced under %s", space)
            if events is not None:
                events.emit("inproc_detect", t=t, pid=worker.id, rank=worker.global_rank,
                            exit=describe_exit(code), gen=gen)

    launcher_api.LocalElasticAgent = InProcessAgent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base


def for_spec(recovery: str, store_address: str, events: Any = None) -> Any:
    """The context the launcher runs torch's agent in for the job's ``--recovery``."""
    if recovery != proto.INPROCESS:
        return nullcontext()
    return owning_recovery(store_address, events)


def worker_env(store_address: str) -> dict[str, str]:
    """What the workers need for in-process recovery (the launcher sets it per agent run)."""
    return {proto.RECOVERY_ENV: proto.INPROCESS, proto.STORE_ENV: store_address}

