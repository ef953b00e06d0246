"""The ``--stall-timeout`` value: ``auto``, ``off`` or a number of seconds (pure, torch-free).

It lives in the job contract because both sides read it: the login node validates the flag
(and a profile's ``stall_timeout`` key) into ``jobspec.json``, the per-node launcher's
watchdog turns it into a stall policy (:mod:`runtime.liveness.deadline`).
"""

from __future__ import annotations

from hpc.contract import values
from hpc.contract.errors import SpecError

AUTO = "auto"
OFF = "off"
MIN_SECONDS = 5.0
# ``--busy-timeout``: how long a rank that is alive and working outside any collective (an
# evaluation, I/O, the user's own code) may go without progress. Long by default: such pauses
# are ordinary in training loops (NVIDIA's resiliency extension gives step progress tens of
# minutes); the short deadline is for faults (a frozen process, a lost peer).
BUSY_TIMEOUT_S = 1800
MIN_BUSY_TIMEOUT_S = 5
MAX_BUSY_TIMEOUT_S = 7 * 86400


def parse_stall_timeout(v: object, flag: str = "--stall-timeout") -> str:
    """Normalizes a user's value to ``auto``, ``off`` or seconds as text (``"45"``).

    Raises:
        SpecError: anything else, or fewer than :data:`MIN_SECONDS` seconds (a deadline
            that short would fire on an ordinary slow step).
    """
    if isinstance(v, str) and v.strip().lower() in (AUTO, OFF):
        return v.strip().lower()
    try:
        seconds = values.parse_float(v, flag, minimum=MIN_SECONDS, example=f"{flag} 120")
    except SpecError:
        raise SpecError(flag, v, f"auto, off, or seconds >= {MIN_SECONDS:g}", f"{flag} auto",
                        "auto adapts to the measured step time; a number fixes the deadline "
                        "of an ordinary step") from None
    return f"{seconds:g}"


def stall_seconds(text: str) -> float | None:
    """The fixed step deadline of a normalized value: seconds, or None for ``auto``/``off``."""
    return None if text in (AUTO, OFF) else float(text)


def check_stall_timeout(v: object, flag: str = "--stall-timeout") -> None:
    """Refuses a field value that is not already normalized (``jobspec.json``, constructor)."""
    if not isinstance(v, str) or parse_stall_timeout(v, flag) != v:
        raise SpecError(flag, v, f"auto, off, or seconds >= {MIN_SECONDS:g} as text", f"{flag} auto")
