"""In-process recovery's part of one agent run on the launcher (:class:`InProcessRun`).

The launcher asks it at the fixed points of :class:`runtime.launch.recovery.Restart`; here
each one does what recovery without restart needs of this node for the run:

- **prepare**: the workers' store, the largest world joiners may fill, and (when the workers may
  be kept through the rendezvous host's loss) the node-local channel that names a new store;
- **instead of the agent**: a hot spare's launcher runs joiners, not torch's agent
  (:mod:`~runtime.inprocess.launcher.spare`), unless the members fell back to the restart path;
- **start/stop**: the lifelines (:mod:`~runtime.inprocess.launcher.lifelines`): the store host
  listens, every launcher holds one;
- **watch**: a lost node's workers announced (:mod:`~runtime.inprocess.launcher.silent`), held
  back on a rendezvous host that may be the one cut off (:class:`UnlessCutOff`);
- **arm**: the fence keeps the workers through the host's loss where they can be
  (:mod:`~runtime.inprocess.launcher.adopt`), and records the fallback where they cannot;
- **agent part**: the part of torch's agent that announces deaths and starts joiners
  (:class:`~runtime.inprocess.launcher.agent.InProcessAgent`);
- **stop**: the warm standby ended, the lifelines closed (this launcher ends on purpose), the fence's signal handed back;
- **settle**: workers torch's agent kept when the host's store broke go to the next epoch, or
  are stopped, and a lost host's fallback is recorded.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hpc.contract import jobsecret, recovery_settings
from hpc.contract.jobpaths import JobPaths
from runtime.events import EventLog
from runtime.inprocess.launcher import adopt as kept_workers, agent, lifelines, silent, spare
from runtime.launch import host_store
from runtime.launch.forwarding import KEEP_SIGNAL

if TYPE_CHECKING:
    from hpc.contract.jobspec import JobSpec
    from runtime.ending.outcome import AgentEnd
    from runtime.launch.plan import LaunchPlan
    from runtime.succession import Board

log = logging.getLogger("hpc.launch")

def host_lost(host: str, why: str, *, succession: bool, then: str | None = None) -> str:
    """The ``inproc_fallback`` reason when the rendezvous host is lost and this node's workers
    cannot be kept (``then``: why not, :func:`runtime.inprocess.launcher.adopt.why_not`) (pure)."""
    then = then or ("a new rendezvous host is elected and the workers start again from the last checkpoint"
                    if succession else "no succession outside Slurm: the job ends as a node failure")
    return (f"the rendezvous host {host} is lost; its store carried the in-process membership "
            f"({why}): the workers here are stopped, {then}")


def keepable(board: Board | None, spec: JobSpec) -> tuple[dict[int, int], str | None]:
    """This node's live in-process workers and why they cannot be kept through the rendezvous
    host's loss (None: they are kept, :mod:`runtime.inprocess.launcher.adopt`)."""
    kept = kept_workers.live_workers(os.getpid())
    return kept, kept_workers.why_not(succession=board is not None, spares=spec.spare_nodes,
                                      kept=kept, nproc=spec.nproc_per_node)


