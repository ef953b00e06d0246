"""How an invalid JobSpec value is named: by its flag on the command line, by its field in Python.

The same :class:`~hpc.contract.jobspec.JobSpec` is built from flags (``hpc submit --time 4:00:00``)
and from Python (``JobSpec(time_limit_s=14400)``), and its checks are declared once, in flag
terms. An error in flag terms misleads a Python caller: ``time_limit_s="1:00:00"`` answered with
``Example: --time 1`` suggests a value that means one *minute* on the command line, for a field
in *seconds*. So the spec speaks Python by default (the field's name, its unit, its Python type
and a Python example, converted from the flag's example by the flag's own parser), and the CLI
asks for flag terms around the one place it builds a spec (:func:`cli_terms`).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import Field
from typing import Any, TypeVar

from hpc.contract import values
from hpc.contract.errors import SpecError

A = TypeVar("A")
B = TypeVar("B")
_CLI: ContextVar[bool] = ContextVar("hpc_spec_cli_terms", default=False)

# The Python type of a scalar field, said where its check speaks of text (tuples say it already).
_PY_TYPES = {"int": "an int", "float": "a float (or an int)", "bool": "a bool", "str": "a str"}
_UNITS = {"_s": "in seconds", "_min": "in minutes"}
# Fields whose flag example does not translate through a parser.
_PY_EXAMPLES = {"script": 'script="/home/me/train.py"',
                "script_args": 'script_args=("--lr", "3e-4")'}
_NODES_API = f"an int N or a tuple (MIN, MAX) of ints with 1 <= MIN <= MAX <= {values.MAX_NODES}"


@contextmanager
def cli_terms() -> Iterator[None]:
    """Within this block, JobSpec errors name flags (``--time``), not fields (``time_limit_s``)."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)


def in_cli_terms() -> bool:
    """Whether JobSpec errors name flags now (inside :func:`cli_terms`)."""
    return _CLI.get()


def pick(cli: A, api: B) -> A | B:
    """``cli`` inside :func:`cli_terms`, else ``api``: for what is written out in both terms."""
    return cli if in_cli_terms() else api


def python_example(f: Field, flag: str) -> str:
    """The field's example in Python: its flag example (``--time 4:00:00``) through the flag's
    parser (``time_limit_s=14400``, with the readable form for seconds)."""
    if f.name in _PY_EXAMPLES:
        return _PY_EXAMPLES[f.name]
    meta = f.metadata
    words = shlex.split(meta.get("example") or "")
    text = " ".join(words[1:])
    parse: Callable[[Any, str], Any] | None = meta.get("parse")
    if meta.get("flag"):
        value: Any = not words or not words[0].startswith("--no-")
    elif parse is not None and text:
        value = parse(text, flag)
    else:
        value = text
    shown = f"{f.name}={value!r}"
    if f.name.endswith("_s") and isinstance(value, int) and value >= 60:
        shown += f" ({values.format_time(value)})"
    return shown


def api_error(f: Field, value: object, flag: str, error: SpecError) -> SpecError:
    """``error`` (raised by the field's check, in flag terms) restated in Python terms.

    Args:
        f: The JobSpec field.
        value: The value the caller gave.
        flag: The field's flag (to run its parser on examples and on a value given as text).
        error: The check's error.
    """
    valid = error.valid.replace(" in ASCII digits", "")
    if f.name == "nodes" and valid.startswith(values._NODES_VALID):
        valid = _NODES_API + valid[len(values._NODES_VALID):]
    kind = _PY_TYPES.get(str(f.type), "")
    unit = next((u for suffix, u in _UNITS.items() if f.name.endswith(suffix)), "")
    about = ", ".join(x for x in (kind, unit) if x)
    hint = error.hint
    parse = f.metadata.get("parse")
    if (isinstance(value, str) and parse is not None and kind and kind != "a str"
            and not f.metadata.get("flag")):
        try:   # the text a flag takes: say what it means as this field's value
            meant = parse(value, flag)
        except SpecError:
            meant = None
        if meant is not None:
            hint = f"{flag} {value} on the command line is {f.name}={meant!r} in Python"
    return SpecError(f.name, value, f"{valid} ({about})" if about else valid,
                     python_example(f, flag), hint)
