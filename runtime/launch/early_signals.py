"""Stop signals that reach the launcher while it starts are kept, not fatal.

A preemption that comes as an allocation starts signals every process of the step, the
launcher too, while it is still importing torch (seconds under load) and before its
:class:`~runtime.launch.forwarding.SignalForwarder` is installed. Python's default for SIGTERM
ends it at once, undecided: no outcome, no requeue, and a batch shell that exits within the
grace time ends the job for good. :func:`hold` (the first thing ``python -m runtime.launch``
does) records such signals instead; :func:`take` hands them to the forwarder, which acts on them
as if they had just come (the workers it starts learn of the stop from their environment).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

HELD = tuple(getattr(signal, "SIG" + name) for name in ("TERM", "USR1", "USR2", "INT", "HUP", "XCPU"))
_received: list[tuple[float, int]] = []
_holding = False


def _record(signum: int, frame: Any) -> None:
    _received.append((time.time(), signum))


def hold() -> None:
    """Records :data:`HELD` signals from now until :func:`take`."""
    global _holding
    for sig in HELD:
        signal.signal(sig, _record)
    _holding = True


def take(kept: tuple[int, ...]) -> list[tuple[float, int]]:
    """Ends the hold: the signals not in ``kept`` get their defaults back (``kept`` have just
    got their handlers), and one of them that came meanwhile is sent again, to act as it
    would have (a Ctrl-C still ends a starting ``hpc run``). Returns what came of ``kept``
    meanwhile, (time, signal), oldest first."""
    global _holding
    if not _holding:
        return []
    for sig in HELD:
        if sig not in kept and signal.getsignal(sig) is _record:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    _holding = False
    got, _received[:] = list(_received), []
    for _, sig in got:
        if sig not in kept:
            os.kill(os.getpid(), sig)
    return [(at, sig) for at, sig in got if sig in kept]
