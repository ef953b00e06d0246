"""A killed worker's joiner comes from the node's warm standby (``hpc run --recovery inprocess``).

The real launcher and torch's elastic agent on this machine (3 workers, gloo, DDP). Once the
launcher's warm standby runs (a process started after the workers, with torch and the Session
imported), a worker is SIGKILLed: the launcher hands the joiner's order to the standby instead
of starting a process. The outcome a user cares about: the job ends at world 3 with weights
bit-equal to an uninterrupted run (beside it, with the standby off), the joiner is the process
that was waiting before the fault, it writes where the dead worker wrote, and no checkpoint
was read. The rules (which environments may differ, /proc's view of it) are unit-tested in
tests/unit/test_standby.py; the time it saves is measured in benchmarks/warm_joiner.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.contract import recovery_settings
from runtime import node_files
from runtime.liveness import proc

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
STEPS = 120


def hpc_run(out: Path, job: Path, warm: bool) -> subprocess.Popen[str]:
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="60",
               **{recovery_settings.WARM_ENV: "1" if warm else "0"})
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", "3",
                             "--recovery", "inprocess", "--max-restarts", "1", "--job-dir", str(job),
                             "--", "--out", str(out), "--steps", str(STEPS), "--step-sleep", "0.15"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def standbys(job: Path) -> list[int]:
    """The job's standby processes (their command line names the standby module)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and node_files.STANDBY_MODULE in proc.cmdline(int(entry.name)) \
                and proc.environ(int(entry.name)).get("HPC_JOB_DIR") == str(job):
            out.append(int(entry.name))
    return out


def lines(out: Path) -> dict[int, list[dict]]:
    return {int(f.stem.split("-")[1]): [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            for f in out.glob("steps-*.jsonl")}


def test_a_killed_workers_joiner_is_the_warm_standby_and_the_weights_are_the_uninterrupted_ones(tmp_path: Path):
    plain = hpc_run(tmp_path / "plain out", tmp_path / "plain job", warm=False)
    out, job = tmp_path / "out", tmp_path / "job dir"
    run = hpc_run(out, job, warm=True)
    try:
        deadline = time.time() + 300
        waiting: list[int] = []
        while not waiting:
            assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
            waiting = standbys(job)
            time.sleep(0.2)
        victim = next(p for p, ran in lines(out).items() if ran and ran[0]["rank"] == 2)
        originals = set(lines(out))
        os.kill(victim, signal.SIGKILL)
        text, _ = run.communicate(timeout=300)
        plain_text, _ = plain.communicate(timeout=300)
    finally:
        for p in (run, plain):
            if p.poll() is None:
                p.kill()
    assert run.returncode == 0, text[-5000:]
    assert plain.returncode == 0, plain_text[-3000:]
    assert not standbys(tmp_path / "plain job")
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    replaced = [e for e in events if e["ev"] == "inproc_replace"]
    assert len(replaced) == 1 and replaced[0]["warm"] is True, replaced
    joiner = replaced[0]["pid"]
    assert [joiner] == waiting, (joiner, waiting)   # the process that waited before the fault
    ran = lines(out)
    assert set(ran) - originals == {joiner}
    results = {r["pid"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}
    assert set(results) == originals - {victim} | {joiner}
    assert {r["step"] for r in results.values()} == {STEPS} and {r["world"] for r in results.values()} == {3}
    expected = json.loads(next((tmp_path / "plain out").glob("result-*.json")).read_text())
    assert {r["weights"] for r in results.values()} == {expected["weights"]}, "not the uninterrupted run's weights"
    ckpt = str(job / "checkpoints")
    for r in results.values():
        assert not [f for f in r["opened_while_recovering"] if f.startswith(ckpt)], r
    rank2 = (job / "logs" / "alloc-0" / "restart-0" / "rank-2.log").read_text()
    assert "in-process join: taken in as rank 2" in rank2, rank2[-2000:]   # where the dead one wrote
    assert "from the warm standby" in text, text[-3000:]
    detect = next(e for e in events if e["ev"] == "inproc_detect")
    join = next(e for e in events if e["ev"] == "inproc_join")
    print(f"fault -> joiner asked {join['t_asked'] - detect['t']:.2f} s, -> state received "
          f"{join['t'] - detect['t']:.2f} s, load {os.getloadavg()[0]:.1f}")
