"""No module under tests/ imports a test module (``test_*.py``): helpers that test modules share
live in support modules (tests/<tier>/support.py and the like). A test module that another
imports is imported twice (pytest imports it by its basename, the importer as
``tests.<tier>.test_x``: two copies of each helper and constant), and moving or renaming one
test module breaks tests in another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def _is_test_module(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("test_")


def _imported_modules(source: str, package: list[str], filename: str) -> list[tuple[int, str]]:
    """Every module the source imports, at any nesting level, as (line, absolute dotted name);
    ``package`` is the dotted parts of the package the source is in (for relative imports)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # ``from tests.slurm import test_x``: a name imported from a package may be a module
            found += [(node.lineno, f"{module}.{alias.name}" if module else alias.name)
                      for alias in node.names if alias.name != "*"]
    return found


def test_the_check_sees_every_kind_of_import() -> None:
    source = ("import tests.slurm.test_a as a\n"
              "from tests.unit.test_b import x\n"
              "def f():\n"
              "    from .test_c import y\n"
              "    if True:\n"
              "        from . import test_d\n"
              "    from ..distributed import test_e\n"
              "from tests.unit.support import helper\n"
              "import os.path\n")
    found = _imported_modules(source, ["tests", "unit"], "probe.py")
    assert sorted((line, m) for line, m in found if _is_test_module(m)) == [
        (1, "tests.slurm.test_a"), (2, "tests.unit.test_b"), (4, "tests.unit.test_c"),
        (6, "tests.unit.test_d"), (7, "tests.distributed.test_e")]


def test_no_module_under_tests_imports_a_test_module() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        package = list(path.relative_to(ROOT).parent.parts)
        for line, module in _imported_modules(path.read_text(), package, str(path)):
            if _is_test_module(module):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offenders, ("move what these use into a support module (no test_*.py):\n"
                           + "\n".join(offenders))


def test_no_product_file_speaks_of_the_work_sessions_that_made_it() -> None:
    """The docs, results and code speak of the product: "this session", "the previous
    session" say how the work was organised, and date a figure without saying what it is."""
    import re

    root = Path(__file__).resolve().parents[2]
    said = re.compile(r"\b(this|that|previous|last|next|earlier|a later) session\b", re.IGNORECASE)
    files = [root / "README.md", *(root / "docs").rglob("*.md"), *(root / "benchmarks").rglob("*.md"),
             *(root / "benchmarks").rglob("*.py"), *(root / "runtime").rglob("*.py"), *(root / "hpc").rglob("*.py")]
    found = [f"{f.relative_to(root)}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
             if said.search(line)]
    assert found == []


def test_every_results_file_opens_with_its_current_figures() -> None:
    """A reader of ``benchmarks/RESULTS-*.md`` finds the current figures first, with the command
    that made them (history lives in git and in the sections after them)."""
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    late = []
    for f in sorted(root.glob("RESULTS-*.md")):
        head = "\n".join(f.read_text().splitlines()[:12])
        if "The current figures" not in head or "benchmarks/" not in head:
            late.append(f.name)
    assert late == [], f"open with 'The current figures' and the command: {late}"


def test_the_campaign_record_is_the_current_campaign() -> None:
    """``benchmarks/campaign.json`` is the current campaign at its top level and nothing else: no
    ``earlier`` campaigns, no superseded runs beside it (git history keeps those, and
    RESULTS-campaign.md names the commit). Its summary is what ``campaign.py --merge`` makes of
    its runs, so the record reads back through the campaign's own reader."""
    import json
    import sys

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    campaign = json.loads((root / "campaign.json").read_text())
    assert list(campaign)[0] == "current" and "runs" in campaign
    assert "earlier" not in campaign
    keys = {"current", "config", "seeds", "contenders", "runs", "failed", "pictures", "references",
            "machine", "what", "commands", "commit", "skipped", "cut_short"}
    assert set(campaign) <= keys, f"not part of one campaign's record: {sorted(set(campaign) - keys)}"
    sys.path.insert(0, str(root))
    import campaign_metrics as cm

    assert cm.merge([campaign])["contenders"] == campaign["contenders"]


_SESSION_NUMBER = r"\bsessions?[\s-]+\d+\b(?!\.\d)"  # "Session 14", "session-9"; not "Session 0.99" (a ratio)
_SESSION_KEY = r"(?:^|_)s\d+(?:_|$)"             # "inprocess_s12_3seeds", "paired_3seeds_s9"


def _sessions_named(root: Path) -> list[str]:
    """Where a product file names a work session by its number: a line of README.md, docs/*.md or
    benchmarks/*.md, a top-level ``what``/``current`` string of benchmarks/*.json, or a key of
    benchmarks/campaign.json at any depth (as ``path:line`` or ``path:key``)."""
    import json
    import re

    said, key = re.compile(_SESSION_NUMBER, re.IGNORECASE), re.compile(_SESSION_KEY)
    found = []
    for f in [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "benchmarks").glob("*.md"))]:
        text = f.read_text()   # whole, so that "session\n  10" split by a line break is seen
        found += [f"{f.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}" for m in said.finditer(text)]
    for f in sorted((root / "benchmarks").glob("*.json")):
        record = json.loads(f.read_text())
        if isinstance(record, dict):
            found += [f"{f.relative_to(root)}:{k}" for k in ("what", "current")
                      if k in record and said.search(json.dumps(record[k]))]

    def keys(value: object) -> list[str]:
        if isinstance(value, dict):
            return [k for k, v in value.items() for k in (k, *keys(v))]
        return [k for v in value for k in keys(v)] if isinstance(value, list) else []

    campaign = root / "benchmarks" / "campaign.json"
    found += [f"{campaign.relative_to(root)}:{k}" for k in sorted(set(keys(json.loads(campaign.read_text()))))
              if key.search(k)]
    return found


def test_the_session_check_tells_a_work_session_from_the_session_class() -> None:
    import re

    said, key = re.compile(_SESSION_NUMBER, re.IGNORECASE), re.compile(_SESSION_KEY)
    for text in ("Session 14 (2026-11-27): all four contenders", "measured in session 9", "sessions 9 and 10",
                 "passes on an H200 (session 9)", "the session-9 note", "22.9 median in session\n  10"):
        assert said.search(text), text
    for text in ("the Session's step overhead", "`Session` 0.9931 (0.9810-1.0090)", "Session 0.9931 at 10 ms",
                 "import runtime.session", "session_start events", "a Session per process, 2 sessions"):
        assert not said.search(text), text
    assert all(key.search(k) for k in ("inprocess_s12_3seeds", "paired_3seeds_s9", "s10"))
    assert not any(key.search(k) for k in ("lost_node_s", "lost_node_s_slurm", "steps", "seeds", "seed_2"))


def test_no_product_file_names_a_work_session_by_number() -> None:
    """A figure is dated by its date and commit, not by the work session that measured it: "Session
    14 (2026-11-27)" or a record key ``..._s12`` tells a reader nothing about the product, and the
    product's ``Session`` (the training loop's object) reads the same word."""
    assert _sessions_named(Path(__file__).resolve().parents[2]) == []
