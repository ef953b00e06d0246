"""The ledger as a terminal table and as JSON (pure)."""

from __future__ import annotations

import json

from hpc.contract.ledger import CATEGORIES, Ledger

LABELS = {
    "productive": "productive steps", "startup": "start-up", "rendezvous": "rendezvous / re-form",
    "restore": "restore", "checkpoint": "checkpoint stall", "lost": "lost work (recomputed)",
    "preemption": "preemption handling", "hang": "hang / idle", "teardown": "teardown", "spare": "idle hot spares",
    "unaccounted": "unaccounted",
}


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.2f}h"


def format_table(ledger: Ledger, title: str = "") -> str:
    """The ledger: one row per category (node-time, share), then per allocation, then the interval."""
    total = ledger.allocated_node_s or 1.0
    lines = [f"goodput report{': ' + title if title else ''}",
             f"allocated {_dur(ledger.allocated_node_s)} node-time in {len(ledger.allocations)} "
             f"allocation(s); goodput {ledger.goodput * 100:.1f}%; "
             f"queue wait {_dur(ledger.queue_s)}; lost steps {ledger.lost_steps}; "
             f"interruptions {ledger.interruptions}", ""]
    lines.append(f"  {'category':<26} {'node-time':>10} {'share':>7}")
    for c in CATEGORIES:
        v = ledger.categories.get(c, 0.0)
        if v or c in ("productive", "unaccounted"):
            lines.append(f"  {LABELS[c]:<26} {_dur(v):>10} {v / total * 100:6.1f}%")
    lines.append(f"  {'total':<26} {_dur(sum(ledger.categories.values())):>10} "
                 f"{sum(ledger.categories.values()) / total * 100:6.1f}%")
    lines += ["", f"  {'alloc':>5} {'nodes':>5} {'queue':>7} {'wall':>8} {'goodput':>8} "
              f"{'steps':>13} {'lost':>5} {'restarts':>8}  ended"]
    for a in ledger.allocations:
        good = a.categories["productive"] / a.node_s * 100 if a.node_s else 0.0
        steps = f"{a.start_step if a.start_step is not None else '?'}->" \
                f"{a.last_step if a.last_step is not None else '?'}"
        lines.append(f"  {a.allocation:>5} {len(a.nodes):>5} {_dur(a.queue_s):>7} {_dur(a.wall_s):>8} "
                     f"{good:7.1f}% {steps:>13} {a.lost_steps:>5} {a.restarts:>8}  {a.kind or '?'}")
    ck = ledger.checkpoints
    if ck.get("saves"):
        lines += ["", f"  checkpoints: {ck['saves']} saves, median blocking {_dur(ck['median_block_s'])}, "
                  f"median total {_dur(ck['median_save_s'])}"]
    iv = ledger.interval
    if iv:
        used = f" (in use: {_dur(iv['in_use_s'])})" if iv.get("in_use_s") else ""
        lines.append(f"  Young/Daly interval: {_dur(iv['every_s'])}{used} = sqrt(2 x {iv['save_cost_s']:.3f}s "
                     f"x MTBF {_dur(iv['mtbf_s'])}); MTBF from {iv['interruptions']} interruption(s) in "
                     f"{_dur(iv['observed_s'])} + prior {_dur(iv['prior_mtbf_s'])}")
    if ledger.notes:
        lines += [""] + [f"  note: {n}" for n in ledger.notes]
    return "\n".join(lines) + "\n"


def to_json(ledger: Ledger) -> str:
    return json.dumps(ledger.to_dict(), indent=2, sort_keys=True) + "\n"
