"""The one wait on a posted collective (``async_op=True``), in a frame the stall watch knows.

A rank blocked in ``work.wait()`` shows the caller's own frame on top of its stack (the wait
itself is C code), so the stall watch could not tell it from the caller's own work. Every wait
of the worker side on a posted collective goes through :func:`wait` (or :func:`settle`, the
in-process recovery's wait that a lost peer ends); a main thread whose top frame is this
module waits in a collective (:data:`runtime.liveness.verdict.OWN_COLLECTIVE_FRAMES`),
and the frame below names which one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def wait(work: Any) -> Any:
    """Waits for ``work`` (a ``torch.distributed.Work``); returns what its ``wait()`` does."""
    return work.wait()


def settle(works: Sequence[Any], failed: Callable[[], bool], *, poll_s: float = 0.0005,
           slow_after_s: float = 0.1, slow_poll_s: float = 0.01, late_share: float = 0.05,
           max_poll_s: float = 0.05) -> bool:
    """Waits for ``works`` by polling, leaving as soon as ``failed()`` says so (a blocked
    ``wait()`` cannot be left: gloo cannot be interrupted). Returns False when it left.

    The poll starts at 20 us and doubles up to ``poll_s``: a step boundary's collectives take
    ~0.1-0.3 ms on gloo, and a first sleep of ``poll_s`` made each of them cost a whole
    ``poll_s``. A wait longer than ``slow_after_s`` (a peer still working) polls every
    ``slow_poll_s``, and then every ``late_share`` of the time waited so far, up to
    ``max_poll_s`` (a wait is left at most 5 % late): a main thread that waits uses next to no
    CPU (~20 wake-ups a second), as the stall watch's idleness evidence needs
    (:data:`runtime.liveness.watchdog.WAITING_SHARE`) even on a loaded machine."""
    start = time.monotonic()
    for work in works:
        wait = 0.00002
        while not work.is_completed():
            if failed():
                return False
            time.sleep(wait)
            waited = time.monotonic() - start
            cap = poll_s if waited <= slow_after_s else min(max_poll_s, max(slow_poll_s, late_share * waited))
            wait = min(2 * wait, cap)
    return not failed()
