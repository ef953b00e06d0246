"""What the harness counts: store requests, job-directory file-system operations, CPU, load.

Store requests are counted on the client side by a proxy around each real ``TCPStore``
client (every method call is one request to the server). File-system operations are counted
with a Python audit hook (PEP 578): ``open``, ``os.scandir``/``os.listdir``, ``os.rename``/
``os.replace``, ``os.mkdir``, ``os.remove``, ``os.utime`` and friends under the job
directory. ``stat`` calls (``Path.exists``, ``is_dir``) raise no audit event and are not
counted: the figures are a floor.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

FS_EVENTS = frozenset({"open", "os.scandir", "os.listdir", "os.rename", "os.mkdir", "os.remove",
                       "os.rmdir", "os.utime", "os.truncate", "os.chmod", "os.link", "os.symlink"})


class FsCounter:
    """Counts audited file-system operations on paths under ``root``, per thread's owner.

    ``owner`` is a thread-local label (a node rank) set by the code that works for a node;
    operations of unlabelled threads count under ``None``.
    """

    def __init__(self, root: Path) -> None:
        self.root = str(Path(root).resolve())
        self.counts: dict[Any, int] = {}
        self.local = threading.local()
        self.on = True
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.on or event not in FS_EVENTS or not args:
            return
        path = args[0]
        if isinstance(path, int) or path is None:
            return
        try:
            text = os.fsdecode(path)
        except TypeError:
            return
        if not text.startswith(self.root):
            return
        owner = getattr(self.local, "owner", None)
        self.counts[owner] = self.counts.get(owner, 0) + 1

    def total(self) -> int:
        return sum(self.counts.values())


class CountingStore:
    """A ``TCPStore`` client whose every call is counted (one call, one request); with a
    ``payload`` counter, the bytes of its ``str``/``bytes`` arguments and results too (the
    keys and values it sends and receives, framing aside)."""

    def __init__(self, store: Any, counter: list[int], payload: list[int] | None = None) -> None:
        self._store, self._counter, self._payload = store, counter, payload

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._counter[0] += 1
            out = attr(*args, **kwargs)
            if self._payload is not None:
                self._payload[0] += sum(_size(x) for x in (*args, *kwargs.values(), out))
            return out
        return call


def _size(value: Any) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_size(x) for x in value)
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (from ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load() -> dict[str, float]:
    """The machine's load averages and core count (recorded beside every figure)."""
    one, five, fifteen = os.getloadavg()
    return {"load1": round(one, 2), "load5": round(five, 2), "load15": round(fifteen, 2),
            "cores": os.cpu_count() or 0}
