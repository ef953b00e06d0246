"""A DeepSpeed ZeRO-3 script (examples/deepspeed_resume.py, no hpc import) under ``hpc run`` on
two gloo processes: the warning signal makes it save (``engine.save_checkpoint`` of every
rank's partitions) and exit 75, and the resumed run ends bit-equal to an uninterrupted one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "examples" / "deepspeed_resume.py"
ARGS = ("--zero", "3", "--steps", "20", "--ckpt-every", "5", "--step-sleep", "0.1")


def start(job: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "2",
                             "--job-dir", str(job), "--", *ARGS], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen) -> tuple[int, str]:
    out, _ = p.communicate(timeout=600)   # a cold cache: the first init_distributed compiles a CPU op
    return p.returncode, out


def test_a_zero3_script_saves_on_the_warning_and_resumes_bit_equal(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is in the 'frameworks' extra (scripts/setup.sh "
                                            "installs it)")
    ref = tmp_path / "reference"
    code, out = finish(start(ref))
    assert code == 0, out
    expected = json.loads((ref / "result.json").read_text())

    job = tmp_path / "stopped"
    p = start(job)
    logs = job / "logs"
    deadline = time.time() + 120
    while time.time() < deadline and not any("fresh start" in f.read_text(errors="replace")
                                             for f in logs.glob("alloc-*/restart-*/rank-0.log")):
        time.sleep(0.1)
    time.sleep(0.8)                     # a few steps of 0.1 s in
    p.send_signal(signal.SIGUSR2)       # what Slurm's warning does (hpc run forwards it)
    code, out = finish(p)
    assert code == 75, out
    assert "saved, stopping" in out, out
    stopped_at = json.loads((job / "outcomes.jsonl").read_text().splitlines()[-1])
    code, out = finish(start(job))
    assert code == 0, out
    resumed = int(out.split("resumed at step ")[1].split()[0])
    assert 0 < resumed < 20, out
    final = json.loads((job / "result.json").read_text())
    assert final["weights_sha256"] == expected["weights_sha256"], (stopped_at, final, expected)
    assert final["steps"] == 20 and final["loss"] == expected["loss"]
