"""The per-node launcher: one per node, around torch's elastic agent.

Every backend runs this on each node (Slurm: one task per node; ``hpc run``: locally)::

    python -m runtime.launch --job-dir JOB_DIR [--rdzv-host HOST] [--node-rank N]

It reads ``jobspec.json``, prepares the environment (network interfaces, the torch 2.13
rendezvous fix, tuned rendezvous timeouts), and runs torch's elastic agent in-process with
``MIN:MAX`` nodes and c10d rendezvous on the first node. It owns the node's signals: the
warning signal (SIGUSR2 by default) and SIGTERM are *forwarded* to the workers while the
agent stays alive, so the workers can agree, save a checkpoint and exit cleanly (torch's
agent would otherwise kill them on SIGTERM). When the agent is done, node 0's launcher
records why the allocation ended in ``outcomes.jsonl``.

Planning (what to set, what to run) is pure (:func:`runtime.launch.plan.plan_launch`); :func:`run` executes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc.contract import diskspace, jobdir
from hpc.contract import environment as job_env
from hpc.contract.environment import JobEnvironment
from hpc.contract.events import read_events
from hpc.contract.jobpaths import JobPaths
from hpc.contract.jobspec import JobSpec
from hpc.contract.slurm import SlurmClient, SlurmError
from hpc.contract.slurm_parse import expand_hostlist
from runtime.env import SlurmEnv, rendezvous_host
from runtime.events import EventLog, LauncherRecorder
from runtime.liveness.proc import forget_stale_orders
from runtime.liveness.watchdog import Watchdog, heartbeat_dir
from runtime.launch.parent_watch import GRACE_S, watch_parent
from runtime.launch.network import NetworkError, detect
from runtime.launch.save_watch import SaveWatch
from runtime.console import NOTE, ConsoleFormatter, RankTee, console_level, verbose_from_env
from runtime import exclusions, peer_sockets, stop_deadline, stopping, succession
from runtime.ending import outcome
from runtime import node_files
from runtime.launch import agent as launch_agent, recovery as launch_recovery
from runtime.launch import health, host_store, quorum, rdzv_failure, rendezvous, spares, warm_start
from runtime.ending.outcome import EXIT_CODES, root_failure  # noqa: F401 - re-exported
from runtime.launch.forwarding import KEEP_SIGNAL, SignalForwarder, children as _children, kill_workers  # noqa: F401 - re-exported
from runtime.launch.plan import LaunchPlan, env_defaults, plan_launch, rdzv_port  # noqa: F401 - re-exported

log = logging.getLogger("hpc.launch")

# Tuned (measured on torch 2.13, docs/fault-tolerance.md) so a re-formed group is ready ~5 s after a node loss instead of ~30 s.
RDZV_CONF: dict[str, Any] = {
    "join_timeout": 600,
    "last_call_timeout": 2,
    "close_timeout": 5,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,
}



def rdzv_conf(max_nodes: int, join_timeout_s: int = RDZV_CONF["join_timeout"]) -> dict[str, Any]:
    """:data:`RDZV_CONF` for a job of up to ``max_nodes`` nodes (pure); ``join_timeout_s`` is
    the job's ``--rdzv-timeout``.

    torch's c10d rendezvous keeps its whole state (O(N)) in one key, rewritten by every node at
    each keep-alive and retried by compare-and-set at each join: the joins and keep-alives cost
    O(N^2) bytes (the 256-node simulation did not join within 120 s on 2 cores). Above ~200
    nodes the keep-alive slows to N/200 s, the join may take 0.1 s per node beyond 600 s, and
    the last call waits N/100 s for late joiners; up to 200 nodes it is :data:`RDZV_CONF`.
    """
    return dict(RDZV_CONF, join_timeout=int(join_timeout_s + 0.1 * max_nodes),
                keep_alive_interval=max(RDZV_CONF["keep_alive_interval"], round(max_nodes / 200)),
                last_call_timeout=max(RDZV_CONF["last_call_timeout"], round(max_nodes / 100)))


# A rendezvous store silent this long (from a node that is not its host): the host is lost.
STORE_LOST_S = host_store.STORE_LOST_S
YIELD_S = 10.0   # how long the fence waits for the main thread to take that restart


def _logs_specs(plan: LaunchPlan, tee: RankTee) -> Any:
    """Per-rank log files: ``logs/alloc-A/restart-K/rank-R.log``; rank 0's is copied to the
    console by ``tee`` (filtered, :mod:`runtime.console`), not by torch's tee."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class HpcLogsSpecs(LogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=str(plan.log_dir))
            self.paths: dict[int, Path] = {}      # global rank -> its current log file

        @property
        def root_log_dir(self) -> str:
            return str(plan.log_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            dest = LogsDest()
            for local_rank, wenv in envs.items():
                restart = int(wenv.get("TORCHELASTIC_RESTART_COUNT", "0"))
                rank = int(wenv["RANK"])
                path = jobdir.rank_log(plan.job_dir, plan.allocation, restart, rank, plan.epoch)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.paths[rank] = path
                dest.stdouts[local_rank] = str(path)
                dest.stderrs[local_rank] = ""
                dest.error_files[local_rank] = str(path.with_suffix(".error.json"))
                wenv["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
                if rank == 0:
                    tee.follow(path, f"[rank{rank}]: ")
            return dest

    return HpcLogsSpecs()




def run(plan: LaunchPlan, forwarder: SignalForwarder, *, lost_epoch: int | None = None,
        tee: RankTee | None = None, adopt: dict[int, int] | None = None) -> int:
    """Runs the elastic agent for ``plan`` (again, with a new rendezvous host, when the old one
    is lost and a majority survives: :mod:`runtime.succession`); returns the exit status.
    ``adopt``: the workers this launcher kept through the old host's loss (in-process
    recovery, :mod:`runtime.inprocess.launcher.adopt`): the new epoch's agent takes them."""
    tee = tee or RankTee(sys.stdout, verbose=verbose_from_env(os.environ))
    for change in plan.env_changes:
        log.info("env %s", change.describe())
    os.environ.update(plan.worker_env)
    for name in plan.worker_unset:
        os.environ.pop(name, None)
    slurm = SlurmEnv.from_env(os.environ)
    order = expand_hostlist(slurm.nodelist) if slurm.active else []
    me = socket.gethostname()
    board = succession.Board(plan.job_dir, plan.allocation)
    epoch = board.current() if slurm.active else None
    if epoch is None or me not in order:
        epoch = succession.epoch_zero(plan.rdzv_endpoint.rsplit(":", 1)[0], order)
        if slurm.active and plan.is_rdzv_host and plan.launchers > 1:
            board.publish(epoch)
    elif epoch.index > 0 and me in epoch.members:
        plan = _plan_for_epoch(plan, epoch, me)   # restarted, or joining later: the current host
    epochs: list[str] = []
    pending = None
    launch_recovery.begin(adopt)
    stale = forget_stale_orders()   # environments of workers killed before they could remove them
    if stale:
        log.info("removed %d record(s) of ended processes from %s", len(stale), node_files.private_dir())
    if lost_epoch is None:
        _slow_join_for_tests(plan)
    if lost_epoch is not None:   # this launcher was restarted to leave a stuck agent behind
        pending = outcome.AgentEnd("rendezvous", f"lost the rendezvous host {epoch.host}", time.time())
    warm = _fork_server(plan)
    try:
        return _epochs(plan, forwarder, tee, board, slurm, order, me, epoch, epochs, pending, adopt, warm)
    finally:
        if warm is not None:
            warm.close()


def _fork_server(plan: LaunchPlan) -> warm_start.ForkServer | None:
    """This launcher's fork server, started now (its imports overlap the rendezvous), or None:
    off (``HPC_WARM_START=0``), or a command that is not a worker's."""
    argv = [sys.executable, *plan.argv]
    if not warm_start.enabled(os.environ) or not warm_start.worker_command(argv):
        return None
    server = warm_start.ForkServer(sys.executable, plan.spec.script, os.environ)
    server.start()
    return server


def _epochs(plan: LaunchPlan, forwarder: SignalForwarder, tee: RankTee, board: succession.Board,
            slurm: SlurmEnv, order: list[str], me: str, epoch: Any, epochs: list[str],
            pending: outcome.AgentEnd | None, adopt: dict[int, int] | None,
            warm: warm_start.ForkServer | None) -> int:
    """The agent's runs, one per rendezvous epoch, and the launcher's exit status."""
    while True:
        end = pending or _run_agent(plan, forwarder, epoch.index, board if slurm.active else None,
                                    members=len(epoch.members), tee=tee, names=epoch.members,
                                    adopt=adopt, warm=warm)
        if pending is None:   # adopt: taken by that agent; kept: kept by it for the next epoch
            adopt = launch_recovery.carried(end, adopt)
        pending = None
        nxt = _next_epoch(plan, forwarder, end, epoch, board, order, me) if slurm.active else None
        if nxt is None:
            break
        epochs.append(f"epoch {nxt.index}: {nxt.reason}, new host {nxt.host}")
        plan, epoch = _plan_for_epoch(plan, nxt, me), nxt
    launch_recovery.abandon(plan, epoch.host, end, adopt)   # kept, but no new epoch takes them
    end.extra["epochs"] = epochs
    lost_batch_host = bool(order) and order[0] not in epoch.members
    return outcome.finish(plan, forwarder, end, batch_host_lost=lost_batch_host)


def _slow_join_for_tests(plan: LaunchPlan) -> None:
    """``HPC_TEST_SLOW_JOIN=N:SECONDS`` (``--env``): node rank N's launcher joins the
    rendezvous SECONDS late, a node slow to start (tests: the host must wait for it)."""
    raw = os.environ.get("HPC_TEST_SLOW_JOIN", "")
    rank, _, seconds = raw.partition(":")
    if rank.isdigit() and int(rank) == plan.node_rank and plan.allocation == 0:
        log.warning("HPC_TEST_SLOW_JOIN: joining the rendezvous %ss late", seconds)
        time.sleep(float(seconds))


def _disk_full(plan: LaunchPlan) -> str | None:
    """The full disk under the job or checkpoint directory, if one is (restarts are futile)."""
    for path in dict.fromkeys((plan.job_dir, Path(plan.spec.resolved_checkpoint_dir))):
        if diskspace.is_full(path):
            return f"the disk is full (ENOSPC): {diskspace.describe(path)}"
    return None


def _futile(plan: LaunchPlan, result: Any) -> str | None:
    """Why failed workers would only fail again, or None (then the restarts are for them):
    a full disk, a checkpoint directory that is no directory, an error no restart fixes."""
    full = _disk_full(plan)
    if full:
        return full
    ckpt = Path(plan.spec.resolved_checkpoint_dir)
    if ckpt.is_symlink() and not ckpt.exists():
        return f"the checkpoint directory {ckpt} is a dangling symlink"
    nearest = next((p for p in (ckpt, *ckpt.parents) if p.exists()), None)
    if nearest is not None and not nearest.is_dir():
        what = "" if nearest == ckpt else f" ({nearest} is a file)"
        return f"the checkpoint directory {ckpt} cannot be a directory{what}"
    return outcome.permanent_failure(getattr(result, "failures", None) or {})


class _Startups:
    """The allocation's failed starts: a script that fails the same way before any step is
    not started again (:func:`~runtime.ending.outcome.startup_failure`)."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.previous: str | None = None

    def futile(self, result: Any) -> str | None:
        failures = getattr(result, "failures", None) or {}
        if not failures:
            return None
        seen = {e.get("ev") for e in read_events(self.plan.job_dir) if e.get("alloc") == self.plan.allocation}
        stepped = "first_step" in seen if "session_start" in seen else None   # None: no Session
        why, self.previous = outcome.startup_failure(failures, stepped=stepped, previous=self.previous)
        return why


def _run_agent(plan: LaunchPlan, forwarder: SignalForwarder, epoch: int,
               board: succession.Board | None, members: int = 0,
               tee: RankTee | None = None, names: Sequence[str] = (),
               adopt: dict[int, int] | None = None,
               warm: warm_start.ForkServer | None = None) -> outcome.AgentEnd:
    """One run of torch's elastic agent (one rendezvous epoch), with the stall watch and, under
    Slurm, the fence: a newer epoch decided without this node stops its workers. ``names``:
    the epoch's members by node rank (Slurm's host names; none under hpc run); ``adopt``:
    workers kept through the old host's loss, taken by the first round instead of started."""
    from torch.distributed.launcher.api import elastic_launch

    spec = plan.spec
    tee = tee or RankTee(sys.stdout, verbose=verbose_from_env(os.environ))
    job_env.JobEnvironment(rdzv_epoch=epoch).export(os.environ)
    recovery = launch_recovery.for_run(   # the job's --recovery: the one seam
        plan, epoch=epoch, board=board, names=names, adopt=adopt,
        stopping=lambda: bool(forwarder.received) or (fence is not None and fence.acted),
        keep_allowed=lambda: not forwarder.received)
    recovery.prepare()
    join_timeout_s = rdzv_conf(plan.nnodes[1], spec.rdzv_timeout_s)["join_timeout"]
    instead = _host_gone(plan, join_timeout_s) \
        or recovery.instead_of_agent(relaunch=lambda: _restart_launcher([], epoch))
    if instead is not None:
        return instead
    recovery.start()
    logs_specs = _logs_specs(plan, tee)

    def why(failures: Any) -> str:
        rank, failure = outcome.root_failure(failures)
        return outcome.failure_reason(rank, failure, outcome.read_tail(logs_specs.paths.get(rank)))

    def on_restart(failures: Any, restart: int, of: int) -> None:
        tee.drain()
        log.warning("%s: starting the workers again (restart %d of %d)", why(failures), restart, of)
    config = _launch_config(plan, logs_specs, expected=members if board is not None and members
                            else plan.launchers)
    watchdog, fence = _watches(plan, board, epoch, members, recovery, forwarder)
    below_min = quorum.start(plan) if board is not None and fence is not None and plan.is_rdzv_host else None
    joining = EventLog(plan.job_dir, allocation=plan.allocation, node_rank=plan.node_rank, sync_every_s=0)
    joining.emit(rdzv_failure.JOIN_EVENT, epoch=epoch)   # which nodes arrived, if the round times out
    joining.close()
    started = time.time()
    startups = _Startups(plan)
    release = spares.SpareRelease()
    reason, result, exit_codes = "", "succeeded", ()
    follow_node0 = False   # a rendezvous error while the host answered: node 0 records the end
    try:
        # Never restart workers inside a stopping allocation (runtime/stopping.py), nor on a
        # node a newer rendezvous epoch has fenced off.
        rules = launch_agent.StopRules(
            lambda: bool(forwarder.received) or (fence is not None and fence.acted),
            futile=lambda result: _futile(plan, result) or watchdog.repeated() or startups.futile(result),
            on_restart=on_restart)
        with launch_agent.installed(rules, recovery.agent_part()), release, warm_start.serving(warm):
            elastic_launch(config, sys.executable)(*plan.argv)
    except Exception as e:  # the agent's own end: a failed worker, a signal, the rendezvous...
        result, reason, exit_codes, follow_node0 = _agent_failed(
            e, plan, why=why, names=names, epoch=epoch, join_timeout_s=join_timeout_s,
            fenced=fence is not None and fence.acted, release=release)
    ended = time.time()
    tee.drain()    # rank 0's last lines (its traceback) before this launcher's verdict
    watchdog.stop()
    if forwarder.stop is not None:
        forwarder.stop.cancel()   # the workers ended: no time-limit SIGTERM now
    if fence is not None:
        fence.stop()
    recovery.stop()
    if fence is not None and fence.acted:   # (replaced: fenced off; else its host is lost)
        result, reason = ("fenced", fence.replaced) if fence.replaced is not None \
            else ("rendezvous", fence.host_lost)
    extra: dict[str, Any] = {"follow_node0": True} if follow_node0 else {}
    result, reason = recovery.settle(result, reason, extra, fence=fence, received=forwarder.received)
    if below_min is not None:
        below_min.stop()
        if below_min.short is not None and not (fence is not None and fence.acted):
            result, reason = "rendezvous", below_min.short   # a node failure: requeue
    return outcome.AgentEnd(result, reason, started, watchdog, exit_codes=exit_codes, ended=ended,
                            extra=extra)


def _watches(plan: LaunchPlan, board: succession.Board | None, epoch: int, members: int,
             recovery: Any, forwarder: SignalForwarder) -> tuple[Watchdog, _Fence | None]:
    """The run's stall watch (runtime/liveness: heartbeats in, stacks and SIGKILL of stuck
    workers out) and fence, started. The host's loss is watched for under hpc run too, whatever
    the recovery (no succession there: the job ends as a node failure instead of hanging on the
    silent store)."""
    watchdog = Watchdog.for_job(plan.job_dir, plan.spec.liveness, allocation=plan.allocation,
                                node_rank=plan.node_rank, rdzv_endpoint=plan.rdzv_endpoint,
                                run_id=plan.run_id, max_nodes=plan.launchers, local=plan.local)
    recovery.watch(watchdog, board=board, members=members, reachable=_controller_reachable)
    watchdog.start()
    fence = _Fence(board, epoch, members=members, is_host=plan.is_rdzv_host,
                   tracker=watchdog.beacon.tracker if watchdog.beacon is not None else None,
                   rdzv_endpoint=plan.rdzv_endpoint) if plan.launchers > 1 else None
    if fence is not None:
        fence.relaunch = lambda: not forwarder.received
        recovery.arm(fence, board)
        fence.start()
    return watchdog, fence


def _host_gone(plan: LaunchPlan, join_timeout_s: float) -> outcome.AgentEnd | None:
    """How this run ends before it starts when the rendezvous host is gone (None: it answers,
    or this node is the host). A node that arrives after the host gave up must not knock at a
    gone store for minutes."""
    if plan.is_rdzv_host or plan.launchers <= 1:
        return None
    gone = host_store.await_host(plan.rdzv_endpoint, timeout_s=join_timeout_s,
                                 ended=functools.partial(_host_ended, plan))
    if gone is None:
        return None
    log.error("%s", gone)
    ended = _host_ended(plan) is not None
    return outcome.AgentEnd("failed" if ended else "rendezvous", gone, time.time(),
                            ended=time.time(), extra={"follow_node0": True} if ended else {})


def _launch_config(plan: LaunchPlan, logs_specs: Any, *, expected: int) -> Any:
    """torch's ``LaunchConfig`` for this run; the first round from the known node list in O(N)
    store requests (runtime/launch/rendezvous.py) where it can be."""
    from torch.distributed.launcher.api import LaunchConfig

    spec = plan.spec
    rdzv = rendezvous.choose(node_rank=plan.node_rank, expected=expected, min_nodes=plan.nnodes[0],
                             max_nodes=plan.nnodes[1], spares=spec.spare_nodes,
                             configs=dict(rdzv_conf(plan.nnodes[1], spec.rdzv_timeout_s),
                                          is_host=plan.is_rdzv_host))
    if plan.rdzv_listen_fd is not None and plan.is_rdzv_host:
        rdzv = rendezvous.on_socket(rdzv, plan.rdzv_listen_fd)
    if rdzv.backend != "c10d":
        rendezvous.register()
    log.info("rendezvous: %s", rdzv.reason)
    handled_by_us = {f"SIG{spec.signal}", "SIGTERM"}
    return LaunchConfig(
        min_nodes=plan.nnodes[0], max_nodes=plan.nnodes[1], nproc_per_node=spec.nproc_per_node,
        run_id=plan.run_id, role="worker", rdzv_endpoint=plan.rdzv_endpoint, rdzv_backend=rdzv.backend,
        rdzv_configs=rdzv.configs, max_restarts=spec.max_restarts,
        monitor_interval=0.5, start_method="spawn", logs_specs=logs_specs,
        signals_to_handle=",".join(s for s in ("SIGINT", "SIGHUP", "SIGQUIT") if s not in handled_by_us),
    )


def _agent_failed(e: Exception, plan: LaunchPlan, *, why: Any, names: Sequence[str], epoch: int,
                  join_timeout_s: float, fenced: bool,
                  release: spares.SpareRelease) -> tuple[str, str, tuple[int, ...], bool]:
    """The run's result for the exception torch's agent ended with: (result, reason, the
    workers' exit codes, whether node 0 records the end)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    if isinstance(e, ChildFailedError):
        return "failed", why(e.failures), tuple(sorted({f.exitcode for f in e.failures.values()})), False
    if isinstance(e, SignalException):
        return "signal", f"launcher got {e.sigval.name}", (), False
    if isinstance(e, RendezvousError):
        if plan.is_rdzv_host:
            # The store lives here: not a lost host, a failure to requeue would only repeat.
            # A timeout names the nodes that did not join; anything else is this node's
            # problem (port in use, bad address).
            return "failed", rdzv_failure.explain(
                e, endpoint=plan.rdzv_endpoint, timeout_s=join_timeout_s, min_nodes=plan.nnodes[0],
                nodes=list(names) or [f"node {i}" for i in range(plan.launchers)],
                joined=rdzv_failure.joined(read_events(plan.job_dir), plan.allocation, epoch)), (), False
        if not fenced:
            # Another node: the host's loss only if its store does not answer (host_store.py).
            answered = rdzv_failure.explain_non_host(
                e, endpoint=plan.rdzv_endpoint, answered=host_store.answers(plan.rdzv_endpoint),
                timeout_s=join_timeout_s)
            if answered is not None:
                log.warning("%s", answered)
                return "failed", answered, (), True
        return "rendezvous", f"rendezvous failed: {e}", (), False
    # The agent itself failed (e.g. a full disk): still record why.
    if spares.was_released(release, e):   # a hot spare the job did not need (runtime/launch/spares.py)
        log.info("hot spare not needed: the job ended while this node waited (%s)", release.released)
        return "succeeded", "", (), False
    log.exception("the elastic agent failed")
    return "failed", f"the elastic agent failed: {type(e).__name__}: {e}", (), False


def _host_ended(plan: LaunchPlan) -> str | None:
    """The allocation's outcome as node 0 recorded it ("kind: reason"), if it has."""
    theirs = outcome.node0_outcome(plan.job_dir, plan.allocation, timeout_s=0)
    return None if theirs is None else f"{theirs.kind}: {theirs.reason}"


def _next_epoch(plan: LaunchPlan, forwarder: SignalForwarder, end: outcome.AgentEnd,
                epoch: succession.Epoch, board: succession.Board, order: list[str],
                me: str) -> succession.Epoch | None:
    """After the agent lost its rendezvous host: the epoch this node goes on in, or None."""
    if end.result != "rendezvous" or plan.is_rdzv_host or forwarder.received or plan.launchers < 2:
        return None
    end.extra.setdefault("store_lost_at", time.time())   # node 0's time to record counts from here
    # The host may simply have ended the allocation (a stop, an error): then follow its record.
    if outcome.node0_outcome(plan.job_dir, plan.allocation, timeout_s=2.0) is not None:
        return None
    if not _controller_reachable():
        end.result = "fenced"
        end.reason = (f"lost the rendezvous host {epoch.host} and Slurm's controller: this node is "
                      "the one cut off; it takes no part in a new epoch")
        return None
    log.warning("lost the rendezvous host %s (%s): electing a new one among the survivors",
                epoch.host, end.reason)
    election = succession.run_election(board, epoch, me, order=order, min_nodes=plan.nnodes[0])
    if outcome.node0_outcome(plan.job_dir, plan.allocation, timeout_s=0) is not None:
        return None
    if election.epoch is None:
        log.warning("no new rendezvous epoch: %s", election.reason)
        end.extra["succession"] = election.reason
        return None
    if me not in election.epoch.members:
        log.warning("epoch %d went on without this node (%s)", election.epoch.index, election.reason)
        end.result, end.reason = "fenced", f"epoch {election.epoch.index} went on without this node"
        return None
    log.warning("rendezvous epoch %d: host %s, members %s (%s)", election.epoch.index,
                election.epoch.host, ", ".join(election.epoch.members), election.reason)
    return election.epoch


def _plan_for_epoch(plan: LaunchPlan, epoch: succession.Epoch, me: str) -> LaunchPlan:
    """The same node's plan in a new epoch: the new host, a new run id, its rank among members."""
    port = plan.rdzv_endpoint.rsplit(":", 1)[1]
    base = plan.run_id.split("-e", 1)[0] if plan.epoch else plan.run_id
    return dataclasses.replace(plan, rdzv_endpoint=f"{epoch.host}:{port}",
                               is_rdzv_host=me == epoch.host, node_rank=epoch.members.index(me),
                               run_id=f"{base}-e{epoch.index}", epoch=epoch.index)


def _controller_reachable() -> bool:
    """Can this node reach Slurm's controller? (a cut-off node cannot)"""
    try:
        return SlurmClient(retry_total_s=5).ping()
    except SlurmError:
        return False


_ARGV: list[str] = []   # this launcher's arguments (main), to restart it as itself


def _restart_launcher(children: list[int], epoch: int, adopt: dict[int, int] | None = None) -> None:
    """Replaces this process with a fresh launcher that goes straight to the election.

    torch's agent cannot be interrupted while it blocks on a store whose host is cut off
    (minutes: its shutdown and re-rendezvous both talk to that store). The workers are
    already killed; the new image keeps the PID (Slurm's task, the batch script's srun) and
    starts with ``--lost-host EPOCH`` (and ``--adopt LR:PID,...``: the workers it kept,
    still its children, for in-process recovery).
    """
    deadline = time.monotonic() + 3.0
    while children and time.monotonic() < deadline:   # reap the killed workers
        for pid in list(children):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    children.remove(pid)
            except ChildProcessError:
                children.remove(pid)
        time.sleep(0.05)
    log.warning("restarting this launcher to elect a new rendezvous host (epoch %d's is lost)", epoch)
    logging.shutdown()
    args = [a for a in _ARGV if not a.startswith(("--lost-host", "--adopt"))]
    kept = launch_recovery.adopt_args(adopt)
    os.execv(sys.executable, [sys.executable, "-m", "runtime.launch", *args, f"--lost-host={epoch}", *kept])


class _Fence(threading.Thread):
    """Watches, once a second, for the rendezvous faults that no process exit reports.

    * A decision that left this node out (a newer epoch, or the others' election after they
      lost this node as their host): the survivors own the allocation, so stop.
    * On the rendezvous host: its peers stopped answering the store and they were a majority
      of the epoch, and Slurm's controller does not answer either: this node is the one cut
      off, so stop rather than re-form alone (MIN may allow it) next to the real survivors.
    * On any other node: the store has not answered for :data:`STORE_LOST_S`: the host is lost;
      end the agent (torch's own rendezvous would wait for the cut host for many minutes) and
      let the survivors elect a new one. Under ``--recovery inprocess`` that store also held
      the workers' membership: they cannot recover in place (a store request to a silent
      host may never return), so an ``inproc_fallback`` event says so and the restart path's
      succession takes over (under hpc run, without Slurm: ``board`` None, no succession,
      the job ends as a node failure instead of hanging).

    Stopping is: SIGKILL the workers, then restart this launcher into the election
    (``relaunch``), else SIGQUIT this process (torch's agent ends on it).
    """

    def __init__(self, board: succession.Board | None, epoch: int, *, members: int, is_host: bool,
                 tracker: Any = None, rdzv_endpoint: str = "") -> None:
        super().__init__(name="hpc-fence", daemon=True)
        self.board, self.epoch, self.members, self.is_host = board, epoch, members, is_host
        self.tracker = tracker        # runtime.liveness.beacon.PeerTracker, fed by the beacon
        self.rdzv_endpoint = rdzv_endpoint   # asked once more before the host is named lost
        self.on_host_lost: Any = None   # (why, why the workers are not kept) -> None: the recovery's record
        self.fell_back = False        # it recorded the recovery's fallback (on_host_lost)
        self.replaced: str | None = None
        self.host_lost: str | None = None
        self.relaunch: Any = None     # () -> bool: may this launcher restart itself now?
        self.keep: Any = None         # () -> (workers, why not): in-process workers kept, if they can be
        self.keep_now: dict[int, int] | None = None   # the workers to keep, for the main thread
        self._stop_event = threading.Event()

    @property
    def acted(self) -> bool:
        return self.replaced is not None or self.host_lost is not None

    def run(self) -> None:
        host = socket.gethostname()
        while not self._stop_event.wait(1.0):
            why = (self.board.fenced(self.epoch, host) if self.board is not None else None) \
                or self._majority_lost()
            if why is not None:
                self.replaced = why
            else:
                lost = self._store_lost()
                # The beacon's silence, confirmed by a request of its own (a loaded machine's
                # beacon may fall behind while the store still answers): no healthy job ended.
                if lost is not None and self.rdzv_endpoint and host_store.answers(self.rdzv_endpoint):
                    log.warning("%s, but it answers a request now: not lost", lost)
                    self.tracker.store_ok_at = time.monotonic()
                    lost = None
                self.host_lost = lost
            if self.acted:
                kept, why_not = self.keep() if self.host_lost is not None and self.keep is not None \
                    else ({}, None)
                relaunch = self.host_lost is not None and self.relaunch is not None and self.relaunch()
                if kept and why_not is None and relaunch:   # the workers live on into the election
                    why_not = self._yield_to_main(kept)   # returns only if the main thread did not take it
                if self.host_lost is not None and self.on_host_lost is not None:
                    self.fell_back = True
                    self.on_host_lost(self.host_lost, why_not)
                children = _children(os.getpid())   # first: a log write may block (a dead stdout reader)
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                log.warning("%s; stopping this node's workers and agent", self.replaced or self.host_lost)
                if relaunch:
                    _restart_launcher(children, self.epoch)   # does not return
                os.kill(os.getpid(), signal.SIGQUIT)   # torch's agent ends on it (SignalException)
                return

    def _yield_to_main(self, kept: dict[int, int]) -> str:
        """Asks the main thread (:data:`KEEP_SIGNAL`) to restart this launcher keeping ``kept``,
        breaking the main thread's requests to the lost store so that it gets to it; returns
        why not (then the workers are stopped, the restart path) if it did not within
        :data:`YIELD_S`."""
        self.keep_now = kept
        log.warning("%s; restarting this launcher into the election, keeping its workers %s",
                    self.host_lost, ", ".join(map(str, kept.values())))
        deadline = time.monotonic() + YIELD_S
        while time.monotonic() < deadline and self.keep_now is not None:
            broken = peer_sockets.break_connections_to(self.rdzv_endpoint) if self.rdzv_endpoint else 0
            signal.pthread_kill(threading.main_thread().ident, KEEP_SIGNAL)
            log.info("asked the main thread to restart (%d connection(s) to the lost store shut down)", broken)
            time.sleep(1.0)
        self.keep_now = None
        return (f"the launcher's main thread did not take the restart within {YIELD_S:.0f}s (blocked on "
                "the lost store): a new rendezvous host is elected and the workers start again from "
                "the last checkpoint")

    def exec_kept(self) -> None:
        """:data:`KEEP_SIGNAL`'s handler, on the main thread: the restart that keeps the workers."""
        if self.keep_now is not None:
            _restart_launcher([], self.epoch, adopt=self.keep_now)   # does not return

    def _store_lost(self) -> str | None:
        t, now = self.tracker, time.monotonic()
        gap, self._looked = now - getattr(self, "_looked", now) > 3.0, now
        if self.is_host or t is None or t.store_ok_at is None or gap:
            return None   # (back from a gap of its own, e.g. starved: the beacon's clock is stale too)
        silent = now - t.store_ok_at
        if silent < STORE_LOST_S:
            return None
        return f"the rendezvous store has not answered for {silent:.0f}s: its host is lost"

    def _majority_lost(self) -> str | None:
        t = self.tracker
        if not self.is_host or t is None or self.members < 2 or self.board is None:
            return None
        now = time.monotonic()
        lost = t.lost(now)
        left = self.members - t.out_of_sight(now)   # lost, or unseen behind a lost watcher
        if not lost or left * 2 > self.members or _controller_reachable():
            return None
        names = ", ".join(t.name(r) for r in lost)
        return (f"cut off: {left} of {self.members} nodes left here (lost {names}) and Slurm's "
                "controller does not answer; the others may go on without this node")

    def stop(self) -> None:
        self._stop_event.set()


def slurm_deadlines(env: Mapping[str, str]) -> tuple[float | None, float | None]:
    """(wall time of the job's time limit, the partition's preemption GraceTime in s), if known."""
    slurm = SlurmEnv.from_env(env)
    if not slurm.active:
        return None, None

    client = SlurmClient(env, retry_total_s=20)
    try:
        info = client.show_job(slurm.job_id)
    except SlurmError as e:
        log.warning("cannot read job %s (%s): a warning signal will be taken as the time limit's",
                    slurm.job_id, e)
        return None, None
    end = time.time() + info.time_limit_s - info.run_time_s if info.time_limit_s else None
    grace = None
    try:
        grace = float(client.show_partition(info.partition).grace_time_s or 0) or None
    except SlurmError as e:
        log.warning("cannot read partition %s's GraceTime (%s)", info.partition, e)
    return end, grace


def _setup_logging(plan: LaunchPlan, verbose: bool) -> None:
    """Everything (INFO and up, torch's agent included) to ``node-HOST.log``; to the console
    (stderr) what matters (NOTE and up, :mod:`runtime.console`), everything with ``verbose``."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [hpc launch node {plan.node_rank}] %(levelname)s %(message)s")
    to_file = logging.FileHandler(JobPaths(plan.job_dir).node_log(plan.allocation, socket.gethostname()))
    to_file.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(console_level(verbose))
    multi = plan.launchers > 1
    console.setFormatter(fmt if verbose else ConsoleFormatter(f"hpc node {plan.node_rank}" if multi else "hpc"))
    root = logging.getLogger()
    root.addHandler(to_file)
    root.addHandler(console)
    root.setLevel(logging.INFO)
    # torch's agent reports what our own lines say better (a worker failed, its peers were
    # stopped): its log goes to the file; to the console only with verbose.
    for noisy in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logger = logging.getLogger(noisy)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
        logger.handlers = [to_file] + ([console] if verbose else [])


def started_line(plan: LaunchPlan, env: Mapping[str, str]) -> str:
    """The console's one line that the job started: world size, job dir, W&B run (pure)."""
    spec = plan.spec
    lo, hi = plan.nnodes
    nodes = f"{hi} node{'s' if hi > 1 else ''}" if lo == hi else f"{lo}:{hi} nodes"
    world = str(hi * spec.nproc_per_node) if lo == hi else \
        f"{lo * spec.nproc_per_node}-{hi * spec.nproc_per_node}"
    procs = f"{spec.nproc_per_node} process{'es' if spec.nproc_per_node > 1 else ''}"
    if spec.spare_nodes:
        procs += f", + {spec.spare_nodes} hot spare node{'s' if spec.spare_nodes > 1 else ''}"
    mode = env.get("WANDB_MODE", spec.wandb_mode)
    wandb = "W&B off" if mode == "disabled" else \
        f"W&B run {env.get('WANDB_RUN_ID', '?')} ({mode}, in {env.get('WANDB_DIR', plan.job_dir)}/wandb)"
    return (f"started {Path(spec.script).name}: world {world} ({nodes} x {procs}); "
            f"job dir {plan.job_dir}; {wandb}")


def _health_check(plan: LaunchPlan, slurm: SlurmEnv, network_problem: str | None) -> int | None:
    """The pre-join health check (:mod:`runtime.launch.health`); an exit status when this node must
    not join (it leaves, or cannot run at all), None to go on."""
    host = socket.gethostname()
    findings = health.run_checks(plan.job_dir, host=host, node_rank=plan.node_rank,
                                 gpus_per_node=plan.spec.gpus_per_node,
                                 network_problem=network_problem, env={**os.environ, **plan.worker_env})
    failed = [f for f in findings if not f.ok]
    log.info("health check: %s", "; ".join(f.describe() for f in findings))
    if not failed:
        return None
    why = "; ".join(f"{f.check}: {f.detail}" for f in failed)
    if not plan.local:   # hpc run: one machine, nothing to exclude
        exclusions.add(plan.job_dir, host, "health", why, plan.allocation)
    nodes = slurm.nnodes if slurm.active else plan.launchers
    if not plan.is_rdzv_host and health.claim_leave(plan.job_dir, plan.allocation, nodes=nodes,
                                                    min_nodes=plan.nnodes[0], host=host):
        log.error("health check failed (%s): this node leaves the job; the other nodes go on "
                  "without it (MIN %d of %d nodes)", why, plan.nnodes[0], nodes)
        return 0
    if network_problem is not None:
        log.error("health check failed (%s) and the job needs this node: cannot start", why)
        return EXIT_CODES["app_error"]
    log.error("health check failed (%s); this node joins anyway: %s", why,
              "it hosts the rendezvous" if plan.is_rdzv_host else
              f"the job needs at least {plan.nnodes[0]} of its {nodes} nodes")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.launch", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--job-dir", required=True, help="job directory holding jobspec.json")
    p.add_argument("--rdzv-host", default=None,
                   help="host of the c10d rendezvous (default: HPC_RDZV_HOST, else the "
                        "allocation's first node, else 127.0.0.1)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's index (default: SLURM_NODEID, else 0)")
    p.add_argument("--rdzv-port", type=int, default=None, help="rendezvous port (default: the spec's)")
    p.add_argument("--run-id", default=None, help="rendezvous id (default: the Slurm job id)")
    p.add_argument("--local", action="store_true",
                   help="all nodes are on this machine (hpc run): loopback rendezvous is fine")
    p.add_argument("--rdzv-listen-fd", type=int, default=None,
                   help="an inherited socket, bound and listening on the rendezvous port, for this "
                        "node's store to serve on (hpc run: node 0)")
    p.add_argument("--lost-host", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--adopt", default=None, help=argparse.SUPPRESS)   # LR:PID,...: workers kept
    args = p.parse_args(argv)
    _ARGV[:] = [a for a in (sys.argv[1:] if argv is None else argv)]

    job_dir = Path(args.job_dir).absolute()
    args.rdzv_host = rendezvous_host(os.environ, args.rdzv_host or "")
    spec = JobSpec.load(job_dir)
    if args.rdzv_port:
        spec = spec.replace(rdzv_port=args.rdzv_port)
    slurm = SlurmEnv.from_env(os.environ)
    node_rank = args.node_rank if args.node_rank is not None else slurm.node_id
    run_id = args.run_id or (f"{slurm.job_id}-{slurm.restart_count}" if slurm.active else uuid.uuid4().hex[:12])
    network_problem = None
    try:
        _, changes = detect(args.rdzv_host, multi_node=spec.allocated_nodes > 1 and not args.local,
                            env=os.environ)
    except NetworkError as e:
        print(f"hpc launch: no usable network interface on {socket.gethostname()}: {e}", file=sys.stderr)
        network_problem, changes = str(e), []
    extra = tuple(changes)
    known = job_env.JobEnvironment.from_env(os.environ)   # in a container: from the batch shell
    end, grace = (known.job_end_time, known.grace_s) if spec.container_image \
        else slurm_deadlines(os.environ)
    job_env.JobEnvironment(job_end_time=float(round(end)) if end else None,
                           grace_s=float(round(grace)) if grace else None).export(os.environ)
    plan = plan_launch(spec, job_dir, os.environ, rdzv_host=args.rdzv_host, node_rank=node_rank,
                       run_id=run_id, extra_changes=extra)
    plan = dataclasses.replace(plan, local=args.local, rdzv_listen_fd=args.rdzv_listen_fd)
    verbose = verbose_from_env(os.environ)
    _setup_logging(plan, verbose)
    log.info("node %d of %s on %s, rendezvous %s, run id %s", node_rank, spec.nodes_text,
             socket.gethostname(), plan.rdzv_endpoint, run_id)
    if plan.is_rdzv_host and args.lost_host is None:
        log.log(NOTE, "%s", started_line(plan, {**os.environ, **plan.worker_env}))
    if args.lost_host is None:
        left = _health_check(plan, slurm, network_problem)
        if left is not None:
            return left
    forwarder = SignalForwarder(tuple({signal.Signals["SIG" + spec.signal], signal.SIGTERM}))
    # On a warning, node 0's launcher asks Slurm for the real deadline (bounded); the other
    # nodes take it from its notice. No Slurm commands in a container: the assumption.
    asks = slurm.active and not spec.container_image
    forwarder.stop = stopping.StopTracker(
        stopping.notice_path(job_dir, plan.allocation), allocation=plan.allocation,
        job_end_time=end or JobEnvironment.from_env(os.environ).job_end_time,
        lead_s=spec.signal_lead_s, grace_s=grace, enforce=True,
        ask_slurm=functools.partial(stop_deadline.ask_slurm, slurm.job_id)
        if asks and node_rank == 0 else None,
        restarts=slurm.restart_count if slurm.active else None,
        follow=asks and node_rank != 0, under_slurm=slurm.active,
        # hpc run: nobody else kills workers that outlive a SIGTERM (under Slurm, KillWait)
        kill_workers=None if slurm.active else
        functools.partial(kill_workers, os.getpid(), os.getppid() if args.local else None),
        kill_after_s=float(os.environ.get("HPC_TEST_KILL_AFTER_S") or stopping.KILL_AFTER_S),
        still_saving=None if slurm.active else
        SaveWatch(Path(spec.resolved_checkpoint_dir), heartbeat_dir(os.getpid())))
    forwarder.install()
    if args.local:
        # hpc run died (PR_SET_PDEATHSIG sent SIGTERM): end for sure, but not in a save's middle
        watch_parent(os.getppid(), grace_s=float(os.environ.get("HPC_TEST_KILL_AFTER_S") or GRACE_S),
                     still_saving=SaveWatch(Path(spec.resolved_checkpoint_dir), heartbeat_dir(os.getpid())))
    if plan.is_rdzv_host and not diskspace.reserve(job_dir):
        log.warning("no room for the full-disk reserve: %s", diskspace.describe(job_dir))
    events = LauncherRecorder(job_dir, allocation=plan.allocation, node_rank=node_rank,
                              slurm_job_id=slurm.job_id)   # events.jsonl: the allocation's frame
    events.ready(spec.spare_nodes)
    tee = RankTee(sys.stdout, verbose=verbose)
    code = run(plan, forwarder, lost_epoch=args.lost_host, tee=tee,
               adopt=launch_recovery.parse_adopt(args.adopt))
    tee.close()
    events.end(code, forwarder.received)
    return code


if __name__ == "__main__":
    sys.exit(main())
