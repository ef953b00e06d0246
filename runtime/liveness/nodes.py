"""What each node's stall watch tells the others: one small record per node in the job directory.

Every watchdog writes ``liveness/alloc-A/node-N.json`` every :data:`PUBLISH_EVERY_S` (and at
once when a rank of its node turns busy or stops being busy): the latest progress of its
ranks, a line per rank, its *busy* ranks (alive and working outside any collective, see
:mod:`.verdict`) and the ranks' pace (for :mod:`.stragglers`). Ranks elsewhere that wait in a
collective read them: while another node progressed within their deadline, or has a busy
rank, they may be waiting for it, and nothing is declared.

A record older than :data:`FRESH_S` says nothing about now (its node crashed, or its link to
the shared filesystem is cut). The reading helpers are pure over the records; the files are a
rename without fsync (a reader sees the old or the new record).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from hpc.contract import jobdir
from hpc.contract.jobpaths import JobPaths
from runtime.liveness.verdict import RankState

log = logging.getLogger("hpc.liveness")
PUBLISH_EVERY_S = 2.0
FRESH_S = 15.0   # a node record older than this says nothing about now


class NodeBoard:
    """One node's view of the records of an allocation.

    Args:
        job_dir: The job directory.
        allocation: The allocation index.
        node_rank: This node's index.
        host: This node's name.
    """

    def __init__(self, job_dir: Path, *, allocation: int, node_rank: int, host: str) -> None:
        self.paths, self.allocation = JobPaths(job_dir), allocation
        self.node_rank, self.host = node_rank, host
        self.path = self.paths.liveness_node(allocation, node_rank)
        self._published = float("-inf")
        self._published_busy = False

    def publish(self, ranks: Sequence[RankState], busy: Sequence[str], now: float) -> None:
        """Writes this node's record, at most every :data:`PUBLISH_EVERY_S` unless its busy
        ranks changed (a busy rank must be heard before the other nodes' deadlines)."""
        if not ranks:
            return
        news = bool(busy) != self._published_busy
        if now - self._published < PUBLISH_EVERY_S and not news:
            return
        self._published, self._published_busy = now, bool(busy)
        record = {"node": self.host, "node_rank": self.node_rank, "time": now,
                  "progress": max(r.beat.time for r in ranks),
                  "ranks": [r.describe() for r in ranks], "busy": list(busy),
                  "pace": [{"rank": r.beat.rank, "compute_s": r.beat.compute_s} for r in ranks
                           if r.beat.compute_s is not None and r.beat.phase == "step"]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            jobdir.write_atomic(self.path, json.dumps(record), durable=False)
        except OSError as e:
            log.warning("cannot publish this node's liveness: %s", e)

    def peers(self, now: float) -> list[dict]:
        """The other nodes' fresh records."""
        out = []
        for path in self.paths.liveness_nodes(self.allocation):
            if path == self.path:
                continue
            record = jobdir.read_json(path)
            try:
                if isinstance(record, dict) and now - float(record["time"]) < FRESH_S:
                    out.append(record)
            except (KeyError, TypeError, ValueError):
                continue
        return out


def progress_age(records: Sequence[dict], now: float) -> float | None:
    """Seconds since the latest progress in ``records`` (None: no record says any)."""
    latest = None
    for record in records:
        try:
            progress = float(record["progress"])
        except (KeyError, TypeError, ValueError):
            continue
        latest = progress if latest is None else max(latest, progress)
    return None if latest is None else max(0.0, now - latest)


def busy_rank(records: Sequence[dict]) -> str:
    """A busy rank one of ``records`` names (its description), or ""."""
    for record in records:
        busy = record.get("busy")
        if isinstance(busy, list) and busy and isinstance(busy[0], str):
            return busy[0]
    return ""