class UnlessCutOff:
    """The rendezvous host's announcement of lost nodes under ``--recovery inprocess`` (its
    workers then re-form without them), held back while this node may be the one cut off.

    A host that sees at most half of its epoch's nodes and cannot reach Slurm's controller is
    the one cut off: the others elect a new host and keep their workers
    (:mod:`runtime.inprocess.launcher.adopt`). Its own workers must not re-form alone and train
    (and commit checkpoints) in the seconds before the survivors' election fences it: its
    fence stops them (the launcher's fence, the same rule). With the controller reachable the
    others are gone, not cut off: the host announces them and goes on, as before.

    The nodes left are those *in sight* (their counters advanced within ``in_sight``'s window),
    not those not yet named lost: cut off, the host sees its peers' counters stop one after
    another, and when the first is named lost the others are as silent, only not for as long
    (the CI of d306e5b: the cut host re-formed alone with "2 of 3 left" and saved a step the
    survivors then could not).

    Args:
        announce: The announcement (:class:`~runtime.inprocess.launcher.silent.LostNodes`).
        members: The epoch's nodes.
        reachable: ``() -> bool``: can this node reach Slurm's controller? Asked when the nodes
            in sight are no majority; its answer stands for :data:`ASK_AGAIN_S`.
        in_sight: ``() -> int``: other nodes seen alive just now (None: all not named lost).
    """

    ASK_AGAIN_S = 5.0

    def __init__(self, announce: Any, *, members: int, reachable: Any, in_sight: Any = None,
                 clock: Any = time.monotonic) -> None:
        self.announce, self.members, self.reachable = announce, members, reachable
        self.in_sight, self.clock = in_sight, clock
        self.lost: set[int] = set()
        self.gone_confirmed = False       # the controller's last answer: the others are gone
        self._asked_at: float | None = None
        self._held = False

    def __call__(self, lost: Mapping[int, tuple[str, float]]) -> None:
        self.lost |= set(lost)
        left = self.members - len(self.lost)
        if self.in_sight is not None:
            left = min(left, 1 + self.in_sight())
        if self.members >= 2 and left * 2 <= self.members:
            now = self.clock()
            if self._asked_at is None or now - self._asked_at >= self.ASK_AGAIN_S:
                self._asked_at = now
                self.gone_confirmed = bool(self.reachable())
            if not self.gone_confirmed:
                if not self._held:
                    self._held = True
                    log.warning("in-process recovery: %d of %d nodes in sight (lost %d) and Slurm's "
                                "controller does not answer: this node may be the one cut off; its "
                                "workers do not re-form without them", left, self.members, len(self.lost))
                return
        self.announce(lost)


class InProcessRun:
    """One agent run under ``--recovery inprocess``: the points of
    :class:`runtime.launch.recovery.Restart`, in the same order (arguments:
    :func:`runtime.launch.recovery.for_run`)."""

    def __init__(self, plan: LaunchPlan, *, epoch: int, board: Board | None, names: Sequence[str],
                 adopt: Mapping[int, int] | None, stopping: Callable[[], bool],
                 keep_allowed: Callable[[], bool]) -> None:
        spec = plan.spec
        self.plan, self.board, self.epoch = plan, board, epoch
        self.events = EventLog(plan.job_dir, allocation=plan.allocation, node_rank=plan.node_rank,
                               sync_every_s=0)
        self.keeps = kept_workers.why_not(
            succession=board is not None, spares=spec.spare_nodes,
            kept=dict.fromkeys(range(spec.nproc_per_node), 0), nproc=spec.nproc_per_node) is None
        endpoint = plan.rdzv_endpoint
        self.settings = agent.AgentSettings(
            endpoint, self.events, plan.node_rank, spec.replacement, adopt=adopt, epoch=epoch, members=names,
            keep_on_loss=(lambda: keep_allowed() and not host_store.answers(endpoint))
            if self.keeps and not plan.is_rdzv_host and plan.launchers > 1 else None,
            stopping=stopping)
        self._listener: lifelines.Lifelines | None = None
        self._line: lifelines.LauncherLine | None = None
        self._keep_handler: Any = None

    def prepare(self) -> None:
        plan = self.plan
        os.environ.pop(recovery_settings.CHANNEL_ENV, None)
        os.environ.update(agent.worker_env(plan.rdzv_endpoint, keeps=self.keeps))
        os.environ.update(recovery_settings.InProcessEnvironment(
            max_world=plan.nnodes[1] * plan.spec.nproc_per_node).to_env())

    def instead_of_agent(self, relaunch: Callable[[], None]) -> AgentEnd | None:
        plan = self.plan
        if not spare.is_spare(plan.spec.spare_nodes, plan.node_rank, plan.nnodes[1]):
            return None
        # None: the members fell back to torch's restart path; this node joins its round.
        return spare.run_spare(plan, self.events, relaunch=relaunch)   # joiners, no torch agent

    def start(self) -> None:
        plan = self.plan
        key = jobsecret.ensure(JobPaths(plan.job_dir).secret)   # signs every line's hello
        if plan.is_rdzv_host:
            self._listener = lifelines.Lifelines(plan.rdzv_endpoint, key=key,
                                                 replacement=plan.spec.replacement, events=self.events)
            self._listener.start()
        self._line = lifelines.LauncherLine(plan.rdzv_endpoint, key=key)
        self._line.start()

    def watch(self, watchdog: Any, *, board: Board | None, members: int,
              reachable: Callable[[], bool]) -> None:
        if watchdog.beacon is None:
            return
        watchdog.on_lost = silent.LostNodes(self.plan.rdzv_endpoint, self.events, host=socket.gethostname())
        if self.plan.is_rdzv_host and board is not None:   # a cut-off host must not train on alone
            beacon = watchdog.beacon
            watchdog.on_lost = UnlessCutOff(watchdog.on_lost, members=members or self.plan.launchers,
                                            reachable=reachable,
                                            in_sight=lambda: beacon.in_sight(silent.LOST_S / 2))
        watchdog.on_lost_after_s = silent.LOST_S

    def arm(self, fence: Any, board: Board | None) -> None:
        spec, host = self.plan.spec, self.plan.rdzv_endpoint.rsplit(":", 1)[0]
        fence.keep = lambda: keepable(board, spec)   # the workers kept through the host's loss, if they can be
        fence.on_host_lost = lambda why, then: self.events.emit("inproc_fallback", reason=host_lost(
            host, why, succession=board is not None, then=then))
        self._keep_handler = signal.signal(KEEP_SIGNAL, lambda *_: fence.exec_kept())

    def agent_part(self) -> tuple[type, Mapping[str, Any]]:
        return agent.InProcessAgent, {"inproc": self.settings}

    def stop(self) -> None:
        self.settings.standby.close()
        if self._line is not None:
            self._line.close()   # this launcher ends on purpose: not a lost node
        if self._listener is not None:
            self._listener.stop()
        if self._keep_handler is not None:
            signal.signal(KEEP_SIGNAL, self._keep_handler)

    def settle(self, result: str, reason: str, extra: dict[str, Any], *, fence: Any,
               received: Sequence[Any]) -> tuple[str, str]:
        plan, fenced = self.plan, fence is not None and fence.acted
        if self.settings.kept and not fenced:
            # torch's agent failed on the lost host's store (refused, reset) before the fence saw it
            # silent, and kept the workers: the next epoch takes them, or they are stopped here
            kept, why_not = keepable(self.board, plan.spec)
            if why_not is None and kept and not received:
                result = "rendezvous"
                reason = f"lost the rendezvous host {plan.rdzv_endpoint}: its store does not answer"
                extra["adopt"] = kept
            else:
                kept_workers.kill(list(kept.values()))
                result = "rendezvous" if result == "failed" and not received else result
        if result == "rendezvous" and not plan.is_rdzv_host and "adopt" not in extra \
                and not (fence is not None and fence.fell_back):   # the store refused before the fence saw it silent
            self.events.emit("inproc_fallback", reason=host_lost(
                plan.rdzv_endpoint.rsplit(":", 1)[0], reason, succession=self.board is not None))
        return result, reason


