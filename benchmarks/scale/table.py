"""``benchmarks/scale.json`` as the Markdown table of docs/scale.md.

    python -m benchmarks.scale.table [benchmarks/scale.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (("join_s", "join s"), ("detect_s", "detect s"), ("elect_s", "elect s"),
           ("store_req_per_s", "store req/s"), ("beacon_demand_req_per_s", "beacon demand req/s"),
           ("store_server_cpu", "store CPU (cores)"), ("fs_ops_per_node_per_s", "fs ops/node/s"),
           ("elect_fs_ops_per_node", "elect fs ops/node"), ("events_lines", "event lines"),
           ("status_s", "status s"), ("report_s", "report s"), ("report_cpu_s", "report CPU s"),
           ("report_rss_mb", "report MB"))


def render(summary: dict) -> str:
    rows = sorted(summary["figures"].values(), key=lambda r: r["nodes"])
    head = "| N | " + " | ".join(t for _, t in COLUMNS) + " | load (1 min): join / liveness / elect / report |"
    out = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in rows:
        cells = ["-" if r.get(k) is None else f"{r[k]:g}" for k, _ in COLUMNS]
        loads = " / ".join(str((r.get(k) or {}).get("load1", "-"))
                           for k in ("join_load", "load_window", "elect_load", "report_load"))
        out.append(f"| {r['nodes']} | " + " | ".join(cells) + f" | {loads} |")
    exps = summary.get("exponents", {})
    out.append("| exponent | " + " | ".join("-" if exps.get(k) is None else f"{exps[k]:+.2f}"
                                            for k, _ in COLUMNS) + " | |")
    notes = [f"- N={r['nodes']} {k}: {v}" for r in rows for k, v in r.get("notes", {}).items()]
    return "\n".join(out) + ("\n\nNulls:\n" + "\n".join(notes) if notes else "") + "\n"


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/scale.json")
    sys.stdout.write(render(json.loads(path.read_text())))
