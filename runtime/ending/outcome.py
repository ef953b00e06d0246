"""Why an allocation ended, recorded once, and what happens next (requeue, or end it).

The per-node launcher (:mod:`runtime.launch`) runs torch's elastic agent; when the agent is
done this module turns what happened into an outcome:

* :func:`classify` and :func:`root_failure` (pure): the agent's result and rank 0's exit
  intent -> the outcome kind, and the rank whose failure explains the others;
* :func:`finish`: amends the kind with what the stall watch, the stop tracker and the disk
  know, lets node 0 (the current rendezvous host) record it in ``outcomes.jsonl`` (a
  survivor records it when node 0 is gone), and requeues the job where the outcome calls
  for it, exactly once. When the allocation's batch host was lost (the survivors went on
  without it, :mod:`runtime.succession`), nothing else would end the allocation after the
  work, so the recorder does.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.contract import diskspace, jobdir
from hpc.contract.slurm import SlurmClient, SlurmError
from hpc.contract.slurm_parse import JobInfo, JobState, expand_hostlist
from runtime import exclusions, stopping
from runtime.console import NOTE, our_log_line
from runtime.env import SlurmEnv
from runtime.liveness.stragglers import read as read_stragglers
from runtime.ending.requeue import claim, decide_requeue, request_batch_requeue
from runtime.ending.resubmit import continue_as_new_job

if TYPE_CHECKING:
    from runtime.launch.forwarding import SignalForwarder
    from runtime.launch.plan import LaunchPlan

log = logging.getLogger("hpc.launch")

# Outcome kind -> the launcher's exit status (what Slurm and `hpc run` see).
EXIT_CODES = {"finished": 0, "app_error": 1, "preempted": 75, "time_limit": 75,
              "node_failure": 76, "cancelled": 130, "hang": 1}

# How long a node that lost the rendezvous store waits for node 0's own outcome record, counted
# from the loss (AgentEnd.extra["store_lost_at"]): a survivor's election for a new host (up to
# 10 s) is part of it. Counted from the election's end instead, a lost host that left no majority
# cost every survivor 25-27 s before the requeue (fault campaign, seed 3: 15 s of them here).
NODE0_OUTCOME_WAIT_S = 15.0


def node0_wait_s(extra: Mapping[str, Any], now: float) -> float:
    """What is left of :data:`NODE0_OUTCOME_WAIT_S` at ``now`` (pure)."""
    lost_at = extra.get("store_lost_at")
    if not isinstance(lost_at, int | float):
        return NODE0_OUTCOME_WAIT_S
    return max(0.0, min(NODE0_OUTCOME_WAIT_S, NODE0_OUTCOME_WAIT_S - (now - float(lost_at))))

# What a rank reports when *another* rank died and took its end of a connection with it (gloo,
# NCCL). Such an error can be recorded before the real one; it is never the cause to report.
COLLATERAL_ERRORS = (
    "typically caused by a remote worker crashing",
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
    "NCCL communicator was aborted",
)


@dataclass
class AgentEnd:
    """How one run of the elastic agent ended (one rendezvous epoch)."""

    result: str                  # succeeded, failed, signal, rendezvous, fenced
    reason: str
    started: float
    watchdog: Any = None         # runtime.liveness.watchdog.Watchdog (its verdict amends the kind)
    exit_codes: tuple[int, ...] = ()  # the failed workers' exit statuses
    extra: dict[str, Any] = field(default_factory=dict)
    ended: float | None = None   # wall time the agent saw its workers end


# What scontrol says when the cluster or the job forbids a requeue (JobRequeue=0, --no-requeue
# forced, PreemptMode=CANCEL). Any other failure (the job is already being requeued or ending,
# the controller is away) must not start a second job: only these continue as a new job.
REQUEUE_REFUSED = ("presently disabled", "not requeueable", "requeue is disabled")


def requeue_refused(stderr: str) -> bool:
    """True when ``scontrol requeue`` failed because requeueing is not allowed here (pure)."""
    text = stderr.lower()
    return any(m in text for m in REQUEUE_REFUSED)


def classify(result: str, intent: Mapping[str, Any] | None, allocation: int) -> str:
    """The allocation's outcome kind from the agent's result and rank 0's exit intent (pure)."""
    if result == "succeeded":
        if intent and intent.get("allocation") == allocation and intent.get("kind") in jobdir.OUTCOME_KINDS:
            return str(intent["kind"])
        return "finished"
    return {"failed": "app_error", "signal": "cancelled", "rendezvous": "node_failure"}[result]


