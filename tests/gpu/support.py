"""The two in-process recovery scenarios of the NCCL path, through ``hpc run``: a fault on the
only rank, and one of two ranks SIGKILLed. tests/gpu/test_gpu_inprocess_nccl.py runs them on
NCCL, tests/distributed/test_inprocess_nccl_plan.py on CPU with the NCCL plan's steps on gloo."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
STEPS = 16


def hpc_run(out: Path, job: Path, nproc: int, **env: str) -> subprocess.Popen[str]:
    out.mkdir()
    full = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="60", **env)
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_RETHROW_CUDA_ERRORS", "NCCL_NVLS_ENABLE"):
        full.pop(name, None)   # the recovery sets them (a user's value is kept and warned about)
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), "--nproc-per-node", str(nproc),
                             "--recovery", "inprocess", "--max-restarts", "1", "--job-dir", str(job),
                             "--", "--out", str(out), "--steps", str(STEPS), "--step-sleep", "0.1"],
                            env=full, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def lines(out: Path) -> dict[int, list[dict]]:
    """pid -> its step lines."""
    return {int(f.stem.split("-")[1]): [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            for f in out.glob("steps-*.jsonl")}


def results(out: Path) -> dict[int, dict]:
    return {r["pid"]: r for r in (json.loads(f.read_text()) for f in out.glob("result-*.json"))}


def recoveries(job: Path) -> list[dict]:
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in events if e["ev"] == "inproc_recovery"]


def fault_on_one_rank(tmp_path: Path, backend: str, **env: str) -> None:
    """A fault injected on the only rank between its reduction and its optimizer step."""
    out, job = tmp_path / "out", tmp_path / "job"
    run = hpc_run(out, job, 1, HPC_TEST_INPROC_FAULT="0:5:fail", **env)
    text, _ = run.communicate(timeout=300)
    assert run.returncode == 0, text[-5000:]
    ran = lines(out)
    [pid] = ran   # one process trained every step: nothing was restarted
    [res] = results(out).values()
    assert res["pid"] == pid and res["step"] == STEPS and res["world"] == 1
    twice = [s for s, n in collections.Counter(x["step"] for x in ran[pid]).items() if n > 1]
    assert twice == [5], twice   # the failed step, computed again, and only it
    [rec] = recoveries(job)
    assert rec["backend"] == backend and "nccl_aborted" in rec, rec
    assert rec["nccl_aborted"] >= (1 if backend == "nccl" else 0), rec
    assert rec["step"] == 5 and rec["world_size"] == 1, rec


def kill_one_of_two(tmp_path: Path, backend: str, **env: str) -> None:
    """Rank 1 SIGKILLed mid-run; its launcher starts a joiner in its place."""
    out, job = tmp_path / "out", tmp_path / "job"
    run = hpc_run(out, job, 2, **env)
    try:
        deadline = time.time() + 240
        while True:
            assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
            ran = lines(out)
            victim = next((p for p, r in ran.items() if r and r[0]["rank"] == 1 and len(r) >= 6), None)
            if victim is not None and len(ran) == 2:
                break
            time.sleep(0.05)
        originals = set(ran)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        text, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, text[-5000:]
    [survivor] = originals - {victim}
    done = results(out)
    [joiner] = set(done) - {survivor}
    assert joiner not in originals and survivor in done, "the survivor was restarted"
    assert {r["step"] for r in done.values()} == {STEPS} and {r["world"] for r in done.values()} == {2}
    assert len({r["weights"] for r in done.values()}) == 1, "the replicas differ"
    ckpt = str(job / "checkpoints")
    assert not [f for r in done.values() for f in r["opened_while_recovering"] if f.startswith(ckpt)]
    rec = recoveries(job)
    assert rec and all(e["backend"] == backend and "nccl_aborted" in e for e in rec), rec
    assert rec[0]["nccl_aborted"] >= (1 if backend == "nccl" else 0), rec
    twice = [s for s, n in collections.Counter(x["step"] for x in lines(out)[survivor]).items() if n > 1]
    assert len(twice) <= 1, twice
    print(f"killed -> recovered {rec[-1]['t'] - killed_at:.2f} s (abort {rec[0]['t_abort'] - rec[0]['t_detect']:.3f} s)")
