"""The built wheel carries every package, the templates and the console script (STYLE 12)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed


def test_wheel_holds_every_package_and_the_templates(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(REPO)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("hpc_elastic-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(str(p.parent.relative_to(REPO)) for root in ("hpc", "runtime")
                      for p in (REPO / root).rglob("__init__.py"))
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert missing == [], f"packages left out of the wheel: {missing}"
    assert "slurm_templates/sbatch_elastic.sh.j2" in names
    assert any(n.endswith("entry_points.txt") for n in names)