# What a worker's error says when its filesystem refuses writes for good: a restart redoes the
# work since the last checkpoint and fails the same way (a probe on the test cluster: every restart spent).
PERMANENT_ERRORS = (
    "No space left on device",          # ENOSPC: a save larger than the room left (then freed)
    "Disk quota exceeded",              # EDQUOT: the filesystem has room, the user has none
    "Read-only file system",            # EROFS
)


def permanent_failure(failures: Mapping[int, Any]) -> str | None:
    """The first worker failure that a restart cannot fix, as ``rank R: message`` (pure).

    ``failures`` maps rank to torch's ``ProcessFailure``; the whole error (traceback
    included) is searched, the exception line is returned.
    """
    for rank, failure in sorted(failures.items()):
        text = str(failure.message)
        marker = next((m for m in PERMANENT_ERRORS if m in text), None)
        if marker:
            return f"rank {rank} failed with {marker!r} ({failure_message(failure.message)})"
    return None


USAGE_EXIT = 2   # argparse's (and the shell's) status for a command line it refused


def startup_failure(failures: Mapping[int, Any], *, stepped: bool | None,
                    previous: str | None) -> tuple[str | None, str | None]:
    """Why failed workers that never made a step would fail again at start-up (pure).

    A restart is for a fault that goes away. A script that refused its command line (status
    2), or that raised the same exception twice before any step, fails the same way each time
    it starts: the restarts would only spend the user's time. Infrastructure faults (a peer's
    broken connection, a death by signal, a node lost) are never judged so.

    Args:
        failures: Rank -> torch's ``ProcessFailure`` of the failed workers.
        stepped: Whether a step was made in this allocation (then the failure is no start-up's);
            None when it is not known (a script without the Session records no steps): then
            only the usage error is judged.
        previous: The signature this returned for the allocation's last failed start, if any.

    Returns:
        (the reason, or None when a restart may help; this failure's signature, for ``previous``).
    """
    if stepped or not failures:
        return None, None
    rank, failure = root_failure(failures)
    exitcode = getattr(failure, "exitcode", None)
    if exitcode == USAGE_EXIT:
        return (f"rank {rank} exited with status {USAGE_EXIT} (a usage error) before its first step",
                None)
    if stepped is None or not isinstance(failure.message, dict) \
            or any(m in str(failure.message) for m in COLLATERAL_ERRORS):
        return None, None   # no exception of the script's own: a signal, a peer's connection
    signature = f"{exitcode}: {failure_message(failure.message)}"
    if signature == previous:
        return (f"rank {rank} failed the same way twice before its first step "
                f"({failure_message(failure.message)})", signature)
    return None, signature


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The rank whose failure explains the others, and that failure (pure).

    The earliest failure whose message is not a peer's collateral connection error and that is
    not a death by SIGTERM (torch's agent sends it to the other workers once one failed, and
    their failures carry a timestamp as late as the real one's, to the second); when every
    failure is collateral, the earliest. A rank that wrote its own exception to its error file
    is never collateral, even when the agent's SIGTERM ended it while it was still exiting
    (its peer's broken connection was seen first). ``failures`` maps rank to torch's ``ProcessFailure``
    (``timestamp``, ``message``, ``exitcode``).
    """
    def key(item: tuple[int, Any]) -> tuple[bool, float, int]:
        rank, failure = item
        text = str(failure.message)
        stopped = terminated(failure) and not isinstance(failure.message, dict)
        return stopped or any(m in text for m in COLLATERAL_ERRORS), float(failure.timestamp), rank

    return min(failures.items(), key=key)


def terminated(failure: Any) -> bool:
    """Whether torch's agent (or anyone) ended this worker with SIGTERM (pure)."""
    return getattr(failure, "exitcode", None) == -signal.SIGTERM


def failure_message(message: Any) -> str:
    """The exception line from torch's error file (not its whole JSON with the traceback)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message).strip().splitlines()[-1] if str(message).strip() else "(no error message)"


# What torch's agent says of a worker that exited with a status but wrote no error file (a
# script that exits on a bad argument, sys.exit("...")): it names no cause.
TORCH_NO_ERROR_FILE = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
# Lines of a rank's output that are never the script's own last word.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_NOT_THE_ERROR = (
    re.compile(r"^\[[IW]\d{4} "),          # torch's C++ info and warning lines
    re.compile(r"^\[hpc worker\] "),       # the worker wrapper's own notes
    re.compile(r"^wandb: "),
    re.compile(re.escape(TORCH_NO_ERROR_FILE)),
)
TAIL_BYTES = 64 << 10


def last_error_line(output: str) -> str | None:
    """The script's own last meaningful line in a rank's output (pure): the error an
    ``argparse`` exit or ``sys.exit("...")`` printed, the last line of a traceback.

    Blank lines, torch's ``[rankN]:`` prefixes, its elastic boilerplate and C++ warnings, our
    own notes and W&B's lines are skipped.
    """
    for raw in reversed(output.splitlines()):
        line = _RANK_PREFIX.sub("", raw, count=1).strip()
        ours = our_log_line(line)
        if ours is not None and ours[0] < logging.WARNING:   # our own notes
            continue
        if line and not any(p.search(line) for p in _NOT_THE_ERROR):
            return line[:500]
    return None


def read_tail(path: Path | None, size: int = TAIL_BYTES) -> str:
    """The last ``size`` bytes of a file as text ("" when there is none)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def failure_reason(rank: int, failure: Any, output_tail: str = "") -> str:
    """Why a rank failed, in one line (pure): ``rank R exited with N: <the error>``.

    The error is the exception line of torch's error file (an uncaught exception) or, when the
    script wrote none (it exited with a status after printing its error), the last meaningful
    line of its own output, never torch's generic pointer to its documentation.
    """
    message = failure_message(failure.message)
    if terminated(failure) and isinstance(failure.message, dict):
        # It raised (its error file says so), then the agent's SIGTERM, sent to every worker
        # once a peer's failure was seen, ended it during its exit: the status is the agent's.
        return (f"rank {rank} raised {message} (then ended by SIGTERM while exiting, as the "
                "agent stopped the workers)")
    if TORCH_NO_ERROR_FILE in message or message == "(no error message)":
        message = last_error_line(output_tail) or (
            "(no error message; the script printed nothing that says why)")
    return f"rank {rank} exited with {failure.exitcode}: {message}".strip()


# A signal this close to the workers' end arrived as they were ending (the agent looks every 0.5 s).
ENDING_S = 2.0


def signals_note(received: list[tuple[float, str]], ended: float) -> str:
    """What a finished allocation says of the warning signals it got (pure).

    The work was done, so the workers did not stop for them: either the signal came as they
    were ending, or they went on (a script without a handler for the warning signal ignores
    it; the Session finishes instead of stopping at its last step). Which of the two is told
    by when it arrived, not assumed: a script that ignores the warning runs to its end.
    """
    names = ",".join(dict.fromkeys(n for _, n in received))
    first = min(t for t, _ in received)
    before = ended - first
    if before <= ENDING_S:
        return f"{names} arrived as the workers were ending ({before:.1f}s before)"
    return (f"{names} arrived {before:.0f}s before the workers ended; they did not stop for it "
            "and finished the work")


def node0_outcome(job_dir: Path, allocation: int, timeout_s: float) -> jobdir.Outcome | None:
    """Node 0's recorded outcome for this allocation, waiting up to ``timeout_s`` for it."""
    end = time.monotonic() + timeout_s
    while True:
        for o in jobdir.read_outcomes(job_dir):
            if o.allocation == allocation and o.kind != "node_failure":
                return o
        if time.monotonic() >= end:
            return None
        time.sleep(0.5)


OTHERS_FRESH_S = 8.0   # progress.json newer than this: the allocation trains on without us


def left_behind(job_id: str, host: str, client: "SlurmClient | None" = None) -> str | None:
    """Why this node, not node 0, is the one lost (None when it is still part of the job).

    A node whose link was cut loses the rendezvous store like the survivors lose it when node 0
    dies; what tells them apart is Slurm: the cut node cannot reach the controller (during the
    cut), or the controller no longer counts it in the running job (it marked it down and
    ``--no-kill`` kept the job on the others). Without this check a cut node that came back
    recorded a second, wrong outcome for an allocation that was still running.
    """
    try:
        info = (client or SlurmClient(retry_total_s=10)).show_job(job_id)
    except SlurmError as e:
        return f"cannot reach Slurm's controller ({e})"
    if info.state == JobState.RUNNING and info.nodes and host not in info.nodes:
        return f"Slurm no longer counts {host} in running job {job_id} (nodes {', '.join(info.nodes)})"
    return None


def others_went_on(progress: Mapping[str, Any] | None, allocation: int, now: float,
                   fresh_s: float = OTHERS_FRESH_S) -> str | None:
    """Why the rest of the allocation is still training without this node (None: no sign).

    Rank 0 rewrites ``progress.json`` at least every few seconds while it trains. When this
    node lost the rendezvous store and still sees fresh progress of its own allocation, the
    store's host is not lost: the others re-formed without this node (its link was cut and
    has come back before Slurm dropped it from the job, so Slurm still counts it). When the
    host really is lost, nobody has trained since the store went away (>= the store timeout
    plus the election), so the progress is stale.
    """
    if not progress or progress.get("allocation") != allocation:
        return None
    when = progress.get("time")
    if not isinstance(when, (int, float)) or now - when > fresh_s:
        return None
    return (f"the others are still training without this node (rank 0 at step {progress.get('step')}, "
            f"world {progress.get('world_size')}, {max(0.0, now - when):.1f}s ago)")


def cancelled_from(info: JobInfo, requeue_claimed: bool, restarts_at_start: int) -> bool:
    """Whether the job Slurm describes in ``info`` was cancelled by its user (pure).

    After ``scancel`` the job is CANCELLED, and while its processes (this launcher among
    them) are still ending, ``scontrol`` shows it as COMPLETING. A preempted job that saved in
    its grace time, or one warned of its time limit, is still RUNNING when we ask (SIGNALING,
    while Slurm still delivers the warning, reads as RUNNING). A preempted job whose exit
    outlasted its grace (a loaded node) is COMPLETING too, but Slurm says why: ``PreemptTime``
    is set, or Slurm has already requeued it (``Restarts`` above the count this allocation
    started with). So is a job one of our nodes has requeued (``requeue_claimed``).
    """
    if info.preempt_time is not None or info.restarts > restarts_at_start:
        return False
    if info.state == JobState.COMPLETING:
        return not requeue_claimed
    return info.state == JobState.CANCELLED


def cancelled_by_user(job_id: str, job_dir: Path, allocation: int, restarts_at_start: int) -> bool:
    """A SIGTERM from ``scancel`` looks like a preemption's; Slurm's job record tells them apart
    (:func:`cancelled_from`). An unreadable record counts as a preemption."""
    try:
        info = SlurmClient(retry_total_s=20).show_job(job_id)
    except SlurmError as e:
        log.warning("cannot read job %s's state (%s); treating the stop as a preemption", job_id, e)
        return False
    return cancelled_from(info, jobdir.claim_path(job_dir, allocation, "requeue").exists(),
                          restarts_at_start)


def finish(plan: LaunchPlan, forwarder: SignalForwarder, end: AgentEnd, *,
           batch_host_lost: bool = False) -> int:
    """Classifies, records (once) and requeues after the agent; returns the exit status."""
    spec = plan.spec
    if end.result == "fenced":
        # A newer rendezvous epoch went on without this node: the survivors own the allocation.
        log.warning("%s; this node stops and records nothing", end.reason)
        return EXIT_CODES["node_failure"]
    reason = end.reason
    intent = jobdir.read_json(plan.job_dir / jobdir.EXIT_INTENT)
    if intent and intent.get("time", 0) < end.started:
        intent = None
    kind = classify(end.result, intent, plan.allocation)
    hangs = None
    if end.watchdog is not None:
        kind, reason, hangs = end.watchdog.amend(kind, reason)   # "hang" when a stall ended it
    kind, reason = stopping.amend_outcome(kind, reason, forwarder.stop and forwarder.stop.notice,
                                          exit_codes=end.exit_codes,
                                          intent=intent if intent and intent.get("allocation") == plan.allocation
                                          else None)
    code = EXIT_CODES[kind]
    if intent and kind != "finished":
        reason = reason or str(intent.get("reason", ""))
    if kind != "finished":
        reason = diskspace.explain(plan.job_dir, reason)   # names ENOSPC when the disk is full
    if forwarder.received and kind == "finished":
        reason = signals_note(forwarder.received, end.ended or time.time())
    if end.extra.get("succession"):
        reason = "; ".join(x for x in (reason, end.extra["succession"]) if x)
    # On a batch job's console (its Slurm output) the outcome matters; hpc run says it itself.
    log.log(logging.INFO if plan.local else NOTE, "allocation %d ended: %s (exit %d) %s",
            plan.allocation, kind, code, reason)
    slurm = SlurmEnv.from_env(os.environ)
    if (kind == "node_failure" or end.extra.get("follow_node0")) and plan.node_rank != 0:
        # Node 0 hosts the rendezvous store: when it ends (a failure, a stop) the others lose
        # the store too. Only if node 0 records nothing was it really lost. (follow_node0: the
        # rendezvous failed here while its host answered, so the host records the end.)
        theirs = node0_outcome(plan.job_dir, plan.allocation, timeout_s=node0_wait_s(end.extra, time.time()))
        if theirs is not None:
            log.info("node 0 ended first (%s): following its outcome", theirs.kind)
            return theirs.exit_code
        me = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        progress = jobdir.read_json(jobdir.JobPaths(plan.job_dir).progress)
        if ((why := others_went_on(progress, plan.allocation, time.time()))
                or (slurm.active and not spec.container_image and (why := left_behind(slurm.job_id, me)))):
            # The failed node is this one (a cut link): the others went on and record it.
            log.warning("%s: the nodes that went on record this allocation; this node records nothing",
                        why)
            return code
    if (kind == "preempted" and slurm.active and not spec.container_image
            and cancelled_by_user(slurm.job_id, plan.job_dir, plan.allocation, slurm.restart_count)):
        kind, code = "cancelled", EXIT_CODES["cancelled"]
        reason = f"cancelled (scancel) while running; {reason}"
    decision = decide_requeue(kind, policy=spec.requeue, allocation=plan.allocation,
                              max_requeues=spec.max_requeues, under_slurm=slurm.active)
    # Node 0 records the outcome; when node 0 is gone (node failure), a survivor does, once.
    records = plan.node_rank == 0 or (
        kind == "node_failure" and claim(plan.job_dir, plan.allocation, "record"))
    if records:
        if slurm.active and not spec.container_image:   # no Slurm commands in a container
            _note_lost_nodes(plan, slurm)
        _record(plan, kind, code, reason, hangs, end, slurm)
    log.info("requeue: %s", decision.reason)
    if decision.requeue and spec.container_image and claim(plan.job_dir, plan.allocation):
        # No Slurm commands in a container: the batch shell requeues after srun returns.
        log.warning("requeue asked of the batch shell: %s",
                    request_batch_requeue(plan.job_dir, plan.allocation, decision.reason))
    elif decision.requeue and claim(plan.job_dir, plan.allocation):
        try:
            SlurmClient().requeue(slurm.job_id)
            log.warning("requeued job %s (%s)", slurm.job_id, decision.reason)
        except SlurmError as e:
            log.error("could not requeue job %s: %s", slurm.job_id, e)
            if requeue_refused(e.stderr or str(e)):   # the cluster forbids it: continue, once
                continue_as_new_job(plan.job_dir, spec, job_id=slurm.job_id,
                                    allocation=plan.allocation, reason=decision.reason,
                                    set_by_launcher=plan.worker_env)
    elif batch_host_lost and records and slurm.active and claim(plan.job_dir, plan.allocation, "end"):
        _end_allocation(slurm.job_id, kind)
    return code


def _record(plan: LaunchPlan, kind: str, code: int, reason: str, hangs: Any, end: AgentEnd,
            slurm: SlurmEnv) -> None:
    spec = plan.spec
    progress = jobdir.read_json(plan.job_dir / jobdir.PROGRESS) or {}
    if progress.get("allocation") != plan.allocation:
        progress = {}
    saved = jobdir.latest_checkpoint_step(Path(spec.resolved_checkpoint_dir))
    last = progress.get("step")
    if last is not None and saved is not None:  # progress.json lags by up to a few seconds
        last = max(last, saved)
    jobdir.append_outcome(plan.job_dir, jobdir.Outcome(
        allocation=plan.allocation, kind=kind, exit_code=code, reason=reason, step=saved,
        node=socket.gethostname(), slurm_job_id=slurm.job_id,
        restarts=int(progress.get("restart", 0)), world_size=int(progress.get("world_size", 0)),
        start_step=progress.get("start_step"), last_step=last,
        lost_steps=max(0, last - (saved or 0)) if last is not None else None, hangs=hangs or (),
        succession=tuple(end.extra.get("epochs", ())),
        excluded=tuple(ex.describe() for ex in exclusions.in_force(   # no Slurm commands in a container
            plan.job_dir, min_nodes=plan.nnodes[0], partition=slurm.partition,
            ask_slurm=not spec.container_image)),
        stragglers=tuple(s.summary() for s in read_stragglers(plan.job_dir, plan.allocation))))


def _note_lost_nodes(plan: LaunchPlan, slurm: SlurmEnv) -> None:
    """Nodes Slurm dropped from the running job (a crash, a cut link: ``--no-kill`` keeps the
    job on the others) are excluded from its next allocations."""
    try:
        info = SlurmClient(retry_total_s=10).show_job(slurm.job_id)
    except SlurmError as e:
        log.warning("cannot read job %s's nodes (%s): lost nodes are not excluded", slurm.job_id, e)
        return
    if info.state != JobState.RUNNING or not info.nodes:
        return
    for node in expand_hostlist(slurm.nodelist):
        if node not in info.nodes:
            exclusions.add(plan.job_dir, node, "lost", "Slurm dropped it from the running job "
                           "(a crash or a lost link)", plan.allocation)


def _end_allocation(job_id: str, kind: str) -> None:
    """The batch script died with its node: nothing else ends the allocation once the work is
    done, so the recorder cancels it (Slurm shows CANCELLED; the outcome says why it ended)."""
    try:
        SlurmClient().cancel(job_id)
        log.warning("ended allocation of job %s (%s; its batch host is gone)", job_id, kind)
    except SlurmError as e:
        log.error("could not end job %s after the work ended: %s", job_id, e)
