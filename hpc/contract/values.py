"""Parsers and checks for the values users type: numbers, node ranges, Slurm time limits, memory,
signals, Slurm names, paths and free text.

Pure functions. Each raises :class:`~hpc.contract.errors.SpecError` naming the flag, the value given,
the valid form and an example. They are shared by the CLI, config files and ``JobSpec``.

Why the string checks are strict: a JobSpec's values end up in batch scripts written by three
different libraries (our template, submitit, TorchX), and not all of them quote (TorchX writes
``#SBATCH --partition=VALUE`` as is). A line break in any value becomes a shell line of the
batch script, and a blank in an unquoted option smuggles in another option. So every value is
held to the characters its Slurm syntax needs, once, where the spec is built; no backend has to
be trusted to quote. Numbers are ASCII digits only (``str.isdigit`` and ``int`` also accept
``'٣'`` and ``'²'``) and have documented upper bounds.
"""

from __future__ import annotations

import math
import re
import signal
import unicodedata

from hpc.contract.errors import SpecError

_ASCII_INT = re.compile(r"[0-9]+")

# --- bounds (documented in the help text and docs/security.md) ---------------------------------
MAX_NODES = 100_000
MAX_TIME_S = 365 * 86400
"""Longest time limit accepted: 365 days (Slurm's own "INFINITE" is not a limit we submit)."""

_NODES_VALID = f"N or MIN:MAX (sbatch's MIN-MAX too) with 1 <= MIN <= MAX <= {MAX_NODES}"


def parse_nodes(text: str | int, flag: str = "--nodes") -> tuple[int, int]:
    """Parses ``N``, ``MIN:MAX`` or sbatch's ``MIN-MAX`` into ``(min, max)``."""
    if isinstance(text, bool):
        raise SpecError(flag, text, _NODES_VALID, f"{flag} 2 or {flag} 2:4")
    raw = str(text).strip()
    m = re.fullmatch(r"([0-9]+)(?:[:-]([0-9]+))?", raw)
    if not m:
        raise SpecError(flag, text, _NODES_VALID, f"{flag} 2 or {flag} 2:4")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    check_nodes((lo, hi), flag, text)
    return lo, hi


def check_nodes(nodes: object, flag: str = "--nodes", shown: object = None) -> None:
    """Checks a parsed ``(min, max)`` node range."""
    shown = nodes if shown is None else shown
    if (not isinstance(nodes, tuple) or len(nodes) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in nodes)):
        raise SpecError(flag, shown, _NODES_VALID, f"{flag} 2 or {flag} 2:4")
    lo, hi = nodes
    if lo < 1:
        raise SpecError(flag, shown, _NODES_VALID + " (a job needs at least one node)", f"{flag} 1")
    if lo > hi:
        raise SpecError(flag, shown, _NODES_VALID + f" (MIN {lo} is larger than MAX {hi})",
                        f"{flag} {hi}:{lo}")
    if hi > MAX_NODES:
        raise SpecError(flag, shown, _NODES_VALID, f"{flag} 2:4")


_TIME_VALID = ("a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, "
               "ASCII digits, at most 365 days")
_TIME_EXAMPLE = "--time 4:00:00 (4 hours) or --time 1-12 (1 day 12 hours)"


def _digits(parts: list[str]) -> bool:
    return all(_ASCII_INT.fullmatch(p) for p in parts)


def parse_time(text: str | int, flag: str = "--time") -> int:
    """Parses a Slurm time limit into seconds.

    Slurm's formats: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.
    """
    if isinstance(text, bool):
        raise SpecError(flag, text, _TIME_VALID, _TIME_EXAMPLE)
    raw = str(text).strip()
    days = 0
    rest = raw
    if "-" in raw:
        d, _, rest = raw.partition("-")
        if not _digits([d]) or not rest:
            raise SpecError(flag, text, _TIME_VALID, _TIME_EXAMPLE)
        days = int(d)
        parts = rest.split(":")
        if len(parts) > 3 or not _digits(parts):
            raise SpecError(flag, text, _TIME_VALID, _TIME_EXAMPLE)
        h, m, s = (list(map(int, parts)) + [0, 0])[:3]
    else:
        parts = raw.split(":")
        if not parts or len(parts) > 3 or not _digits(parts):
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
    if total > MAX_TIME_S:
        raise SpecError(flag, text, _TIME_VALID + " (longer than 365 days)", _TIME_EXAMPLE)
    return total


