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
    import json

    campaign = json.loads((root / "campaign.json").read_text())
    assert list(campaign)[0] == "current" and "runs" in campaign and "earlier" in campaign
