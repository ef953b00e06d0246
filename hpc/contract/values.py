"""Parsers for the values users type: node ranges, Slurm time limits, memory, signals.

Pure functions. Each raises :class:`~hpc.contract.errors.SpecError` naming the flag, the value given,
the valid form and an example. They are shared by the CLI, config files and ``JobSpec``.
"""

from __future__ import annotations

import re
import signal

from hpc.contract.errors import SpecError

_NODES_VALID = "N or MIN:MAX with 1 <= MIN <= MAX"


def parse_nodes(text: str | int, flag: str = "--nodes") -> tuple[int, int]:
    """Parses ``N`` or ``MIN:MAX`` into ``(min, max)``."""
    raw = str(text).strip()
    m = re.fullmatch(r"(\d+)(?::(\d+))?", raw)
    if not m:
        raise SpecError(flag, text, _NODES_VALID, f"{flag} 2 or {flag} 2:4")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1:
        raise SpecError(flag, text, _NODES_VALID + " (a job needs at least one node)", f"{flag} 1")
    if lo > hi:
        raise SpecError(flag, text, _NODES_VALID + f" (MIN {lo} is larger than MAX {hi})",
                        f"{flag} {hi}:{lo}")
    return lo, hi


_TIME_VALID = "a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_TIME_EXAMPLE = "--time 4:00:00 (4 hours) or --time 1-12 (1 day 12 hours)"


def parse_time(text: str | int, flag: str = "--time") -> int:
    """Parses a Slurm time limit into seconds.

    Slurm's formats: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.
    """
    raw = str(text).strip()
    days = 0
    rest = raw
    if "-" in raw:
        d, _, rest = raw.partition("-")
        if not d.isdigit() or not rest:
            raise SpecError(flag, text, _TIME_VALID, _TIME_EXAMPLE)
        days = int(d)
        parts = rest.split(":")
        if len(parts) > 3 or not all(p.isdigit() for p in parts):
            raise SpecError(flag, text, _TIME_VALID, _TIME_EXAMPLE)
        h, m, s = (list(map(int, parts)) + [0, 0])[:3]
    else:
        parts = raw.split(":")
        if not parts or len(parts) > 3 or not all(p.isdigit() for p in parts):
            raise SpecError(flag, text, _TIME_VALID, _TIME_EXAMPLE)
        nums = list(map(int, parts))
        if len(nums) == 1:
            h, m, s = 0, nums[0], 0
        elif len(nums) == 2:
            h, m, s = 0, nums[0], nums[1]
        else:
            h, m, s = nums
    if (days or len(rest.split(":")) == 3) and (m >= 60 or s >= 60):
        raise SpecError(flag, text, _TIME_VALID + " (minutes and seconds below 60)", _TIME_EXAMPLE)
    if days and h >= 24:
        raise SpecError(flag, text, _TIME_VALID + " (hours below 24 after a day count)", _TIME_EXAMPLE)
    total = ((days * 24 + h) * 60 + m) * 60 + s
    if total <= 0:
        raise SpecError(flag, text, _TIME_VALID + " (must be longer than zero)", _TIME_EXAMPLE)
    return total


def format_time(seconds: int) -> str:
    """Formats seconds as Slurm's ``D-HH:MM:SS`` (or ``HH:MM:SS`` under a day)."""
    days, rem = divmod(int(seconds), 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"


_MEM_RE = re.compile(r"(\d+)([KMGT]?)B?", re.IGNORECASE)


def parse_mem(text: str, flag: str = "--mem") -> str:
    """Validates a Slurm memory size (``64G``, ``512M``, ``0`` = all) and returns it normalized."""
    raw = str(text).strip()
    m = _MEM_RE.fullmatch(raw)
    if not m:
        raise SpecError(flag, text, "a size with an optional unit K, M, G or T (Slurm's --mem)",
                        f"{flag} 64G")
    return f"{m.group(1)}{m.group(2).upper()}"


_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "URG", "XCPU")


def parse_signal(text: str, flag: str = "--signal") -> str:
    """Normalizes a warning signal name (``SIGUSR2``, ``usr2`` -> ``USR2``)."""
    name = str(text).strip().upper().removeprefix("SIG")
    if name not in _SIGNALS or not hasattr(signal, "SIG" + name):
        raise SpecError(flag, text, "one of " + ", ".join(_SIGNALS), f"{flag} USR2")
    return name


def parse_int(text: str | int, flag: str, *, minimum: int = 0, example: str = "") -> int:
    """Parses an integer that must be at least ``minimum``."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise SpecError(flag, text, f"an integer >= {minimum}", example or f"{flag} {max(minimum, 1)}")
    return value


def parse_float(text: str | float, flag: str, *, minimum: float = 0.0, example: str = "") -> float:
    """Parses a number that must be at least ``minimum``."""
    try:
        value = float(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise SpecError(flag, text, f"a number >= {minimum:g}", example or f"{flag} {max(minimum, 1):g}")
    return value


def parse_env_pair(text: str, flag: str = "--env") -> tuple[str, str]:
    """Parses ``NAME=VALUE``."""
    name, sep, value = str(text).partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise SpecError(flag, text, "NAME=VALUE with a valid variable name", f"{flag} NCCL_DEBUG=INFO")
    return name, value
