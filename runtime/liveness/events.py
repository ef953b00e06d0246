"""``hangs.jsonl``: one line per stall a node's watchdog acted on (any node appends).

A stall ends one worker group, not the allocation: the agents re-form and the job goes on,
so it is not an outcome of its own in ``outcomes.jsonl`` (one line per allocation). The
detail lives here, written when the watchdog acts; the allocation's outcome then sums it up
(kind ``hang`` when the allocation ended because of one, a note when it recovered).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HANGS = "hangs.jsonl"


@dataclass(frozen=True)
class HangEvent:
    """One stall a watchdog detected and acted on."""

    allocation: int
    node: str
    node_rank: int
    reason: str                      # the verdict: who and why
    suspect_rank: int | None
    stacks: str                      # the stack file, relative to the job directory
    step: int | None = None          # the lowest step among the node's ranks
    time: float = 0.0
    ranks: tuple[str, ...] = field(default_factory=tuple)   # one line per local rank
    suspect_node: str = ""           # a peer node that stopped answering, when that is why

    def summary(self) -> str:
        """One line for outcomes and ``hpc status``."""
        who = (f"rank {self.suspect_rank}" if self.suspect_rank is not None
               else f"node {self.suspect_node}" if self.suspect_node else "a peer off this node")
        at = f" at step {self.step}" if self.step is not None else ""
        return f"stall on {self.node}{at}, suspect {who}: {self.reason} (stacks {self.stacks})"


def append(job_dir: Path, event: HangEvent) -> None:
    data = asdict(event)
    data["time"] = data["time"] or time.time()
    fd = os.open(Path(job_dir) / HANGS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(data, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def read(job_dir: Path, allocation: int | None = None) -> list[HangEvent]:
    """The recorded stalls (of one allocation when given); unreadable lines are skipped."""
    try:
        lines = (Path(job_dir) / HANGS).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            data = json.loads(line)
            data["ranks"] = tuple(data.get("ranks", ()))
            event = HangEvent(**{k: v for k, v in data.items() if k in HangEvent.__dataclass_fields__})
        except (ValueError, TypeError):
            continue
        if allocation is None or event.allocation == allocation:
            out.append(event)
    return out


REPORTED = "liveness/reported"   # how many hangs.jsonl records rank 0 already logged to W&B


def take_unreported(job_dir: Path) -> list[HangEvent]:
    """The stalls not yet logged to the job's W&B run, marking them logged (rank 0 only)."""
    hangs = read(job_dir)
    marker = Path(job_dir) / REPORTED
    try:
        done = int(marker.read_text())
    except (OSError, ValueError):
        done = 0
    if len(hangs) <= done:
        return []
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(len(hangs)))
    except OSError:
        return []   # better to log a stall never than on every restart
    return hangs[done:]
