"""How much Python a call runs, counted, not timed: the tests that hold a pure function's work
linear in its input compare the count at two sizes, whatever the machine's load."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def lines_run(f: Callable[[], Any]) -> int:
    """The lines of Python that ``f()`` executes (``sys.settrace`` line events: a loop's body
    counts once per turn, a comprehension's once per item); C code counts as the line calling it."""
    count = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return trace

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        f()
    finally:
        sys.settrace(before)
    return count
