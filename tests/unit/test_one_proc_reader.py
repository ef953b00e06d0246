"""One reader of ``/proc/PID/stat`` in the job's processes: :mod:`runtime.liveness.proc`.

Its fields are easy to read wrong (a command name with spaces or parentheses shifts every
field after it, a zombie has no start time); five modules once parsed it, each its own way.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
READER = REPO / "runtime" / "liveness" / "proc.py"
STAT = re.compile(r"""/stat["'})]""")   # "/proc/{pid}/stat", f"/proc/self/stat" ... (not /proc/stat)


def test_only_the_proc_module_reads_a_process_stat_file():
    readers = []
    for path in sorted((REPO / "runtime").rglob("*.py")):
        text = path.read_text()
        if path != READER and any(STAT.search(line) and "/proc/stat" not in line for line in text.splitlines()):
            readers.append(str(path.relative_to(REPO)))
    assert readers == [], f"read /proc/PID/stat through runtime.liveness.proc instead: {readers}"


def test_the_pattern_finds_a_stat_reader():
    assert STAT.search('open(f"/proc/{pid}/stat")') and STAT.search("Path(f'/proc/{pid}/stat')")
    assert not STAT.search('open("/proc/stat")'.replace("/proc/stat", "/proc/uptime"))
