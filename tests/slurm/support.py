"""Helpers the slurm tier's tests share: the example trainer submitted with ``hpc submit``, the
job awaited, its job directory read (outcomes, progress, checkpoints, events) and compared with
an uninterrupted run (:class:`Baseline`, which tests/slurm/conftest.py starts once per session)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from runtime.liveness import proc
from tests.conftest import squeue_state, wait_until
from tests.wandb_offline import read_run

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_gpt.py"
STEPS = 40


def hpc(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


# A global batch that divides at world size 4 and 6 (2 or 3 nodes x 2 processes).
ELASTIC = ("--global-batch", "24", "--micro-batch", "2")


class Baseline(Mapping):
    """The uninterrupted run, locally: 2 nodes x 2 processes, same seed (world size 4), as its
    result.json. Started when made, awaited at the first read, so that it runs while the first
    test using it waits for its cluster job (not while that test holds the cluster idle: 20-57 s
    under CI's load). The fixtures ``baseline`` and ``elastic_baseline`` (tests/slurm/conftest.py)
    make one each per session."""

    def __init__(self, tmp: Path, *train: str) -> None:
        self.job = tmp / "job"
        self.run = subprocess.Popen([sys.executable, "-m", "hpc", "run", str(TRAIN), "--nodes", "2",
                                     "--nproc-per-node", "2", "--job-dir", str(self.job), "--",
                                     "--preset", "tiny", *train],
                                    cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._result: dict | None = None

    def result(self) -> dict:
        """The run's result.json, once it ended (fails with its output if it did not succeed)."""
        if self._result is None:
            out, _ = self.run.communicate(timeout=300)
            assert self.run.returncode == 0, out[-4000:]
            self._result = json.loads((self.job / "result.json").read_text())
        return self._result

    def stop(self) -> None:
        """Ends the run if nobody read it (the session's end)."""
        if self.run.poll() is None:
            self.run.kill()
            self.run.communicate()

    def __getitem__(self, key: str) -> object:
        return self.result()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.result())

    def __len__(self) -> int:
        return len(self.result())

    def __repr__(self) -> str:
        return repr(self._result) if self._result is not None else f"Baseline({self.job}, running)"


def submit(env: dict[str, str], job: Path, *hpc_args: str, train: tuple[str, ...] = ("--step-sleep", "0.3")) -> str:
    r = hpc(env, "submit", str(TRAIN), "--nproc-per-node", "2", "--job-dir", str(job),
            "--checkpoint-every-steps", "2", *hpc_args, "--", "--preset", "tiny", *train)
    assert r.returncode == 0, r.stdout + r.stderr
    return (job / "slurm_job_id").read_text().strip()


def progress(job: Path) -> dict:
    return json.loads((job / "progress.json").read_text())


def latest_step(job: Path) -> int:
    latest = job / "checkpoints" / "latest"
    try:
        return int(latest.read_text().strip().split("-")[-1])
    except (FileNotFoundError, ValueError):
        return 0


def squeue(env: dict[str, str], job_id: str) -> str:
    """The job's state, "" once it left the queue ("UNKNOWN" when squeue failed: not gone)."""
    state = squeue_state(env, job_id)
    return "" if state == "GONE" else state


def wait_done(env: dict[str, str], job_id: str, job: Path, timeout: float = 400) -> None:
    wait_for_job(env, job_id, job, lambda: squeue(env, job_id) in ("", "COMPLETED", "FAILED", "CANCELLED"),
                 timeout, f"job {job_id} to end")


def wait_for_job(env: dict[str, str], job_id: str, job: Path, pred, timeout: float, what: str) -> None:
    """:func:`wait_until` that fails with the job's story: Slurm's record, its outcomes and
    events, the tails of its batch output and its last node logs."""
    try:
        wait_until(pred, timeout, what)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{job_story(env, job_id, job)}") from None


def job_story(env: dict[str, str], job_id: str, job: Path) -> str:
    show = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True)
    parts = [f"scontrol show job {job_id}:\n{show.stdout}{show.stderr}", f"outcomes: {outcomes(job)}"]
    ev = job / "events.jsonl"
    if ev.exists():
        parts.append("events (last 40):\n" + "\n".join(ev.read_text(errors="replace").splitlines()[-40:]))
    for f in [*sorted(job.glob("logs/slurm-*.out")), *sorted(job.glob("logs/alloc-*/node-*.log"))[-3:]]:
        parts.append(f"--- {f.relative_to(job)} (tail):\n{f.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)


def outcomes(job: Path) -> list[dict]:
    path = job / "outcomes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def restarts(env: dict[str, str], job_id: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True,
                         text=True).stdout
    return int(out.split("Restarts=")[1].split()[0]) if "Restarts=" in out else -1


def assert_same_as_baseline(job: Path, baseline: dict, *, weights: bool = True) -> dict:
    result = json.loads((job / "result.json").read_text())
    assert result["final_step"] == STEPS
    assert result["sample_order_sha256"] == baseline["sample_order_sha256"], "samples lost or repeated"
    if weights:
        assert result["weights_sha256"] == baseline["weights_sha256"]
    run = read_run(job / "wandb", (job / "wandb_run_id").read_text().strip())
    fallback = job / "metrics.jsonl"
    rank0 = sorted(job.glob("logs/alloc-*/restart-*/rank-0.log"))
    why = (f"W&B files {[(str(f.relative_to(job)), f.stat().st_size) for f in run.files]}; "
           f"outcomes {outcomes(job)}; "
           f"fallback: {fallback.read_text()[-2000:] if fallback.exists() else 'none'}; "
           f"last rank-0 log: {rank0[-1].read_text()[-3000:] if rank0 else 'none'}")
    assert len(run.run_ids) == 1, why
    assert len(run.steps) == len(set(run.steps)), f"a step was logged twice: {run.steps}"
    assert run.steps and max(run.steps) == STEPS, why
    return result


# --- in-process recovery on the cluster ------------------------------------------------------

def workers(node: str) -> set[int]:
    """The training processes in ``node``'s network namespace (not the launchers)."""
    cluster = sys.modules["hpc_test_slurm_cluster"]
    out = subprocess.run(["ip", "netns", "pids", cluster.netns_name(node)], capture_output=True,
                         text=True).stdout.split()
    found = set()
    for pid in map(int, out):
        # The command line a worker runs (a warm standby that became a joiner: its order's);
        # an idle standby (``runtime.inprocess.worker.standby``) is no worker.
        argv = proc.cmdline(pid)
        if "runtime.worker" in argv and any(a.endswith("train_gpt.py") for a in argv):
            found.add(pid)
    return found


def events(job: Path) -> list[dict]:
    path = job / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def twice(job: Path) -> list[int]:
    """Steps rank 0 recorded more than once (its step windows in ``events.jsonl``)."""
    runs = collections.Counter()
    for e in events(job):
        if e["ev"] == "steps":
            runs.update(range(int(e["first"]), int(e["last"]) + 1))
    return sorted(s for s, n in runs.items() if n > 1)
