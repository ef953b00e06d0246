"""How fast does a job get back to training after each kind of fault? (real test cluster)

On the repo's 3-node Slurm test cluster (root; it is brought up if needed), the example
trainer (tiny preset, 2 nodes x 2 processes, a checkpoint every 4 steps) is hit by:

- a warning signal (``scancel --signal=USR2``): signal -> all ranks exited with a committed
  checkpoint;
- a worker SIGKILL: crash -> the elastic agent restarted the workers and a step completed;
- a node crash (everything in its namespace killed, ``--nodes 2:3``): crash -> the survivors
  completed a step at the smaller world size;
- a requeue (``scontrol requeue``): requeue -> the next allocation completed a step;
- a worker frozen with SIGSTOP (nothing exits): freeze -> the stall watch dumped the stacks,
  restarted the workers and a step completed (``--stall-timeout auto``: a 20-s floor);
- a node's link cut (``ip link set <veth> down``; its processes live on, ``--nodes 2:3``):
  cut -> the survivors completed a step at the smaller world size;

and for each it reports seconds and the steps lost (steps done after the last committed
checkpoint, redone after the resume). The baseline, measured in the same run, is a cold
start: submit -> first completed step. Ratios say how much of a recovery is more than
starting from scratch. Times come from rank 0's ``progress.json`` (written every step here).

    python benchmarks/recovery.py [--json PATH] [--only liveness]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_gpt.py"


def _cluster():
    spec = importlib.util.spec_from_file_location("slurm_cluster", REPO / "tests/cluster/slurm_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["slurm_cluster"] = mod
    spec.loader.exec_module(mod)
    return mod


def progress(job: Path) -> dict:
    try:
        return json.loads((job / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def wait(pred, timeout: float, what: str) -> float:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return time.time()
        time.sleep(0.05)
    raise SystemExit(f"recovery bench: timed out waiting for {what}")


def resumed(job: Path) -> bool:
    """Rank 0 trains again after a restart of the workers, from a checkpoint (the job started
    at step 0). Not its restart count: a node whose own workers did not fail restarts them for
    the membership change, which torch does not count (rank 0's count stays 0)."""
    p = progress(job)
    return p.get("start_step", 0) > 0 and p["step"] > p["start_step"]


def outcomes(job: Path) -> list[dict]:
    p = job / "outcomes.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


class Bench:
    def __init__(self, env: dict[str, str], root: Path) -> None:
        self.env, self.root, self.n = env, root, 0

    def submit(self, *extra: str, steps: int = 400) -> tuple[str, Path, float]:
        self.n += 1
        job = self.root / f"job{self.n}"
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "hpc", "submit", str(TRAIN), "--nproc-per-node", "2",
                            "--job-dir", str(job), "--checkpoint-every-steps", "4",
                            "--env", "HPC_PROGRESS_EVERY_S=0", *extra, "--", "--preset", "tiny",
                            "--max-steps", str(steps), "--step-sleep", "0.2",
                            "--global-batch", "24", "--micro-batch", "2"],
                           env=self.env, capture_output=True, text=True, cwd=REPO)
        if r.returncode:
            raise SystemExit(r.stdout + r.stderr)
        return (job / "slurm_job_id").read_text().strip(), job, t0

    def cancel(self, job_id: str) -> None:
        """Cancels the job and waits until Slurm has no trace of it running (ports, CPUs)."""
        def gone() -> bool:
            subprocess.run(["scancel", job_id], env=self.env)
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=self.env,
                                 capture_output=True, text=True).stdout.strip()
            return out in ("", "COMPLETED", "CANCELLED")
        wait(gone, 60, f"job {job_id} to end")


def worker_pids(sc, node: str) -> list[int]:
    """Our workers on ``node`` (tests/cluster/slurm_cluster.py finds them)."""
    return sc.node_processes(node, lambda argv: b"runtime.worker" in argv)


def node_fault(b: Bench, sc, cluster, res: dict[str, float], fault, node: str, key: str,
               timeout: float, *, at_progress: bool = False) -> None:
    """A 3-node job at step 10, ``fault`` on ``node``, then training on 2 nodes again:
    ``res[key + "_to_resume_s"]`` and the steps lost. ``at_progress``: stop the clock at the
    progress record's own time (the record may be read a poll later)."""
    job_id, job, _ = b.submit("--nodes", "2:3", "--max-restarts", "3")
    wait(lambda: progress(job).get("step", 0) >= 10 and progress(job).get("world_size") == 6, 180,
         "step 10 on 3 nodes")
    before = progress(job)["step"]
    t = time.time()
    fault(cluster, node)
    wait(lambda: progress(job).get("world_size") == 4 and progress(job)["step"] > progress(job)["start_step"]
         and (not at_progress or progress(job)["time"] > t), timeout, f"training on the survivors ({key})")
    res[f"{key}_to_resume_s"] = (progress(job)["time"] if at_progress else time.time()) - t
    res[f"{key}_steps_lost"] = before - progress(job)["start_step"]
    b.cancel(job_id)
    sc.restore(cluster)