def format_time(seconds: int) -> str:
    """Formats seconds as Slurm's ``D-HH:MM:SS`` (or ``HH:MM:SS`` under a day)."""
    days, rem = divmod(int(seconds), 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"


_MEM_RE = re.compile(r"([0-9]{1,12})([KMGT]?)B?", re.IGNORECASE)
_MEM_VALID = "a size in ASCII digits with an optional unit K, M, G or T (Slurm's --mem)"


def parse_mem(text: str, flag: str = "--mem") -> str:
    """Validates a Slurm memory size (``64G``, ``512M``, ``0`` = all) and returns it normalized."""
    raw = str(text).strip() if isinstance(text, (str, int)) and not isinstance(text, bool) else ""
    m = _MEM_RE.fullmatch(raw)
    if not m:
        raise SpecError(flag, text, _MEM_VALID, f"{flag} 64G")
    return f"{m.group(1)}{m.group(2).upper()}"


def check_mem(value: object, flag: str = "--mem") -> None:
    """Checks a normalized memory size (``""``: not set)."""
    if value == "":
        return
    if not isinstance(value, str) or not re.fullmatch(r"[0-9]{1,12}[KMGT]?", value):
        raise SpecError(flag, value, _MEM_VALID, f"{flag} 64G")


SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "URG", "XCPU")


def parse_signal(text: str, flag: str = "--signal") -> str:
    """Normalizes a warning signal name (``SIGUSR2``, ``usr2`` -> ``USR2``)."""
    name = str(text).strip().upper().removeprefix("SIG") if isinstance(text, str) else ""
    if name not in SIGNALS or not hasattr(signal, "SIG" + name):
        raise SpecError(flag, text, "one of " + ", ".join(SIGNALS), f"{flag} USR2")
    return name


def _int_valid(minimum: int, maximum: int | None) -> str:
    return f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "") + \
        " in ASCII digits"


def parse_int(text: str | int, flag: str, *, minimum: int = 0, maximum: int | None = None,
              example: str = "") -> int:
    """Parses an integer in ASCII digits that must lie in ``[minimum, maximum]``."""
    value: int | None = None
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str) and _ASCII_INT.fullmatch(text.strip()):
        value = int(text.strip())
    if value is None or value < minimum or (maximum is not None and value > maximum):
        raise SpecError(flag, text, _int_valid(minimum, maximum),
                        example or f"{flag} {max(minimum, 1)}")
    return value


def check_int(value: object, flag: str, *, minimum: int, maximum: int | None = None,
              example: str = "") -> None:
    """Checks an already parsed integer (a real ``int``, not a ``bool``) against its bounds."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        raise SpecError(flag, value, _int_valid(minimum, maximum),
                        example or f"{flag} {max(minimum, 1)}")


_FLOAT_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _float_valid(minimum: float, maximum: float | None) -> str:
    return f"a number >= {minimum:g}" + (f" and <= {maximum:g}" if maximum is not None else "") + \
        " in ASCII digits (no sign, nan or inf)"


def parse_float(text: str | float, flag: str, *, minimum: float = 0.0,
                maximum: float | None = None, example: str = "") -> float:
    """Parses a finite, unsigned number in ASCII digits that must lie in ``[minimum, maximum]``.

    ``nan``, ``inf``, a sign (``-0`` included) and non-ASCII digits are refused.
    """
    value: float | None = None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    elif isinstance(text, str) and _FLOAT_RE.fullmatch(text.strip()):
        value = float(text.strip())
    if (value is None or not math.isfinite(value) or math.copysign(1.0, value) < 0
            or value < minimum or (maximum is not None and value > maximum)):
        raise SpecError(flag, text, _float_valid(minimum, maximum),
                        example or f"{flag} {max(minimum, 1):g}")
    return value


def check_float(value: object, flag: str, *, minimum: float = 0.0, maximum: float | None = None,
                example: str = "") -> None:
    """Checks an already parsed number (finite, not negative zero) against its bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(flag, value, _float_valid(minimum, maximum), example or f"{flag} 1")
    parse_float(value, flag, minimum=minimum, maximum=maximum, example=example)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_ENV_VALUE = 32_768


