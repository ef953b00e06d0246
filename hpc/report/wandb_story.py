"""The job's story on its W&B run: the goodput ledger as a table, the timeline, faults as events.

The training loop logs its metrics to the job's one W&B run; what happened *to* the job
(allocations, preemptions, node losses, restarts, hangs, and where the node-time went) is in the
job directory (``events.jsonl``, ``outcomes.jsonl``: :mod:`hpc.report`). ``hpc sync`` puts it on
the same run before it uploads, written on the login node from those records, so nothing is
added to the training loop or its step time:

* ``hpc/goodput``: a ``wandb.Table`` with one row per allocation (nodes, how it ended, wall and
  node time, goodput, every ledger category in node-seconds, steps, lost steps, restarts, queue
  wait) and a last row for the whole job;
* ``hpc/timeline``: the timeline picture of ``hpc report --png`` as a ``wandb.Image``;
* ``hpc/events``: a table of every fault and recovery (signal, stop, failure, hang, restart, an
  allocation's start), and one history row per event with ``hpc/event/<kind>`` = 1 charted
  against ``hpc/at_step`` (``define_metric``): the training step it happened at, so it lines
  up with a loss curve drawn against the step;
* summary values ``hpc/goodput_pct``, ``hpc/lost_steps``, ``hpc/interruptions``.

It is written as one more offline segment of the run (``wandb.init(id=RUN, resume="allow")`` in
its own process: the login side never imports wandb), so ``hpc sync`` uploads it with the
others, last. It is written once the job has ended (its last outcome final, no folder still
being written): its rows come after the run's last step, where no later training row can land
below them (W&B's server drops a row whose step is lower than the run's). Keyed by the recorded
outcomes, a second ``hpc sync`` writes none, and an ended job run again gets a new one. The project and entity
are the run's own (read from its first offline segment), unless ``hpc sync --project`` says.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpc.contract import jobdir
from hpc.contract.errors import HpcError
from hpc.contract.jobpaths import JobPaths
from hpc.report import plot
from hpc.contract.ledger import CATEGORIES, Ledger
from hpc.report.load import load
from hpc.contract.wandb_records import run_project

EVENT_KINDS = ("signal", "stop", "failure", "hang", "restart")
EVENT_COLUMNS = ["allocation", "kind", "label", "time_s", "step"]
COLUMNS = ["allocation", "nodes", "ended", "wall_s", "node_s", "goodput_pct",
           *(f"{c}_s" for c in CATEGORIES), "start_step", "last_step", "lost_steps", "restarts",
           "queue_s"]


def step_at(steps: Sequence[tuple[float, int]], t: float) -> int | None:
    """The training step at wall time ``t`` (pure).

    The allocation's step curve is sparse (its progress records): between two points the step
    is interpolated (rounded down), unless the curve goes back there (a resume from an older
    step); past the last point it is the last step; before the first, None.
    """
    before = [(w, s) for w, s in steps if w <= t]
    after = [(w, s) for w, s in steps if w > t]
    if not before:
        return None
    (t0, s0), later = before[-1], after[:1]
    if later and later[0][1] >= s0 and later[0][0] > t0:
        t1, s1 = later[0]
        return int(s0 + (s1 - s0) * (t - t0) / (t1 - t0))
    return s0


def story(ledger: Ledger) -> dict[str, Any]:
    """The ledger as table rows, events and summary values (pure, JSON-ready).

    Times of events are on the picture's axis: allocated seconds, allocations back to back,
    queue waits cut out.
    """
    rows, events, offset = [], [], 0.0
    for a in ledger.allocations:
        good = a.categories["productive"] / a.node_s * 100 if a.node_s else 0.0
        rows.append([str(a.allocation), len(a.nodes), a.kind or "?", round(a.wall_s, 3),
                     round(a.node_s, 3), round(good, 2),
                     *(round(a.categories.get(c, 0.0), 3) for c in CATEGORIES),
                     a.start_step, a.last_step, a.lost_steps, a.restarts, a.queue_s])
        if a.allocation > 0 or a.start_step:
            events.append([a.allocation, "allocation",
                           f"allocation {a.allocation} started on {len(a.nodes)} node(s)"
                           + (f", from step {a.start_step}" if a.start_step is not None else ""),
                           round(offset, 3), a.start_step])
        for m in a.markers:
            if m.kind in EVENT_KINDS:
                events.append([a.allocation, m.kind, m.label, round(m.t - a.start + offset, 3),
                               step_at(a.steps, m.t)])
        offset += a.wall_s
    total = ledger.allocated_node_s
    rows.append(["all", max((len(a.nodes) for a in ledger.allocations), default=0),
                 ledger.allocations[-1].kind if ledger.allocations else "?",
                 round(sum(a.wall_s for a in ledger.allocations), 3), round(total, 3),
                 round(ledger.goodput * 100, 2),
                 *(round(ledger.categories.get(c, 0.0), 3) for c in CATEGORIES),
                 ledger.allocations[0].start_step if ledger.allocations else None,
                 ledger.allocations[-1].last_step if ledger.allocations else None,
                 ledger.lost_steps, sum(a.restarts for a in ledger.allocations), ledger.queue_s])
    return {"columns": COLUMNS, "rows": rows, "event_columns": EVENT_COLUMNS, "events": events,
            "summary": {"hpc/goodput_pct": round(ledger.goodput * 100, 2),
                        "hpc/lost_steps": ledger.lost_steps,
                        "hpc/interruptions": ledger.interruptions,
                        "hpc/allocated_node_s": round(total, 3)}}


def story_key(outcomes: Sequence[Any]) -> str:
    """What a story is written for: the recorded outcomes (one story per ended allocation)."""
    text = json.dumps([[o.allocation, o.kind, o.time] for o in outcomes])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


Runner = Callable[[list[str], float], None]


def run_writer(cmd: list[str], timeout_s: float) -> None:
    """Runs the writer (wandb in its own process, offline); raises :class:`HpcError` if it failed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_RUN")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise HpcError(f"writing the job's story into its W&B run took over {timeout_s:.0f} s") from None
    if r.returncode != 0:
        raise HpcError(f"writing the job's story into its W&B run failed (exit {r.returncode}): "
                       f"{(r.stdout + r.stderr).strip()[-800:]}")


