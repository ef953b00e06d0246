"""The ``--checkpoint-interval`` value: ``fixed``, ``auto`` or ``auto:MTBF`` (pure, torch-free).

``fixed`` (the default) keeps ``--checkpoint-every-min`` / ``--checkpoint-every-steps`` as
given. ``auto`` replaces the minute interval by the Young/Daly optimum
(:mod:`hpc.report.young_daly`) recomputed at every allocation from the measured save cost and
the job's own interruptions, starting from a prior mean time between interruptions for the
cluster: 6 hours, or the one after the colon (``auto:2h``, ``auto:90m``, ``auto:1d``,
``auto:3600``, seconds when no unit is given). ``--checkpoint-every-steps`` still applies.
"""

from __future__ import annotations

import re

from hpc.contract.errors import SpecError

FIXED = "fixed"
AUTO = "auto"
DEFAULT_PRIOR_S = 6 * 3600.0
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