def parse_env_pair(text: str, flag: str = "--env") -> tuple[str, str]:
    """Parses ``NAME=VALUE``."""
    if not isinstance(text, str):
        raise SpecError(flag, text, "NAME=VALUE with a valid variable name", f"{flag} NCCL_DEBUG=INFO")
    name, sep, value = text.partition("=")
    if not sep or not ENV_NAME.fullmatch(name):
        raise SpecError(flag, text, "NAME=VALUE with a valid variable name", f"{flag} NCCL_DEBUG=INFO")
    check_env_value(name, value, flag)
    return name, value


def check_env_value(name: str, value: object, flag: str = "--env") -> None:
    """Checks one environment value: text without line breaks or control characters, bounded."""
    if not isinstance(value, str) or _control(value) or len(value) > MAX_ENV_VALUE:
        raise SpecError(flag, f"{name}={value}" if isinstance(value, str) else value,
                        "NAME=VALUE where VALUE is text without line breaks, NUL or other control "
                        f"characters, at most {MAX_ENV_VALUE} characters", f"{flag} NCCL_DEBUG=INFO")


# --- strings -----------------------------------------------------------------------------------

_CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _control(text: str) -> str | None:
    """The first control character of ``text`` (line breaks, NUL, tab, U+2028, bidi marks...)."""
    return next((c for c in text if unicodedata.category(c) in _CONTROL_CATEGORIES), None)


