"""``hpc report JOB [--json] [--png PATH] [--html PATH]``: the goodput ledger of one job."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpc.contract import jobdir, values
from hpc.contract.errors import HpcError, SpecError
from hpc.contract.jobpaths import JobPaths


def add_parser(sub: argparse._SubParsersAction) -> None:
    rp = sub.add_parser("report", help="goodput: where a job's allocated node-time went (table, "
                                       "JSON, timeline picture)")
    rp.add_argument("job", help="job id or job directory (a directory works without Slurm)")
    rp.add_argument("--json", action="store_true", help="print the ledger as JSON")
    rp.add_argument("--png", default="", metavar="PATH", help="also draw the timeline to PATH (PNG)")
    rp.add_argument("--html", default="", metavar="PATH",
                    help="also write one self-contained page: timeline, table, JSON")


def main(args: argparse.Namespace) -> int:
    # Here, not at the top: `hpc --help` imports this module for add_parser only.
    from hpc.contract.events import read_events
    from hpc.report import inproc, plot
    from hpc.report.load import load
    from hpc.report.table import format_table, to_json

    path = Path(args.job).expanduser()
    if path.is_dir() and (jobdir.is_job_dir(path) or JobPaths(path).events.exists()):
        job_dir = path
        job_id = jobdir.read_slurm_job_id(path) or ""
    else:
        from hpc.contract.index import resolve   # the job index, Slurm's client: a job id only

        try:
            record = resolve(args.job)
        except SpecError:
            raise SpecError("JOB", args.job, "a Slurm job id submitted from here or a job directory "
                            "(one holding jobspec.json or events.jsonl)", "hpc report 1234") from None
        if not record.job_dir:
            raise SpecError("JOB", args.job, "a job submitted from here (its directory is in the "
                            "index) or a job directory", "hpc report jobs/train_gpt-...")
        job_dir, job_id = Path(record.job_dir), record.job_id
    events = read_events(job_dir)   # once: the ledger and the in-process story read the same
    ledger = load(job_dir, job_id, events=events)
    if not ledger.allocations:
        print(f"hpc report: no events in {job_dir} yet (events.jsonl appears when the job starts)",
              file=sys.stderr)
        return 1
    story = inproc.story(events)
    table = format_table(ledger, str(job_dir))
    if story:   # recoveries that kept the workers: the ledger's restarts do not show them
        table += "\n  in-process recoveries:\n" + "".join(f"    {line}\n" for line in story)
    if args.json:
        data = json.loads(to_json(ledger))
        data["inproc"] = story
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(values.printable(table))   # a record's text cannot steer the terminal
    for flag, path in (("--png", args.png), ("--html", args.html)):
        if not path:
            continue

        try:
            if flag == "--png":
                plot.render_png(ledger, Path(path), title=job_dir.name)
            else:
                plot.render_html(ledger, Path(path), title=job_dir.name, table=table)
        except ImportError as e:
            raise HpcError(f"{flag} needs matplotlib ({e}): pip install 'matplotlib>=3.7'") from None
        if not args.json:
            print(f"timeline: {path}")
    return 0