def write(job_dir: Path, run_id: str, folders: Sequence[Path], *, ended: bool, project: str = "",
          entity: str = "", runner: Runner = run_writer, timeout_s: float = 120.0,
          out: Callable[[str], None] = print) -> str | None:
    """Writes the job's story as a new offline segment of ``run_id`` once the job has ended.

    Args:
        job_dir: The job directory.
        run_id: The job's W&B run id.
        folders: The run's offline folders so far, oldest first (the project is read from the
            first one).
        ended: Whether the job has ended (its last outcome is final) and every folder of the run
            is complete. Only then is the story written: its rows come after the run's last
            step, and a later allocation's rows, at lower steps, would be dropped by W&B's server.
        project, entity: Override the run's own.
        runner: Runs the writer command (tests may pass their own).
        timeout_s: Bound on the writer.
        out: Where the progress line goes.

    Returns:
        The new folder's name, or None when there was nothing new to tell.

    Raises:
        HpcError: the writer failed (nothing is recorded; the next sync tries again).
    """
    paths = JobPaths(job_dir)
    outcomes = jobdir.read_outcomes(job_dir)
    if not outcomes or not ended:
        return None            # told at the end (a rerun of an ended job adds outcomes: a new story)
    key = story_key(outcomes)
    state = jobdir.read_json(paths.wandb_story) or {}
    if state.get("run_id") == run_id and state.get("key") == key:
        return None
    ledger = load(job_dir, jobdir.read_slurm_job_id(job_dir) or "")
    if not ledger.allocations:
        return None
    if not project and folders:
        own_project, own_entity = run_project(folders[0] / f"run-{run_id}.wandb")
        project, entity = own_project, entity or own_entity
    paths.wandb_story_dir.mkdir(exist_ok=True, mode=0o700)
    png: str = ""
    try:
        png = str(plot.render_png(ledger, paths.wandb_story_dir / "timeline.png", title=Path(job_dir).name))
    except ImportError as e:   # matplotlib missing: the table and events still go
        out(f"hpc sync: no timeline picture ({e})")
    payload = {"run_id": run_id, "dir": str(job_dir), "project": project, "entity": entity,
               "png": png, "caption": f"{Path(job_dir).name}: goodput {ledger.goodput * 100:.1f}%",
               **story(ledger)}
    payload_path = paths.wandb_story_dir / "payload.json"
    jobdir.write_atomic(payload_path, json.dumps(payload, indent=1) + "\n")
    before = {f.name for f in paths.wandb_dir.glob("offline-run-*")}
    runner([sys.executable, "-m", "hpc.report.wandb_story", str(payload_path)], timeout_s)
    new = sorted(f.name for f in paths.wandb_dir.glob(f"offline-run-*-{run_id}*") if f.name not in before)
    jobdir.write_atomic(paths.wandb_story, json.dumps(
        {"run_id": run_id, "key": key,
         "folders": sorted(set(state.get("folders", []) if state.get("run_id") == run_id else []) | set(new))},
        indent=1) + "\n")
    out(f"hpc sync: the job's story ({len(ledger.allocations)} allocation(s), "
        f"{len(payload['events'])} event(s), goodput {ledger.goodput * 100:.1f}%) written into run "
        f"{run_id}" + (f" as {new[0]}" if new else ""))
    return new[0] if new else None


def write_offline(payload: dict[str, Any]) -> None:
    """In the writer's own process: one offline segment of the run with the story."""
    import wandb

    run = wandb.init(id=payload["run_id"], resume="allow", mode="offline", dir=payload["dir"],
                     project=payload["project"] or None, entity=payload["entity"] or None,
                     settings=wandb.Settings(console="off", init_timeout=90))
    run.define_metric("hpc/at_step")
    run.define_metric("hpc/event/*", step_metric="hpc/at_step")
    row: dict[str, Any] = {
        "hpc/goodput": wandb.Table(columns=payload["columns"], data=payload["rows"]),
        "hpc/events": wandb.Table(columns=payload["event_columns"], data=payload["events"])}
    if payload.get("png"):
        row["hpc/timeline"] = wandb.Image(payload["png"], caption=payload.get("caption", ""))
    run.log(row)
    for allocation, kind, label, time_s, step in payload["events"]:
        event: dict[str, Any] = {f"hpc/event/{kind}": 1, "hpc/event_time_s": time_s,
                                 "hpc/event_allocation": allocation}
        if step is not None:
            event["hpc/at_step"] = step
        run.log(event)
    run.summary.update(payload["summary"])
    run.finish()


if __name__ == "__main__":
    write_offline(json.loads(Path(sys.argv[1]).read_text()))
