"""What a job prints on its console, and what only goes to its log files.

A job's console (``hpc run``'s terminal, a Slurm job's batch output) shows by default one line
that the job started, the script's own output and progress, and what matters: faults, stops,
checkpoints saved and resumed, the outcome. Everything else (environment decisions, the stall
watch's budgets, torch's agent chatter, the Session's set-up notes) goes to the job directory's
logs only, and to the console too with ``-v`` (``HPC_VERBOSE=1``).

Three pieces:

* :data:`NOTE`, a log level between INFO and WARNING for "what matters" messages that are not
  warnings (``checkpoint: resumed from ...``). The console shows NOTE and above.
* :class:`LineFilter` (pure): rank 0's log lines -> the console's. Our log lines below NOTE are
  dropped, the rest shortened to their message; torch's own ``[rankN]:`` prefix (its exception
  hook and C++ warnings add one) is removed, since the console adds one; torch's warning that
  DDP found no unused parameters is dropped once the Session said why it is expected.
* :class:`RankTee`: follows rank 0's log file (a new one per elastic restart) and writes the
  filtered lines to the console, in place of torch's tee, which copies every line as it is.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from hpc.contract import environment as job_env

NOTE = 25
logging.addLevelName(NOTE, "NOTE")

VERBOSE_ENV = job_env.VERBOSE

# The Session's log line that explains torch's find_unused_parameters warning (runtime.session).
DDP_UNUSED_EXPECTED = "find_unused_parameters=True keeps one gradient-bucket layout"

_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_OUR_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[hpc(?:\.[\w.]+)?\] "
                      r"(DEBUG|INFO|NOTE|WARNING|ERROR|CRITICAL) (.*)$")
_DDP_UNUSED_WARNING = re.compile(r"^\[W\d{4} .*reducer\.cpp:\d+\] Warning: find_unused_parameters=True")


def our_log_line(line: str) -> tuple[int, str] | None:
    """(level, message) of a line written by one of our ``hpc.*`` loggers, else None (pure)."""
    m = _OUR_LOG.match(line)
    return (logging.getLevelName(m.group(1)), m.group(2)) if m is not None else None


def verbose_from_env(env: Mapping[str, str]) -> bool:
    """Whether ``HPC_VERBOSE`` asks for the whole log on the console (``1``, ``true``, ``yes``)."""
    return env.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def console_level(verbose: bool) -> int:
    """The lowest level a console handler shows."""
    return logging.INFO if verbose else NOTE


class ConsoleFormatter(logging.Formatter):
    """The launcher's own lines on a quiet console: ``hpc: message``, ``hpc: warning: ...``.

    Args:
        who: Who speaks (``hpc``, ``hpc node 1``).
    """

    def __init__(self, who: str = "hpc") -> None:
        super().__init__()
        self.who = who

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno <= NOTE else f"{record.levelname.lower()}: "
        text = f"{self.who}: {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class LineFilter:
    """Rank 0's log lines -> the console's (pure; stateful across the lines of one job).

    Args:
        verbose: Show every line (only torch's duplicate ``[rankN]:`` prefix is removed).
    """

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self._ddp_explained = False

    def __call__(self, line: str) -> str | None:
        """The line to show for ``line`` (no newline), or None to show nothing."""
        line = _TORCH_PREFIX.sub("", line, count=1)
        ours = our_log_line(line)
        if ours is not None:
            level, message = ours
            if DDP_UNUSED_EXPECTED in message:
                self._ddp_explained = True
            if self.verbose:
                return line
            if level < NOTE:
                return None
            return message if level == NOTE else f"{logging.getLevelName(level).lower()}: {message}"
        if not self.verbose and self._ddp_explained and _DDP_UNUSED_WARNING.match(line):
            return None
        return line


class RankTee(threading.Thread):
    """Copies one rank's log file to the console through a :class:`LineFilter`, as it grows.

    :meth:`follow` switches to a new file (the next elastic restart's) after the old one is
    copied to its end; :meth:`drain` copies what is there now; :meth:`close` drains and stops.

    Args:
        out: The console.
        verbose: Passed to the filter.
        prefix: Put before every line shown (``[rank0]: ``).
        interval_s: How often the file is read.
    """

    def __init__(self, out: TextIO, *, verbose: bool, prefix: str = "[rank0]: ",
                 interval_s: float = 0.1) -> None:
        super().__init__(name="hpc-rank-tee", daemon=True)
        self.out, self.prefix, self.interval_s = out, prefix, interval_s
        self.filter = LineFilter(verbose)
        self._path: Path | None = None
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()
        self._stop_event = threading.Event()

    def follow(self, path: Path, prefix: str | None = None) -> None:
        """From now on copies ``path`` (from its start); the current file is finished first."""
        with self._lock:
            if self._path == path:
                return
            self._copy(final=True)
            self._path, self._offset, self._partial = path, 0, b""
            if prefix is not None:
                self.prefix = prefix
        if not self.is_alive() and not self._stop_event.is_set():
            self.start()

    def drain(self) -> None:
        """Copies everything written so far, a last line without its newline too."""
        with self._lock:
            self._copy(final=True)

    def close(self) -> None:
        self._stop_event.set()
        self.drain()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            with self._lock:
                self._copy(final=False)

    def _copy(self, final: bool) -> None:
        if self._path is None:
            return
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            data = b""
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        shown = [s for s in (self.filter(raw.decode(errors="replace").rstrip("\r")) for raw in lines)
                 if s is not None]
        if not shown:
            return
        try:
            self.out.write("".join(f"{self.prefix}{s}\n" for s in shown))
            self.out.flush()
        except (OSError, ValueError):   # the terminal is gone: the log file has it all
            pass
