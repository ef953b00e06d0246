"""``hpc status`` and ``hpc cancel``: what happened to a job, across its whole life.

A job that is preempted and requeued keeps its Slurm id but has several allocations. Slurm
alone says *that* each one ended (``sacct --duplicates``: REQUEUED, PREEMPTED, NODE_FAIL ...);
the job directory's ``outcomes.jsonl`` says *why* from inside (saved at step N and exited for
the time limit, application error on rank 3 ...). The table puts both side by side.

Politeness: many jobs cost ONE squeue and ONE sacct call, never one per job, and anything
that waits (``hpc logs -f``) polls through :class:`Poller`, which backs off to 30 s.

Everything except :func:`main`, :func:`cancel` and :meth:`Poller.poll` is pure: the view is
built from parsed records (:func:`build_views`) and formatted (:func:`format_table`) without
running anything, so the unit tests feed recorded Slurm output.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hpc import sweeps
from hpc.contract import jobdir, records, resubmissions, values
from hpc.contract.errors import UsageError
from hpc.contract.events import read_events
from hpc.contract.jobpaths import JobPaths
from hpc.contract.slurm import SlurmClient, SlurmError
from hpc.contract.slurm_parse import parse_job_state
from hpc.contract.index import JobRecord, current_cluster, read_index, resolve
from hpc.local_clock import LocalClock, read_local_clock
from hpc.contract import spare_waits
from hpc.report import inproc

if TYPE_CHECKING:
    from hpc.contract.slurm_parse import AccountingRecord, QueueEntry

RECENT = 10


@dataclass(frozen=True)
class Allocation:
    """One run of the job on some nodes: how Slurm saw it end and why it ended inside."""

    index: int
    slurm_state: str
    nodes: str
    elapsed_s: int
    exit_code: str = ""
    outcome: str = ""
    reason: str = ""
    step: int | None = None
    detail: str = ""

    def describe(self) -> str:
        inside = self.detail or (self.outcome + (f" at step {self.step}" if self.step is not None else "")
                                 + (f": {self.reason}" if self.reason else ""))
        return f"#{self.index} {self.slurm_state}" + (f" ({inside})" if inside else "")


@dataclass(frozen=True)
class JobView:
    """What ``hpc status`` shows for one job."""

    job_id: str
    name: str
    state: str
    nodes: str
    elapsed_s: int
    requeues: int
    job_dir: str = ""
    allocations: tuple[Allocation, ...] = field(default_factory=tuple)
    cluster: str = ""
    chain: str = ""   # "continues job N" / "continued as job M" (Slurm refused a requeue)
    spares: str = ""  # "hot spares: 1; node3 joined 41s in" (--spare-nodes, hpc.contract.spare_waits)

    @property
    def terminal(self) -> bool:
        return self.state != "UNKNOWN" and parse_job_state(self.state).is_terminal

    @property
    def label(self) -> str:
        """The JOB column: the id (``ID@CLUSTER`` for another cluster's job), ``local`` for
        ``hpc run``."""
        return (f"{self.job_id}@{self.cluster}" if self.cluster else self.job_id) or "local"


def _nodes_text(count: int, names: Sequence[str]) -> str:
    if not names:
        return str(count) if count else "-"
    return f"{len(names)} ({','.join(names)})"


def _with_live_allocation(allocs: list[Allocation], live: QueueEntry) -> list[Allocation]:
    """squeue says RUNNING: sacct (filled by slurmdbd a moment later) may still call the
    running allocation PENDING, or not list it yet after a requeue. squeue is the live truth."""
    nodes = ",".join(live.nodes)
    if allocs and allocs[-1].slurm_state == "PENDING":
        return [*allocs[:-1], replace(allocs[-1], slurm_state="RUNNING", nodes=allocs[-1].nodes or nodes)]
    if not allocs or allocs[-1].slurm_state != "RUNNING":
        return [*allocs, Allocation(index=len(allocs), slurm_state="RUNNING", nodes=nodes,
                                    elapsed_s=live.elapsed_s)]
    return allocs


def _view_from_outcomes(job: JobRecord, outcomes: Sequence[jobdir.Outcome], where: str,
                        clock: LocalClock | None = None, now: float = 0.0) -> JobView:
    """A job Slurm cannot tell us about (``hpc run``, or another cluster's): its outcomes, and
    for ``hpc run`` its allocations' times (``clock``; the running one's until ``now``)."""
    clock = clock or LocalClock()

    def took(alloc: int) -> int:
        span = clock.spans.get(alloc)
        return span.elapsed_s(now) if span is not None else 0

    allocs = [Allocation(index=o.allocation, slurm_state=where, nodes=o.node, elapsed_s=took(o.allocation),
                         outcome=o.kind, reason=o.reason, step=o.step, detail=o.describe())
              for o in outcomes]
    state = f"{where}: {outcomes[-1].kind}" if outcomes else f"{where}: no outcome yet"
    if clock.running is not None:
        allocs.append(Allocation(index=clock.running, slurm_state=where, nodes="",
                                 elapsed_s=took(clock.running), detail="running"))
        state = f"{where}: running"
    return JobView(job_id=job.job_id, name=job.name, state=state, nodes="-",
                   elapsed_s=allocs[-1].elapsed_s if allocs else 0,
                   requeues=max(0, len(allocs) - 1), job_dir=job.job_dir, allocations=tuple(allocs),
                   cluster=job.cluster if job.job_id and where != "local" else "")


def build_views(jobs: Sequence[JobRecord], queue: Mapping[str, QueueEntry],
                accounting: Sequence[AccountingRecord],
                outcomes: Mapping[str, Sequence[jobdir.Outcome]], cluster: str = "",
                clocks: Mapping[str, LocalClock] | None = None, now: float | None = None) -> list[JobView]:
    """Joins the index, squeue, sacct (with duplicates) and outcomes.jsonl into views (pure).

    Args:
        jobs: The jobs to show (id, directory, name, cluster).
        queue: squeue entries by job id (the live state; missing once Slurm forgets the job).
        accounting: sacct records, in sacct's order (allocations and steps).
        outcomes: outcomes.jsonl records by :attr:`JobRecord.key`.
        cluster: The cluster squeue and sacct answered for: another cluster's job with the same
            id is not this one, and is shown from its outcomes only.
        clocks: ``hpc run`` jobs' allocation times by :attr:`JobRecord.key`
            (:func:`~hpc.local_clock.read_local_clock`).
        now: The time a running local allocation's elapsed time runs to (default: now).
    """
    views = []
    now = time.time() if now is None else now
    for job in jobs:
        if not job.job_id or job.elsewhere(cluster):
            local = not job.job_id
            views.append(_view_from_outcomes(job, outcomes.get(job.key, ()),
                                             "local" if local else f"on {job.cluster}",
                                             (clocks or {}).get(job.key) if local else None, now))
            continue
        runs = [r for r in accounting if r.job_id == job.job_id and r.step is None]
        live = queue.get(job.job_id)
        by_alloc = {o.allocation: o for o in outcomes.get(job.key, ())}
        allocs = []
        started = [r for r in runs if r.start is not None]
        for i, r in enumerate(started):
            o = by_alloc.get(i)
            code = f"{r.exit_code[0]}:{r.exit_code[1]}" if r.exit_code else ""
            allocs.append(Allocation(
                index=i, slurm_state=r.raw_state.split()[0], nodes=",".join(r.nodes),
                elapsed_s=r.elapsed_s, exit_code=code, outcome=o.kind if o else "",
                reason=o.reason if o else "", step=o.step if o else None,
                detail=o.describe() if o else ""))
        if live is not None and live.raw_state == "RUNNING":
            allocs = _with_live_allocation(allocs, live)
        latest = runs[-1] if runs else None
        if live is not None:
            state, nodes = live.raw_state, _nodes_text(live.num_nodes, live.nodes)
            elapsed, name = live.elapsed_s, live.name
        elif latest is not None:
            state, nodes = latest.raw_state.split()[0], _nodes_text(len(latest.nodes), latest.nodes)
            elapsed, name = latest.elapsed_s, latest.name
        else:
            state, nodes, elapsed, name = "UNKNOWN", "-", 0, job.name
        views.append(JobView(job_id=job.job_id, name=name or job.name, state=state, nodes=nodes,
                             elapsed_s=elapsed, requeues=max(0, len(runs) - 1),
                             job_dir=job.job_dir, allocations=tuple(allocs)))
    if len({v.job_id for v in views if v.job_id}) < len([v for v in views if v.job_id]):
        # the same id from several clusters: say which is which
        views = [replace(v, cluster=v.cluster or cluster) for v in views]
    return views


def format_table(views: Sequence[JobView], width: int = 140) -> str:
    """The status table as text (rich), ``width`` columns wide (pure)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=None, show_lines=False, expand=False)
    for col in ("JOB", "NAME", "STATE", "NODES", "ELAPSED", "REQUEUES", "ALLOCATIONS (Slurm end, our outcome)"):
        table.add_column(col, overflow="fold")
    for v in views:
        history = "\n".join([*([v.chain] if v.chain else []), *([v.spares] if v.spares else []),
                             *(a.describe() for a in v.allocations)]) or "-"
        table.add_row(v.label, v.name, v.state, v.nodes, values.format_time(v.elapsed_s),
                      str(v.requeues), history)
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False).print(table)
    return out.getvalue()