def stall_cases(b: Bench, sc, cluster, res: dict[str, float]) -> None:
    """The two stalls that kill no process (issue 11): a frozen worker, a cut link."""
    # 5. Worker SIGSTOP -> the stall watch kills the node's workers -> a step completes.
    job_id, job, _ = b.submit("--nodes", "2", "--max-restarts", "3")
    wait(lambda: progress(job).get("step", 0) >= 10, 180, "step 10")
    before = progress(job)["step"]
    t = time.time()
    os.kill(worker_pids(sc, "node2")[0], signal.SIGSTOP)
    wait(lambda: resumed(job),
         180, "training after the frozen worker's restart")
    res["worker_freeze_to_resume_s"] = time.time() - t
    res["worker_freeze_steps_lost"] = before - progress(job)["start_step"]
    b.cancel(job_id)

    # 6. Link of a non-rendezvous node cut -> the survivors complete a step.
    node_fault(b, sc, cluster, res, sc.cut, "node3", "node_cut", 300)


def succession_cases(b: Bench, sc, cluster, res: dict[str, float]) -> None:
    """The rendezvous host lost (issue 12): the survivors elect a new host, same allocation."""
    for fault, key in ((sc.crash, "rdzv_node_crash"), (sc.cut, "rdzv_node_cut")):
        node_fault(b, sc, cluster, res, fault, "node1", key, 300, at_progress=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--json", default="")
    p.add_argument("--only", choices=("all", "liveness", "succession"), default="all",
                   help="liveness: the cold start, then the worker freeze and the link cut only; "
                        "succession: the cold start, then the rendezvous node crashed and cut")
    args = p.parse_args()
    sc = _cluster()
    cluster = sc.Cluster(Path(os.environ.get("HPC_TEST_CLUSTER_DIR", "/run/hpc-test-cluster")), 3)
    sc.up(cluster)
    env = {**os.environ, "SLURM_CONF": str(cluster.state_dir / "etc" / "slurm.conf"),
           "WANDB_MODE": "offline"}
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hpc-recovery-") as tmp:
        b = Bench({**env, "HPC_HOME": tmp}, Path(tmp))

        # Baseline: cold start, submit -> first completed step.
        job_id, job, t0 = b.submit("--nodes", "2")
        res["cold_start_s"] = wait(lambda: progress(job).get("step", 0) >= 1, 180, "first step") - t0
        if args.only in ("liveness", "succession"):
            b.cancel(job_id)
            (stall_cases if args.only == "liveness" else succession_cases)(b, sc, cluster, res)
            report(res, args.json)
            return

        # 1. Warning signal -> every rank exited with a committed checkpoint.
        wait(lambda: progress(job).get("step", 0) >= 10, 120, "step 10")
        t = time.time()
        subprocess.run(["scancel", "--signal=USR2", job_id], env=b.env, check=True)
        wait(lambda: bool(outcomes(job)), 120, "the stop outcome")
        o = outcomes(job)[-1]
        res["signal_to_exit_s"] = o["time"] - t
        res["signal_steps_lost"] = o.get("lost_steps") or 0
        # 4. The requeue that follows -> the next allocation completes a step.
        t = o["time"]
        wait(lambda: progress(job).get("allocation") == 1 and progress(job)["step"] > progress(job)["start_step"],
             180, "the requeued allocation's first step")
        res["requeue_to_resume_s"] = time.time() - t
        b.cancel(job_id)

        # 2. Worker SIGKILL -> agent restarts the workers -> a step completes.
        job_id, job, _ = b.submit("--nodes", "2", "--max-restarts", "3")
        wait(lambda: progress(job).get("step", 0) >= 10, 180, "step 10")
        before = progress(job)["step"]
        t = time.time()
        os.kill(worker_pids(sc, "node2")[0], signal.SIGKILL)
        wait(lambda: resumed(job),
             180, "training after the worker restart")
        res["worker_crash_to_resume_s"] = time.time() - t
        res["worker_crash_steps_lost"] = before - (progress(job)["start_step"])
        b.cancel(job_id)

        # 3. Node crash (not the rendezvous host) -> the survivors complete a step.
        node_fault(b, sc, cluster, res, sc.crash, "node3", "node_crash", 180)
        stall_cases(b, sc, cluster, res)
        succession_cases(b, sc, cluster, res)
    report(res, args.json)


def report(res: dict[str, float], json_path: str) -> None:
    cold = res["cold_start_s"]
    print(f"{'event':<28} | {'seconds':>8} | {'x cold start':>12} | steps lost")
    print(f"{'cold start (baseline)':<28} | {cold:8.2f} | {1:12.2f} | -")
    for key, lost in (("signal_to_exit_s", "signal_steps_lost"), ("requeue_to_resume_s", None),
                      ("worker_crash_to_resume_s", "worker_crash_steps_lost"),
                      ("node_crash_to_resume_s", "node_crash_steps_lost"),
                      ("worker_freeze_to_resume_s", "worker_freeze_steps_lost"),
                      ("node_cut_to_resume_s", "node_cut_steps_lost"),
                      ("rdzv_node_crash_to_resume_s", "rdzv_node_crash_steps_lost"),
                      ("rdzv_node_cut_to_resume_s", "rdzv_node_cut_steps_lost")):
        if key in res:
            print(f"{key:<28} | {res[key]:8.2f} | {res[key] / cold:12.2f} | {res.get(lost, '-') if lost else 0}")
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
