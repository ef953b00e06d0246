"""The rendezvous host's watch for an allocation that can no longer reach MIN nodes.

After a node loss torch's elastic agent starts a new rendezvous round and waits for MIN nodes
(``join_timeout``: 600 s here, and when it runs out the host only reports a failed rendezvous).
When Slurm has already dropped the lost nodes from the job (``--no-kill`` keeps the job on the
survivors: a crashed node in ~20 s, a cut link in ~30 s), the nodes left can never reach MIN:
no node will join, and the wait only burns the allocation. The fault campaign saw it
(``benchmarks/RESULTS-campaign.md``): a lone survivor of a MIN-2 job waited more than 6 minutes
instead of requeueing. A node that is only slow to join (a slow start, a long import, a slow
disk) is still in Slurm's job, so it is waited for as before.

The watch runs in the rendezvous host's launcher only (one per allocation: one Slurm query at
a time, not one per node). It looks at Slurm once this node has had no worker for
:data:`IDLE_S` (the agent is between worker groups, in a rendezvous round; a round that forms
takes a few seconds) and then every :data:`CHECK_S` while that lasts; not once this node's
workers have all finished (torch's agent then waits in its exit barrier for the other nodes'
agents, not in a rendezvous: the training is done, and a lost node that never comes to the
barrier must not turn a finished job into a requeue; the campaign saw it after a cut link
left one node to finish alone). When the job holds fewer
nodes than MIN, it ends the agent; the launcher then ends the allocation as a node failure,
which records the outcome and requeues the job (:mod:`runtime.ending.outcome`).

:func:`short_of_min` is pure; :class:`QuorumWatch` runs it with the reads it is given;
:func:`start` gives it the real ones (this node's worker processes, ``scontrol show job``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.contract.slurm import SlurmClient, SlurmError
from runtime.env import SlurmEnv
from runtime.launch.forwarding import children

if TYPE_CHECKING:
    from runtime.launch.plan import LaunchPlan

log = logging.getLogger("hpc.launch")

IDLE_S = 10.0    # no worker on this node this long: the agent waits in a rendezvous round
CHECK_S = 5.0    # then ask Slurm this often while it lasts
POLL_S = 1.0     # how often the node's own workers are looked at (cheap: /proc)

# Set once this launcher's agent enters torch's exit barrier: its workers all succeeded.
_FINISHED = threading.Event()


def short_of_min(state: str, job_nodes: Sequence[str], min_nodes: int) -> str | None:
    """Why the allocation can never reach ``min_nodes`` again, or None (pure).

    Args:
        state: The job's state as Slurm reports it (``RUNNING``; anything else is left alone:
            a job that is ending or being requeued is someone else's business).
        job_nodes: The nodes Slurm counts in the running job now (a node it dropped after a
            crash or a cut link is no longer among them; a node slow to join still is).
        min_nodes: The job's MIN nodes.
    """
    if state != "RUNNING" or not job_nodes or len(job_nodes) >= min_nodes:
        return None
    return (f"only {len(job_nodes)} node{'s' if len(job_nodes) > 1 else ''} left in the allocation "
            f"({', '.join(job_nodes)}), below MIN {min_nodes}: no node can join the rendezvous "
            "(Slurm dropped the others from the job)")


class QuorumWatch(threading.Thread):
    """Ends the agent once the allocation holds fewer than MIN nodes while it waits for them.

    Args:
        min_nodes: The job's MIN nodes.
        working: Whether this node runs workers now (then the agent is not in a rendezvous).
        job: Slurm's view of the job: ``(state, nodes)``, or None when it cannot be read.
        act: Ends the agent (the launcher sends itself SIGQUIT; torch's agent ends on it).
        clock: Monotonic seconds (tests pass their own).
        finished: Whether this node's workers have all finished successfully (the agent waits
            in its exit barrier, not in a rendezvous: never acted on).
    """

    def __init__(self, *, min_nodes: int, working: Callable[[], bool],
                 job: Callable[[], tuple[str, Sequence[str]] | None], act: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic, idle_s: float = IDLE_S,
                 check_s: float = CHECK_S, poll_s: float = POLL_S,
                 finished: Callable[[], bool] = lambda: False) -> None:
        super().__init__(name="hpc-quorum", daemon=True)
        self.min_nodes, self.working, self.job, self.act, self.clock = min_nodes, working, job, act, clock
        self.finished = finished
        self.idle_s, self.check_s, self.poll_s = idle_s, check_s, poll_s
        self.short: str | None = None        # why it ended the agent
        self._idle_since: float | None = None
        self._next_check = 0.0
        self._stop_event = threading.Event()

    def check(self) -> str | None:
        """One look (the thread calls it every ``poll_s``); returns the reason once it acts
        (it acts once)."""
        if self.short is not None:
            return self.short
        now = self.clock()
        if self.finished():
            return None   # the training is done here: the agent's exit barrier, no rendezvous
        if self.working():
            self._idle_since = None
            return None
        if self._idle_since is None:
            self._idle_since, self._next_check = now, now + self.idle_s
            return None
        if now < self._next_check:
            return None
        self._next_check = now + self.check_s
        seen = self.job()
        why = short_of_min(seen[0], seen[1], self.min_nodes) if seen is not None else None
        if why is not None:
            self.short = f"{why}; waited {now - self._idle_since:.0f}s in the rendezvous"
            log.warning("%s: ending this allocation as a node failure (requeue)", self.short)
            self.act()
        return self.short

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            try:
                if self.check() is not None:
                    return
            except Exception:   # a watch must never take the launcher down
                log.exception("the quorum watch failed; the rendezvous waits as torch's agent does")
                return

    def stop(self) -> None:
        self._stop_event.set()


class MarksFinished:
    """The part of the launcher's agent (:mod:`runtime.launch.agent` composes it before torch's)
    that marks entering torch's exit barrier (:data:`_FINISHED`): this node's workers finished,
    it is not waiting in a rendezvous."""

    def _exit_barrier(self) -> Any:
        _FINISHED.set()
        return super()._exit_barrier()   # type: ignore[misc]


def start(plan: "LaunchPlan") -> QuorumWatch | None:
    """The watch of the rendezvous host's launcher under Slurm, started; None in a container
    (no Slurm commands there) or outside Slurm."""
    slurm = SlurmEnv.from_env(os.environ)
    if plan.spec.container_image or not slurm.active:
        return None
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
    # torch installs its handler (SIGQUIT -> SignalException) only when it starts workers: a
    # rendezvous round before the first start would otherwise die of SIGQUIT, unrecorded.
    signal.signal(signal.SIGQUIT, _terminate_process_handler)
    worker = [a.encode() for a in plan.argv[:2]]    # python -m runtime.worker ...

    def working() -> bool:
        for pid in children(os.getpid()):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == worker:
                    return True
            except OSError:
                continue
        return False

    def job() -> tuple[str, tuple[str, ...]] | None:
        try:
            info = SlurmClient(retry_total_s=10).show_job(slurm.job_id)
        except SlurmError as e:
            log.info("quorum watch: cannot read job %s (%s)", slurm.job_id, e)
            return None
        return info.state.value, info.nodes

    _FINISHED.clear()   # this agent's run (a launcher goes on in a new epoch after a failure)
    watch = QuorumWatch(min_nodes=plan.nnodes[0], working=working, job=job,
                        act=lambda: os.kill(os.getpid(), signal.SIGQUIT), finished=_FINISHED.is_set)
    watch.start()
    return watch
