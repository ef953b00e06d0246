"""Whether this node's workers are still saving, for the kill that follows a SIGTERM.

Under ``hpc run`` nobody escalates a SIGTERM (under Slurm, ``KillWait`` does), so the launcher
kills workers still running :data:`runtime.stopping.KILL_AFTER_S` after it: a signal handler
that hangs (Lightning's broadcast from inside its handler, against a peer blocked in the step's
collective) would otherwise keep the job alive for the 30-minute collective timeout. But a
healthy job may take longer than that to save (a big model, a slow file system), and killing it
then loses the very save the SIGTERM asked for. So the kill waits while there is evidence of a
save making progress, and comes when there is none:

* the bytes under the checkpoint directory change between two looks (a save writing: DCP's
  shards, a plain ``torch.save``, a framework's own checkpoint), or
* a worker's Session says it is in its ``save`` phase (its heartbeat record), its process is
  alive (its alive beat is fresh: not stopped) and the phase is within its budget (the stall
  watch's, :data:`runtime.liveness.deadline.PHASE_BUDGETS_S`).

A hung handler shows neither. :func:`progress` is pure; :class:`SaveWatch` takes the looks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.liveness.deadline import PHASE_BUDGETS_S
from runtime.liveness.heartbeat import Heartbeat, read_all

SAMPLE_S = 2.0          # the first look's two samples this far apart
ALIVE_BEATS = 3.0       # a record's alive beat older than this many periods: not alive


@dataclass(frozen=True)
class Look:
    """What the checkpoint directory and the workers' records show at one moment."""

    time: float
    files: int
    bytes: int
    newest_mtime: float
    heartbeats: tuple[Heartbeat, ...] = ()


def look(checkpoint_dir: Path, heartbeat_dir: Path | None, now: float | None = None) -> Look:
    """Sizes of every file under ``checkpoint_dir`` and the workers' heartbeat records."""
    files, size, newest = 0, 0, 0.0
    for root, _, names in os.walk(checkpoint_dir):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue   # replaced or pruned under us
            files, size, newest = files + 1, size + st.st_size, max(newest, st.st_mtime)
    beats = tuple(read_all(heartbeat_dir)) if heartbeat_dir is not None else ()
    return Look(time.time() if now is None else now, files, size, newest, beats)


def progress(before: Look, after: Look) -> str | None:
    """Why the workers are still saving between two looks, or None: no evidence (pure)."""
    if (after.files, after.bytes, after.newest_mtime) != (before.files, before.bytes, before.newest_mtime):
        return (f"the checkpoint directory changed in {after.time - before.time:.0f} s "
                f"({before.bytes / 1e6:.1f} -> {after.bytes / 1e6:.1f} MB, {after.files} files)")
    saving = _saving(after.heartbeats, after.time)
    if saving:
        return f"rank {', '.join(map(str, saving))} in its save phase (Session heartbeat)"
    return None


def _saving(beats: Sequence[Heartbeat], now: float) -> list[int]:
    out = []
    for hb in beats:
        age = hb.alive_age_s(now)
        alive = age is not None and hb.alive_every_s is not None and age <= ALIVE_BEATS * hb.alive_every_s
        budget = hb.budget_s or PHASE_BUDGETS_S["save"]
        if hb.phase == "save" and alive and now - hb.time <= budget:
            out.append(hb.rank)
    return sorted(out)


class SaveWatch:
    """Called when the kill is due: why to wait (a save progresses), or None (kill).

    The first call takes two looks :data:`SAMPLE_S` apart; each later call compares with the
    previous call's look.
    """

    def __init__(self, checkpoint_dir: Path, heartbeat_dir: Path | None, sample_s: float = SAMPLE_S) -> None:
        self.checkpoint_dir, self.heartbeat_dir, self.sample_s = Path(checkpoint_dir), heartbeat_dir, sample_s
        self._last: Look | None = None

    def __call__(self) -> str | None:
        if self._last is None:
            self._last = look(self.checkpoint_dir, self.heartbeat_dir)
            time.sleep(self.sample_s)
        now = look(self.checkpoint_dir, self.heartbeat_dir)
        why, self._last = progress(self._last, now), now
        return why
