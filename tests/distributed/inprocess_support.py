"""Helpers that the in-process recovery tests share (issue 26), on real processes (gloo, CPU).

* A world of Session workers (``scripts/inproc_train.py``, DDP) on a TCPStore the test hosts, as
  the launcher does (:func:`run_world`), and what each worker wrote: its steps, its result.
* A job through ``hpc run --recovery inprocess`` (:func:`hpc_run`): its workers' step lines, a
  worker SIGKILLed once a condition on its lines holds, the job's events.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "scripts" / "inproc_train.py"
STEPS, GLOBAL_BATCH = 20, 12


def run_world(tmp_path: Path, *, kill_rank: int | None = None, kill_at: int = 6,
              fault: str = "", world: int = 3, window_s: float = 5.0,
              extra: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen], list[int], Path]:
    import torch.distributed as dist

    out = tmp_path / "out dir"
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="1", HPC_RECOVERY="inprocess",
                   HPC_INPROC_STORE=f"127.0.0.1:{store.port}", HPC_JOB_DIR=str(tmp_path / "job"),
                   WANDB_MODE="disabled", HPC_INPROC_WINDOW_S=str(window_s), PYTHONPATH=str(REPO))
        env.pop("HPC_TEST_INPROC_FAULT", None)
        if fault:
            env["HPC_TEST_INPROC_FAULT"] = fault
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out), "--steps",
                                       str(STEPS), "--global-batch", str(GLOBAL_BATCH), *extra], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    if kill_rank is not None:
        victim = procs[kill_rank]
        deadline = time.time() + 240
        while len(steps_of(out, victim.pid)) < kill_at:
            assert time.time() < deadline and victim.poll() is None, "the victim never reached its step"
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
    codes = []
    for p in procs:
        try:
            p.wait(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
        codes.append(p.returncode)
    store_keep = store   # noqa: F841 - the store lives until every worker ended
    return procs, codes, out


def steps_of(out: Path, pid: int) -> list[dict]:
    f = out / f"steps-{pid}.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def result_of(out: Path, pid: int) -> dict:
    return json.loads((out / f"result-{pid}.json").read_text())


def logs(procs: list[subprocess.Popen]) -> str:
    return "\n".join(f"--- pid {p.pid} ---\n{(p.stdout.read() if p.stdout else '')[-3000:]}" for p in procs)


def expected_batches() -> list[int]:
    from runtime.sampler import ResumableSampler
    s = ResumableSampler(600, global_batch=GLOBAL_BATCH, seed=3)
    return [s.next_global_batch()[0] for _ in range(STEPS)]


# --- through `hpc run --recovery inprocess` ------------------------------------------------


def hpc_run(out: Path, job: Path, steps: int, *extra: str, train: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    out.mkdir()
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO), HPC_INPROC_WINDOW_S="5")
    return subprocess.Popen([sys.executable, "-m", "hpc", "run", str(SCRIPT), *extra, "--recovery",
                             "inprocess", "--job-dir", str(job), "--", "--out", str(out), "--steps",
                             str(steps), "--step-sleep", "0.2", *train],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(run: subprocess.Popen, cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.time() < deadline and run.poll() is None, f"{what}: {run.stdout.read() if run.poll() is not None else ''}"
        time.sleep(0.05)


def events(job: Path) -> list[dict]:
    return [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]


def lines(out: Path) -> dict[int, list[dict]]:
    """pid -> its step lines."""
    return {int(f.stem.split("-")[1]): [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            for f in out.glob("steps-*.jsonl")}


def kill_when(run: subprocess.Popen, out: Path, pick, deadline: float) -> int:
    """SIGKILLs the first worker ``pick(pid, its lines)`` chooses; returns its pid."""
    while True:
        assert time.time() < deadline and run.poll() is None, run.stdout.read() if run.stdout else ""
        for pid, ran in lines(out).items():
            if ran and pick(pid, ran):
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.05)