def printable(text: str) -> str:
    """``text`` safe to print on a terminal (pure): every control character but the line break
    and the tab (escape sequences, carriage returns, bells, bidi marks, U+2028) written as its Python escape,
    so a record's hostile text cannot move the cursor, recolour or rewrite what the reader sees."""
    if _control(text.replace("\n", "").replace("\t", "")) is None:
        return text
    return "".join(c if c in "\n\t" or unicodedata.category(c) not in _CONTROL_CATEGORIES
                   else (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") for c in text)


# Backslashes are refused in text and paths: sbatch's #SBATCH parser (Slurm 22.05) reads a
# backslash as an escape even inside quotes, so a value shell-quoted by submitit would reach Slurm
# changed (the job's log path somewhere other than its job directory).
MAX_NAME = 200
MAX_PATH = 4096
SLURM_NAME_CHARS = "letters, digits and _ . - +"


def check_slurm_name(value: object, flag: str, *, extra: str = "", extra_words: str = "",
                     example: str, max_len: int = MAX_NAME) -> None:
    """Checks a Slurm name (partition, account, qos, features, hostlist).

    Allowed: ASCII letters, digits, ``_ . - +`` and the syntax characters in ``extra``; not
    starting with ``-``; no blanks, quotes, line breaks or shell characters. ``""`` means unset.

    Args:
        value: The value (already stripped by the parser).
        flag: The flag or config key, for the error.
        extra: Further allowed characters (``,`` for a partition list, ``[]`` for hostlists...).
        extra_words: How ``extra`` is described to the user.
        example: A valid example, as the user would type it.
        max_len: Longest accepted value.
    """
    if value == "":
        return
    valid = (f"a Slurm name of {SLURM_NAME_CHARS}{extra_words} (no blanks, quotes, line breaks "
             f"or shell characters), not starting with '-', at most {max_len} characters")
    if not isinstance(value, str):
        raise SpecError(flag, value, valid + "; in hpc.toml, a quoted string", example)
    ok = re.fullmatch(r"[A-Za-z0-9_.+\-" + re.escape(extra) + r"]+", value)
    if not ok or value.startswith("-") or len(value) > max_len:
        raise SpecError(flag, value, valid, example)


def check_text(value: object, flag: str, *, example: str, max_len: int = MAX_NAME,
               forbidden: str = "") -> None:
    """Checks free text such as a job name: printable, one line, plain spaces only.

    Quotes and shell characters are allowed: every backend quotes these values. Refused: line
    breaks, NUL, tabs and every other control or format character (U+2028, bidi marks), any
    blank other than a plain space, a backslash (see above), the characters
    in ``forbidden``, a leading ``-``, blanks at either end and values longer than ``max_len``.
    ``""`` means unset.
    """
    if value == "":
        return
    forbidden = "\\" + forbidden.replace("\\", "")
    valid = ("one line of printable text (no line breaks, tabs, NUL or other control characters"
             + f", none of {' '.join(forbidden)}"
             + f"), not starting with '-', at most {max_len} characters")
    if not isinstance(value, str):
        raise SpecError(flag, value, valid + "; in hpc.toml, a quoted string", example)
    if (_control(value) or any(c.isspace() and c != " " for c in value)
            or any(c in forbidden for c in value) or value.startswith("-")
            or value != value.strip() or len(value) > max_len):
        raise SpecError(flag, value, valid, example)


def check_path(value: object, flag: str, *, example: str) -> None:
    """Checks a path: any characters a file name may have except line breaks, NUL, other
    control characters and a backslash (spaces, quotes and ``$`` are fine: paths are always
    shell-quoted). Not starting with ``-``; at most 4096 characters. ``""`` means unset."""
    if value == "":
        return
    valid = ("a path without line breaks, NUL, tabs, other control characters or backslashes, "
             f"not starting with '-', at most {MAX_PATH} characters")
    if not isinstance(value, str):
        raise SpecError(flag, value, valid + "; in hpc.toml, a quoted string", example)
    if _control(value) or "\\" in value or value.startswith("-") or len(value) > MAX_PATH:
        raise SpecError(flag, value, valid, example)


# --- sbatch passthrough (--sbatch KEY=VALUE) ---------------------------------------------------

# Options hpc decides itself, each with the hpc flag (or the reason) to use instead. sbatch
# accepts unambiguous prefixes of long options (getopt_long: --part=x is --partition=x), so a
# passthrough key is refused when it is a prefix of any of these too.
OWNED_SBATCH: dict[str, str] = {
    "nodes": "--nodes (N or MIN:MAX)", "time": "--time", "partition": "--partition",
    "account": "--account", "qos": "--qos", "job-name": "--job-name",
    "signal": "--signal and --signal-lead", "requeue": "--requeue auto",
    "no-requeue": "--requeue never", "output": "--job-dir (hpc writes JOB_DIR/logs)",
    "error": "--job-dir (hpc writes JOB_DIR/logs)", "open-mode": "--job-dir (hpc appends to JOB_DIR/logs)",
    "array": "hpc sweep", "export": "--env NAME=VALUE (hpc needs --export=ALL)",
    "no-kill": "nothing: hpc always sets it, so the survivors of a node loss keep running",
    "cpus-per-task": "--cpus-per-task", "gres": "--gpus-per-node and --gpu-type",
    "gpus": "--gpus-per-node and --gpu-type", "gpus-per-node": "--gpus-per-node and --gpu-type",
    "gpus-per-task": "--gpus-per-node (hpc runs one task per node)",
    "gpus-per-socket": "--gpus-per-node", "comment": "nothing: hpc's submission tag is there",
    "mem": "--mem", "constraint": "--constraint", "exclude": "--exclude",
    "exclusive": "--exclusive", "reservation": "--reservation", "nodelist": "--nodelist",
    "mail-type": "--mail-type", "mail-user": "--mail-user",
    "ntasks": "--nproc-per-node (hpc runs one task per node and starts the workers itself)",
    "ntasks-per-node": "--nproc-per-node (hpc runs one task per node and starts the workers itself)",
    "wrap": "hpc submit SCRIPT", "parsable": "nothing: hpc sets it",
    "clusters": "a profile per cluster (hpc submits to the default cluster)",
    "container": "--container-image", "dependency": "--after JOB[:STATE]",
}
# sbatch's one-letter options that stand for the options above.
OWNED_SHORT: dict[str, str] = {
    "N": "nodes", "t": "time", "p": "partition", "A": "account", "q": "qos", "J": "job-name",
    "o": "output", "e": "error", "a": "array", "k": "no-kill", "c": "cpus-per-task", "G": "gpus",
    "n": "ntasks", "C": "constraint", "x": "exclude", "w": "nodelist", "M": "clusters",
    "d": "dependency",
}
_SBATCH_KEY = re.compile(r"[a-z][a-z0-9-]*[a-z0-9]")
# shlex.quote's safe set (submitit writes values through it: a value made of these reaches
# sbatch's parser unquoted in every backend) plus [ ] for hostlists.
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9_@%+=:,./\[\]-]*")
SBATCH_VALUE_CHARS = "letters, digits and _ @ % + = : , . / [ ] -"


def owned_sbatch_option(key: str) -> str | None:
    """The hpc flag to use instead of sbatch option ``key``, or None when hpc does not own it.

    ``key`` is a long option name without dashes, or a one-letter short option; a prefix of an
    owned long option is owned too (sbatch would read it as that option).
    """
    key = OWNED_SHORT.get(key, key)
    if key in OWNED_SBATCH:
        return OWNED_SBATCH[key]
    owner = next((name for name in sorted(OWNED_SBATCH) if name.startswith(key)), None)
    return None if owner is None else f"{OWNED_SBATCH[owner]} (sbatch reads --{key} as --{owner})"


def parse_sbatch_pair(text: object, flag: str = "--sbatch") -> tuple[str, str]:
    """Parses ``KEY=VALUE`` (or a bare ``KEY`` for an option without a value) for ``--sbatch``.

    Refuses options hpc owns (naming the hpc flag to use instead), one-letter and malformed
    keys, and values that could smuggle in another option (blanks, quotes, line breaks...).
    """
    example = f"{flag} gres-flags=enforce-binding"
    if not isinstance(text, str):
        raise SpecError(flag, text, "KEY=VALUE or KEY, as a string", example)
    key, sep, value = text.strip().partition("=")
    key = key.removeprefix("--")
    check_sbatch_pair(key, value if sep else None, flag, shown=text)
    return key, value


def check_sbatch_pair(key: object, value: object, flag: str = "--sbatch", shown: object = None) -> None:
    """Checks one passthrough option (``value`` None or ``""``: an option without a value)."""
    example = f"{flag} gres-flags=enforce-binding"
    shown = shown if shown is not None else (f"{key}={value}" if value else key)
    if not isinstance(key, str) or (value is not None and not isinstance(value, str)):
        raise SpecError(flag, shown, "KEY=VALUE strings", example)
    owner = owned_sbatch_option(key)
    if owner is not None:
        raise SpecError(flag, shown, f"an sbatch option hpc does not set itself; for --{OWNED_SHORT.get(key, key)} "
                        f"use {owner}", example)
    if not _SBATCH_KEY.fullmatch(key):
        raise SpecError(flag, shown, "KEY=VALUE where KEY is sbatch's long option name (lower-case "
                        "letters, digits and -, at least 2 characters, without the leading --)",
                        example)
    if value == "" and value is not None:
        raise SpecError(flag, shown, "KEY=VALUE with a value, or KEY alone for an option that takes "
                        "none", example)
    if value and (not _SBATCH_VALUE.fullmatch(value) or len(value) > MAX_NAME):
        raise SpecError(flag, shown, f"KEY=VALUE where VALUE has only {SBATCH_VALUE_CHARS} (no "
                        "blanks, quotes, line breaks or shell characters: it must reach sbatch as "
                        f"one argument in every backend), at most {MAX_NAME} characters", example)


# --- other Slurm values ------------------------------------------------------------------------

MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT",
              "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")