def to_json(views: Sequence[JobView]) -> str:
    """Machine-readable status (pure)."""
    return json.dumps([asdict(v) for v in views], indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------- reading


def read_outcomes(jobs: Iterable[JobRecord]) -> dict[str, list[jobdir.Outcome]]:
    """outcomes.jsonl of every job whose directory we know, by :attr:`JobRecord.key`
    (unreadable ones are skipped). A job continued as a new Slurm job (where Slurm refused to
    requeue, :mod:`hpc.contract.resubmissions`) gets only its own allocations, numbered from 0
    as Slurm numbers them."""
    out: dict[str, list[jobdir.Outcome]] = {}
    for job in jobs:
        if job.job_dir:
            found = jobdir.read_outcomes(Path(job.job_dir))
            links = resubmissions.read(Path(job.job_dir)) if job.job_id else []
            if links:
                lo, hi = resubmissions.allocation_range(links, job.job_id)
                found = [replace(o, allocation=o.allocation - lo) for o in found
                         if o.allocation >= lo and (hi is None or o.allocation < hi)]
            out[job.key] = found
    return out


def _note(data: object) -> dict:
    """A straggler or hang record, as far as a running note needs it: an object with an integer
    allocation (the note shows whatever else the record holds, so a partial record still
    counts; a record of another shape is skipped and reported by the reader)."""
    if not isinstance(data, dict) or type(data.get("allocation", -1)) is not int:
        raise ValueError("not an object with an integer allocation")
    return data


def running_notes(job_dir: Path) -> str:
    """What the allocation still running found so far, from the job directory: stragglers
    (``stragglers.jsonl``) and recovered stalls (``hangs.jsonl``); "" when nothing."""
    paths = JobPaths(job_dir)
    ended = [o.allocation for o in jobdir.read_outcomes(job_dir)]
    first_open = max(ended) + 1 if ended else 0
    notes = [f"straggler: rank {r.get('rank')} on {r.get('node')} (node rank {r.get('node_rank')})"
             for r in records.read(paths.stragglers, _note) if r.get("allocation", -1) >= first_open]
    stalls = [h for h in records.read(paths.hangs, _note) if h.get("allocation", -1) >= first_open]
    if stalls:
        notes.append(f"{len(stalls)} stall(s) recovered so far, last on {stalls[-1].get('node')}")
    if paths.events.exists():   # recoveries that kept the workers (--recovery inprocess)
        recovered = inproc.note(read_events(job_dir), allocation=first_open)
        if recovered:
            notes.append(recovered)
    return "; ".join(notes)


def with_running_notes(view: JobView, notes: str) -> JobView:
    """Adds ``notes`` to the view's running allocation (one with no outcome yet) (pure)."""
    if not notes or not view.allocations:
        return view
    last = view.allocations[-1]
    if last.slurm_state != "RUNNING" or last.detail:
        return view
    return replace(view, allocations=(*view.allocations[:-1], replace(last, detail=notes)))


def _with_chain(view: JobView) -> JobView:
    """Says which job a continuation continues, and which job continued this one."""
    links = resubmissions.read(Path(view.job_dir)) if view.job_dir and view.job_id else []
    after = resubmissions.continued_as(links, view.job_id)
    before = next((link.previous for link in links if link.job_id == view.job_id), "")
    notes = ([f"continues job {before}"] if before else []) + \
        ([f"continued as job {after}"] if after else [])
    return replace(view, chain="; ".join(notes)) if notes else view


def collect(client: SlurmClient, jobs: Sequence[JobRecord], cluster: str | None = None) -> list[JobView]:
    """One squeue and one sacct call for all ``jobs`` of this cluster, joined with their
    outcomes (``hpc run`` jobs and other clusters' jobs cost no Slurm call)."""
    if cluster is None:
        cluster = current_cluster(client) if any(j.cluster for j in jobs) else ""
    ids = [j.job_id for j in jobs if j.job_id and not j.elsewhere(cluster)]
    queue = client.queue(ids)
    try:
        accounting = client.accounting(ids)
    except SlurmError:  # no accounting storage on this cluster: squeue is all we have
        accounting = ()
    clocks = {j.key: read_local_clock(Path(j.job_dir)) for j in jobs if not j.job_id and j.job_dir}
    views = [_with_chain(v) for v in build_views(jobs, queue, accounting, read_outcomes(jobs), cluster,
                                                 clocks)]
    return [with_running_notes(replace(v, spares=spares_note(Path(v.job_dir)) if v.job_dir else ""),
                               running_notes(Path(v.job_dir)) if v.job_dir and v.state == "RUNNING" else "")
            for v in views]


def spares_note(job_dir: Path) -> str:
    """The job's hot spares (``--spare-nodes``) and what became of them; "" without any."""
    try:
        spare_nodes = int(json.loads(JobPaths(job_dir).jobspec.read_text()).get("spare_nodes") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return ""
    if spare_nodes <= 0:
        return ""
    return spare_waits.describe(read_events(job_dir), spare_nodes)


class Poller:
    """Polls jobs politely: 1 s, then doubling to ``max_interval_s`` while nothing changes.

    Args:
        client: The Slurm client.
        jobs: The jobs to watch.
        max_interval_s: Longest wait between polls.
        sleep: The sleep function (tests pass a fake clock).
    """

    def __init__(self, client: SlurmClient, jobs: Sequence[JobRecord], *,
                 max_interval_s: float = 30.0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.client, self.jobs = client, list(jobs)
        self.max_interval_s, self.sleep = max_interval_s, sleep
        self.interval = 1.0
        self._last: list[tuple[str, int]] | None = None

    def poll(self) -> list[JobView]:
        """Polls now; resets the backoff when any state or requeue count changed."""
        views = collect(self.client, self.jobs)
        now = [(v.state, v.requeues) for v in views]
        self.interval = 1.0 if now != self._last else min(self.max_interval_s, self.interval * 2)
        self._last = now
        return views

    def wait(self) -> None:
        self.sleep(self.interval)


# --------------------------------------------------------------------------- commands


def _jobs_from_args(refs: Sequence[str], cluster: str = "") -> list[JobRecord]:
    if refs:
        return [resolve(r, cluster=cluster) for r in refs]
    latest: dict[str, JobRecord] = {}   # a job directory run again is one job, the latest run
    for record in read_index():
        latest.pop(record.key, None)
        latest[record.key] = record
    return list(latest.values())[-RECENT:]


def summarize_sweep(record: JobRecord, views: Sequence[JobView]) -> str:
    """One line for a sweep: its array id, task count and tasks per state (pure)."""
    counts: dict[str, int] = {}
    for v in views:
        counts[v.state] = counts.get(v.state, 0) + 1
    states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"sweep {record.job_id} ({record.name}): {len(views)} tasks: {states}\n"


def main(args: argparse.Namespace) -> int:
    """``hpc status [JOB...]``: a table of the given jobs (default: your recent ones).

    A sweep shows as one line of counts per state; named explicitly (``hpc status SWEEP``),
    its tasks follow, one row each.
    """
    client = SlurmClient()
    refs = [r for r in args.job if not Path(r).expanduser().is_dir()]   # ids need the cluster
    cluster = current_cluster(client) if refs else ""
    jobs = _jobs_from_args(args.job, cluster)
    if not args.job and any(j.job_id for j in jobs):   # only hpc run jobs: no Slurm needed
        cluster = current_cluster(client)
    if not jobs:
        print("hpc status: no jobs submitted or run from here yet (the index is in $HPC_HOME, default "
              "~/.hpc); pass job ids: hpc status 1234")
        return 0
    plain, summaries, as_json = [], [], getattr(args, "json", False)
    for job in jobs:
        tasks = sweeps.task_records(job)
        if not tasks:
            plain.append(job)
            continue
        task_views = collect(client, tasks, cluster)
        summaries.append(summarize_sweep(job, task_views))
        if args.job or as_json:
            plain.extend(tasks)
    views = collect(client, plain, cluster) if plain else []
    if as_json:
        print(to_json(views), end="")
        return 0
    print(values.printable("".join(summaries) + (format_table(views) if views else "")), end="")
    return 0


def cancel(args: argparse.Namespace) -> int:
    """``hpc cancel JOB...``: cancels each job through the Slurm client."""
    client = SlurmClient()
    cluster = current_cluster(client)
    for job in (resolve(r, cluster=cluster) for r in args.job):
        if not job.job_id:
            raise UsageError(f"{job.job_dir} is a job of hpc run, not a Slurm job: stop it with "
                             "Ctrl-C (or SIGTERM to its hpc run process)")
        if job.elsewhere(cluster):
            raise UsageError(f"job {job.job_id} ({job.job_dir}) was submitted to cluster "
                             f"{job.cluster}, and this is cluster {cluster}: job {job.job_id} "
                             "here is another job. Cancel it from that cluster")
        client.cancel(job.job_id)
        print(f"Cancelled job {job.job_id}" + (f" ({job.job_dir})" if job.job_dir else ""))
    return 0
