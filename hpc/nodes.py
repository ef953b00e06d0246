"""``hpc nodes``: each node's record over your jobs, and whether the next submission avoids it.

One row per node that ran one of the jobs of ``$HPC_HOME/jobs.jsonl`` (on this cluster, when
Slurm says which it is): the jobs it ran in, those it faulted in, the kinds of its faults, when
it last faulted, its faults among its last M jobs, and whether ``hpc submit`` would exclude it
(:mod:`hpc.bad_nodes` decides, :mod:`hpc.node_history` reads). ``--json`` gives the same rows.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Sequence
from dataclasses import asdict

from hpc import node_history
from hpc.bad_nodes import NodeRecord, Policy
from hpc.contract import jobspec, values
from hpc.contract.errors import SpecError
from hpc.contract.index import current_cluster


def policy_from(args: argparse.Namespace) -> Policy:
    """The policy of ``--bad-node-faults`` and ``--bad-node-jobs``, checked as JobSpec checks them."""
    top = jobspec.MAX_BAD_NODE_JOBS
    faults = values.parse_int(args.bad_node_faults, "--bad-node-faults", minimum=1, maximum=top,
                              example="--bad-node-faults 2")
    jobs = values.parse_int(args.bad_node_jobs, "--bad-node-jobs", minimum=1, maximum=top,
                            example="--bad-node-jobs 5")
    if faults > jobs:
        raise SpecError("--bad-node-faults", faults, f"at most --bad-node-jobs ({jobs})",
                        f"--bad-node-faults {jobs} --bad-node-jobs {jobs}")
    return Policy(faults=faults, jobs=jobs)


def row(r: NodeRecord) -> dict[str, object]:
    """One node's record as ``--json`` shows it."""
    out = asdict(r)
    out["kinds"] = dict(r.kinds)
    out["last_fault"] = r.last_fault or None
    out["next_submit"] = "avoid" if r.avoid else "use"
    return out


def format_table(records: Sequence[NodeRecord], policy: Policy, width: int = 140) -> str:
    """The nodes as a text table (pure)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=None, show_lines=False, expand=False)
    for col in ("NODE", "JOBS", "FAULTED", "KINDS", "LAST FAULT", f"LAST {policy.jobs} JOBS",
                "NEXT SUBMIT"):
        table.add_column(col, overflow="fold")
    for r in records:
        last = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.last_fault)) if r.last_fault else "-"
        table.add_row(r.node, str(r.jobs), str(r.faulted), r.kinds_text(), last,
                      f"{r.recent_faulted} faulted of {r.recent_jobs}",
                      "avoid" if r.avoid else "use")
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False).print(table)
    return out.getvalue()


def main(args: argparse.Namespace) -> int:
    """``hpc nodes``: the table (or ``--json``) of every node your jobs ran on."""
    policy = policy_from(args)
    records = node_history.records_for(cluster=current_cluster(), policy=policy)
    if args.json:
        print(json.dumps([row(r) for r in records], indent=2, sort_keys=True))
        return 0
    if not records:
        print("hpc nodes: no job of yours has run on a node yet (the job index is in $HPC_HOME, "
              "default ~/.hpc)")
        return 0
    print(format_table(records, policy), end="")
    avoided = [r.node for r in records if r.avoid]
    print(f"A node is avoided when it {policy.describe()} (--bad-node-faults, --bad-node-jobs); "
          + (f"the next hpc submit excludes {', '.join(avoided)} unless --no-avoid-bad-nodes."
             if avoided else "none is now."))
    return 0
