"""What each test costs: a pytest plugin that writes one record per test (the suite's budget).

Each record (one JSON line in ``$HPC_TEST_COSTS/<lane>.jsonl``, default ``.test-costs/``):

- ``wall_s``: the test's setup, call and teardown;
- ``cpu_s``: CPU seconds of the pytest process and of every descendant it waited for (those of
  ``hpc run``, its launchers and their workers are waited for in turn); a Slurm job's processes
  are slurmd's children and are not in it;
- ``procs``: Python processes started while the test ran, from any process that inherited the
  environment (the venv's ``hpc_test_procs.pth``, written by ``scripts/setup.sh``, appends a line
  per interpreter start to the file ``HPC_TEST_PROCS`` names);
- ``tier``: the first of the test's tier markers.

``python -m tests.costs [DIR]`` prints the 25 most expensive tests by CPU and the totals per tier.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import pytest

TIERS = ("unit", "distributed", "slurm", "gpu")
DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".test-costs"
PROCS_ENV = "HPC_TEST_PROCS"


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def tier_of(item: pytest.Item) -> str:
    names = {m.name for m in item.iter_markers()}
    return next((t for t in TIERS if t in names), "unmarked")


class Costs:
    def __init__(self, out: Path, lane: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{lane}.jsonl"
        self.procs = out / f"{lane}.procs"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Any:
        self.procs.write_text("")
        os.environ[PROCS_ENV] = str(self.procs)
        t0, c0 = time.monotonic(), _cpu()
        yield
        wall, cpu = time.monotonic() - t0, _cpu() - c0
        try:
            procs = len(set(self.procs.read_text().split()))   # site may read a .pth twice
        except OSError:
            procs = 0
        with self.path.open("a") as f:
            f.write(json.dumps({"test": item.nodeid, "tier": tier_of(item), "wall_s": round(wall, 2),
                                "cpu_s": round(cpu, 2), "procs": procs, "t": time.time()}) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    out = Path(os.environ.get("HPC_TEST_COSTS") or DEFAULT_DIR)
    lane = os.environ.get("HPC_TEST_LANE") or f"pytest-{os.getpid()}"
    config.pluginmanager.register(Costs(out, lane), "hpc-test-costs")


def read(out: Path) -> list[dict[str, Any]]:
    rows = []
    for f in sorted(out.glob("*.jsonl")):
        rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return rows


def summary(rows: list[dict[str, Any]], top: int = 25) -> str:
    """The ``top`` tests by CPU and the totals per tier, as text (pure)."""
    lines = [f"{'cpu_s':>8} {'wall_s':>8} {'procs':>5}  test (the {top} most expensive by CPU)"]
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        lines.append(f"{r['cpu_s']:8.1f} {r['wall_s']:8.1f} {r['procs']:5d}  {r['test']}")
    lines.append(f"{'cpu_s':>8} {'wall_s':>8} {'procs':>5}  tier (tests)")
    tiers: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        tiers.setdefault(r["tier"], []).append(r)
    for name, rs in sorted(tiers.items(), key=lambda kv: -sum(r["cpu_s"] for r in kv[1])):
        lines.append(f"{sum(r['cpu_s'] for r in rs):8.1f} {sum(r['wall_s'] for r in rs):8.1f} "
                     f"{sum(r['procs'] for r in rs):5d}  {name} ({len(rs)})")
    lines.append(f"{sum(r['cpu_s'] for r in rows):8.1f} {sum(r['wall_s'] for r in rows):8.1f} "
                 f"{sum(r['procs'] for r in rows):5d}  all ({len(rows)})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(read(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR)))