def parse_mail_type(text: object, flag: str = "--mail-type") -> str:
    """Normalizes sbatch's ``--mail-type`` list (``end,fail`` -> ``END,FAIL``)."""
    raw = text.strip().upper() if isinstance(text, str) else ""
    check_mail_type(",".join(p.strip() for p in raw.split(",")) if raw else text, flag, shown=text)
    return ",".join(p.strip() for p in raw.split(","))


def check_mail_type(value: object, flag: str = "--mail-type", shown: object = None) -> None:
    if value == "":
        return
    parts = value.split(",") if isinstance(value, str) else None
    if not parts or any(p not in MAIL_TYPES for p in parts):
        raise SpecError(flag, value if shown is None else shown,
                        "a comma-separated list of " + ", ".join(MAIL_TYPES), f"{flag} END,FAIL")


def parse_bool(text: object, flag: str) -> bool:
    """``true``/``false`` (also yes/no, on/off, 1/0; a TOML boolean)."""
    if isinstance(text, bool):
        return text
    words = {"true": True, "yes": True, "on": True, "1": True,
             "false": False, "no": False, "off": False, "0": False}
    if isinstance(text, str) and text.strip().lower() in words:
        return words[text.strip().lower()]
    raise SpecError(flag, text, "true or false", f"{flag.split()[-1]} = true in hpc.toml, or {flag}")