# --- the workers kept from one rendezvous epoch's run to the next (the launcher's whole life) ---

def begin(adopt: Mapping[int, int] | None) -> None:
    """As a launcher starts: a channel left by an earlier launcher of this PID must not move new
    workers (one restarted keeping its workers, ``adopt``, uses its own)."""
    if not adopt:
        kept_workers.channel_path(os.getpid()).unlink(missing_ok=True)


def carried(end: AgentEnd, adopt: Mapping[int, int] | None) -> dict[int, int] | None:
    """After an agent run: the workers it kept for the next epoch (``end.extra["adopt"]``,
    taken out); those of ``adopt`` it neither took nor kept are stopped."""
    kept = end.extra.pop("adopt", None) or {}
    if adopt:
        kept_workers.stop_left({lr: p for lr, p in adopt.items() if p not in kept.values()})
    return kept or None


def abandon(plan: LaunchPlan, host: str, end: AgentEnd, adopt: Mapping[int, int] | None) -> None:
    """No new epoch takes the workers kept through ``host``'s loss: they are stopped, and the
    fallback is recorded."""
    if not adopt:
        return
    kept_workers.kill(list(adopt.values()))
    EventLog(plan.job_dir, allocation=plan.allocation, node_rank=plan.node_rank, sync_every_s=0).emit(
        "inproc_fallback", reason=host_lost(
            host, end.reason, succession=True,
            then=f"no new epoch takes this node's workers ({end.extra.get('succession') or end.reason}): "
                 "they are stopped"))


def adopt_args(adopt: Mapping[int, int] | None) -> list[str]:
    """The launcher's arguments that hand ``adopt`` to itself across its ``execv``."""
    return [f"--adopt={kept_workers.format_adopt(adopt)}"] if adopt else []


def parse_adopt(text: str | None) -> dict[int, int] | None:
    """``--adopt``'s value as local rank -> PID (None: none)."""
    return kept_workers.parse_adopt(text) or None
