"""Test modules have unique basenames across tiers: the tiers' folders are no packages, so two
``test_x.py`` stop ``pytest -m "not slurm"`` (scripts/test.sh) at collection ("import file
mismatch"), while a tier run alone (land.sh runs tests/unit) does not notice."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" not in path.parts:
            where[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, f"rename one of each: {shared}"