def check_bool(value: object, flag: str) -> None:
    if not isinstance(value, bool):
        raise SpecError(flag, value, "true or false", f"{flag}")


AFTER_STATES = {"ok": "afterok", "any": "afterany", "notok": "afternotok", "failed": "afternotok",
                "start": "after", "started": "after"}
_AFTER = re.compile(r"([0-9]{1,12}(?:_[0-9]{1,9})?)(?::([a-z]+))?")
_AFTER_VALID = ("JOB or JOB:STATE, JOB a Slurm job id (or ARRAY_TASK), STATE one of "
                + ", ".join(AFTER_STATES) + " (default ok: start after JOB completed successfully)")


def parse_after(text: object, flag: str = "--after") -> str:
    """``--after JOB[:STATE]`` -> Slurm's dependency ``TYPE:JOB`` (``1234:any`` -> ``afterany:1234``)."""
    m = _AFTER.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if isinstance(text, int) and not isinstance(text, bool):
        m = _AFTER.fullmatch(str(text))
    if not m or (m.group(2) or "ok") not in AFTER_STATES:
        raise SpecError(flag, text, _AFTER_VALID, f"{flag} 1234:ok")
    return f"{AFTER_STATES[m.group(2) or 'ok']}:{m.group(1)}"


def check_after(value: object, flag: str = "--after") -> None:
    """Checks a dependency as :func:`parse_after` writes it (``afterok:1234``)."""
    types = set(AFTER_STATES.values())
    kind, _, job = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind not in types or not re.fullmatch(r"[0-9]{1,12}(?:_[0-9]{1,9})?", job):
        raise SpecError(flag, value, _AFTER_VALID, f"{flag} 1234:ok")


MAX_SETUP_LINE = 4096
SETUP_EOF = "HPC_SETUP_EOF"


def check_setup_line(value: object, flag: str = "--setup") -> None:
    """Checks one ``--setup`` line: a shell command on one line (no line breaks, NUL or other
    control characters except tabs), at most 4096 characters, not the heredoc's end marker."""
    valid = ("one shell command on one line (no line breaks, NUL or other control characters), "
             f"at most {MAX_SETUP_LINE} characters")
    if not isinstance(value, str) or value.strip() == "":
        raise SpecError(flag, value, valid, f"{flag} 'module load cuda/12.4'")
    if _control(value.replace("\t", " ")) or len(value) > MAX_SETUP_LINE or value.strip() == SETUP_EOF:
        raise SpecError(flag, value, valid, f"{flag} 'module load cuda/12.4'")


def check_mount(value: object, flag: str = "--container-mounts") -> None:
    """Checks one container mount ``SRC[:DST[:FLAGS]]``: paths without commas (pyxis and
    Apptainer separate mounts with commas), line breaks, control characters or backslashes."""
    valid = ("SRC[:DST[:FLAGS]] with absolute paths, without commas, blanks, line breaks, control "
             "characters or backslashes")
    example = f"{flag} /datasets:/data:ro"
    if not isinstance(value, str) or not value.startswith("/"):
        raise SpecError(flag, value, valid, example)
    if (_control(value) or any(c.isspace() or c in ",\\" for c in value) or len(value) > MAX_PATH
            or value.count(":") > 2):
        raise SpecError(flag, value, valid, example)
