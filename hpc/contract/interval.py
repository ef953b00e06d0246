"""The ``--checkpoint-interval`` value: ``auto``, ``auto:MTBF`` or ``fixed`` (pure, torch-free).

``auto`` (the default) saves at the Young/Daly interval (:mod:`hpc.contract.young_daly`: between
5 and 30 minutes) recomputed at every allocation from the measured save cost and the job's own
interruptions, starting from a prior mean time between interruptions for the cluster: 6 hours,
or the one after the colon (``auto:2h``, ``auto:90m``, ``auto:1d``, ``auto:3600``, seconds when
no unit is given). While no save of the job has been measured yet (its first allocation), the
first save comes :data:`PROBE_AFTER_STEPS` steps after the start: it measures the cost the
interval needs and proves that checkpoints can be written, before much work is at stake.
An explicit ``--checkpoint-every-min`` wins over ``auto``; ``--checkpoint-every-steps``
applies as well. ``fixed`` keeps only the intervals given (none by default: then nothing is
saved before a stop or the end, and the job says so when it starts).
"""

from __future__ import annotations

import re

from hpc.contract.errors import SpecError

FIXED = "fixed"
AUTO = "auto"
DEFAULT_PRIOR_S = 6 * 3600.0
PROBE_AFTER_STEPS = 20   # auto's first save when no save cost is known: after the warm-up steps
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_VALID = "fixed, auto, or auto:MTBF with MTBF like 6h, 90m, 1d or seconds (60 s to 365 days)"
_EXAMPLE = "--checkpoint-interval auto:6h"


def parse_duration_s(text: str) -> float | None:
    """``90``, ``90s``, ``15m``, ``6h``, ``1.5d`` -> seconds; None when it is not one (ASCII digits
    only: ``float`` reads ``'٣٦٠٠'`` too, and the text goes into jobspec.json as given)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|min|h|d)?\s*", text.lower(), re.ASCII)
    return float(m.group(1)) * _UNITS[m.group(2) or ""] if m else None


def parse_checkpoint_interval(v: object, flag: str = "--checkpoint-interval") -> str:
    """Normalizes to ``fixed``, ``auto`` (the default prior) or ``auto:SECONDS``.

    Raises:
        SpecError: anything else, or a prior under a minute or over a year.
    """
    text = v.strip().lower() if isinstance(v, str) else None
    if text in (FIXED, AUTO):
        return text
    if text and text.startswith(AUTO + ":"):
        seconds = parse_duration_s(text[len(AUTO) + 1:])
        if seconds is not None and 60 <= seconds <= 365 * 86400:
            return AUTO if seconds == DEFAULT_PRIOR_S else f"{AUTO}:{seconds:g}"
    raise SpecError(flag, v, _VALID, _EXAMPLE,
                    "auto picks sqrt(2 x save cost x mean time between interruptions), the "
                    "latter from the job's history and this prior for the cluster")


def check_checkpoint_interval(v: object, flag: str = "--checkpoint-interval") -> None:
    """Refuses a field value that is not already normalized (``jobspec.json``, constructor)."""
    if not isinstance(v, str) or parse_checkpoint_interval(v, flag) != v:
        raise SpecError(flag, v, _VALID + " (normalized: fixed, auto, auto:SECONDS)", _EXAMPLE)


def prior_mtbf_s(text: str) -> float | None:
    """The prior MTBF in seconds of a normalized ``auto`` value; None for ``fixed``."""
    if text == AUTO:
        return DEFAULT_PRIOR_S
    if text.startswith(AUTO + ":"):
        return float(text[len(AUTO) + 1:])
    return None


def effective(interval_value: str, every_min: float) -> str:
    """The mode in force: an explicit ``--checkpoint-every-min`` wins over ``auto`` (pure)."""
    return FIXED if every_min > 0 else interval_value


def no_checkpoint_warning(interval_value: str, every_min: float, every_steps: int,
                          uses_session: bool | None, script: str = "the script") -> str | None:
    """One line for a job that will save no periodic checkpoint, or None (pure).

    Args:
        interval_value: The normalized ``--checkpoint-interval``.
        every_min: ``--checkpoint-every-min``.
        every_steps: ``--checkpoint-every-steps``.
        uses_session: Whether the script uses our Session (None: unknown, e.g. not Python).
        script: The script's name, for the message.
    """
    if uses_session is False:
        return (f"{script} does not import runtime.session, so hpc-elastic saves no checkpoint "
                "for it: only the script's own saves (in $HPC_CHECKPOINT_DIR) survive a crash "
                "(docs/own-script.md)")
    if effective(interval_value, every_min) == FIXED and not every_min and not every_steps:
        return ("no periodic checkpoints (--checkpoint-interval fixed without --checkpoint-every-min "
                "or --checkpoint-every-steps): a crash loses all work since the start or the last "
                "stop; leave out --checkpoint-interval fixed for the auto interval (5 to 30 min)")
    return None


def uses_session(source: str) -> bool:
    """Whether a script's source imports our Session's module, ``runtime.session`` (pure)."""
    return re.search(r"\bruntime\.session\b|\bfrom\s+runtime\s+import\s+[^\n]*\bsession\b",
                     source) is not None
