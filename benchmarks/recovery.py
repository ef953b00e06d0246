"""How fast does a job get back to training after each kind of fault, restarted or in-process?

On the repo's 3-node Slurm test cluster (root; brought up if needed, held with the cluster lock
for the whole run), the example trainer (tiny preset, ~0.2-s steps, a checkpoint every 4
steps, rank 0's ``progress.json`` written every step) runs as 2 nodes x 2 processes + 1 node
(``--nodes 2:3 --nproc-per-node 2 --max-restarts 3``: world 6) on each recovery **path**:

- ``restart``: today's path: every worker is restarted and reloads the last checkpoint;
- ``inprocess``: ``--recovery inprocess`` (issue 26): the survivors keep their processes and
  take the state from a peer's memory;

and meets one **fault** per job, at step 10 or later (none of them on node1, the rendezvous
host):

- ``worker_kill``: SIGKILL of one worker on node2;
- ``node_crash``: every process in node3's namespace SIGKILLed (slurmd included);
- ``link_cut``: node3's link taken down (its processes live on);
- ``freeze``: SIGSTOP of one worker on node2 (nothing exits, nothing is closed).

Per cell (path x fault): ``resume_s`` (fault -> the first step done after the recovery, at the
progress record's own time), ``steps_lost`` (steps computed twice: the highest step rank 0 had
done before the recovery minus the step training went on from), ``pids_kept`` (every worker
outside the fault's reach is the same process after the recovery), how it recovered (``how``:
``restart``, ``inprocess``, ``fallback`` -- the in-process path gave up and restarted, with
the launchers' ``inproc_fallback`` reasons -- or ``timeout``, with what was last seen), whether
a checkpoint was read after the fault, the in-process phases (``detect_s``, ``after_detect_s``,
abort/re-form/group/transfer) and the machine's 1-minute load at the fault and at the resume.
Every cell's job is also a cold start (submit -> first step), the baseline its ratio is to.

Unless ``--no-signal``, a 2-node job first measures the warning signal (``scancel
--signal=USR2`` -> every rank exited with a committed checkpoint) and the requeue after it
(-> the next allocation's first step). ``--only succession``: the rendezvous host crashed and
cut instead (issue 12), as before.

    python benchmarks/recovery.py [--paths restart inprocess] [--faults worker_kill ...]
        [--replacement wait|shrink] [--no-signal] [--json benchmarks/recovery.json [--merge]] [--only succession]
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import recovery_cells as rc  # noqa: E402

TRAIN = REPO / "examples" / "train_gpt.py"
CLUSTER_LOCK = Path("/run/hpc-test-cluster.lock")
FAULT_AT_STEP = 10


def _cluster():
    spec = importlib.util.spec_from_file_location("slurm_cluster", REPO / "tests/cluster/slurm_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["slurm_cluster"] = mod
    spec.loader.exec_module(mod)
    return mod


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def wait(pred, timeout: float, what: str) -> float:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return time.time()
        time.sleep(0.05)
    raise TimeoutError(f"recovery bench: timed out waiting for {what}")


class Bench:
    """Submits the benchmark's jobs into a temporary ``HPC_HOME`` and cleans up after each."""

    def __init__(self, env: dict[str, str], root: Path, sc: Any, cluster: Any, batch: tuple[int, int] = (24, 2)) -> None:
        self.env, self.root, self.sc, self.cluster, self.n = env, root, sc, cluster, 0
        self.batch = batch   # (global batch, micro-batch)

    def submit(self, *extra: str, steps: int = 400) -> tuple[str, Path, float]:
        self.n += 1
        job = self.root / f"job{self.n}-{time.strftime('%H%M%S')}"
        t0 = time.time()
        # Every step (0.01 s; 0 meant the 2-s default until runtime.session.progress_interval).
        r = subprocess.run([sys.executable, "-m", "hpc", "submit", str(TRAIN), "--nproc-per-node", "2",
                            "--job-dir", str(job), "--checkpoint-every-steps", "4",
                            "--env", "HPC_PROGRESS_EVERY_S=0.01", *extra, "--", "--preset", "tiny",
                            "--max-steps", str(steps), "--step-sleep", "0.2",
                            "--global-batch", str(self.batch[0]), "--micro-batch", str(self.batch[1])],
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

    def workers(self, node: str) -> list[int]:
        """Our workers on ``node`` (a forked one's command line is its order's: ``proc.cmdline``)."""
        from runtime.liveness import proc

        return [pid for pid in self.sc.node_processes(node, lambda argv: True)
                if "runtime.worker" in proc.cmdline(pid)]


def inject(b: Bench, fault: str) -> tuple[str, int | None]:
    """Causes ``fault``; returns the node it hit and the worker (None: the whole node)."""
    if fault in ("worker_kill", "freeze"):
        pid = b.workers("node2")[0]
        os.kill(pid, signal.SIGKILL if fault == "worker_kill" else signal.SIGSTOP)
        return "node2", pid
    (b.sc.crash if fault == "node_crash" else b.sc.cut)(b.cluster, "node3")
    return "node3", None


def run_cell(b: Bench, path: str, fault: str, timeout: float, replacement: str = "wait") -> dict[str, Any]:
    """One job on ``path`` meets ``fault`` at step 10; the cell's figures (:func:`rc.judge`).
    In-process with ``--replacement shrink``, the cell also waits (up to 90 s) for the
    replacement to grow the world back, and records when and the members' pause for it."""
    extra = ["--nodes", "2:3", "--max-restarts", "3"] + (
        ["--recovery", "inprocess", "--replacement", replacement] if path == "inprocess" else [])
    job_id, job, t_submit = b.submit(*extra)
    cell: dict[str, Any] = {"path": path, "fault": fault, "slurm_job_id": job_id, "job_dir": job.name}
    if path == "inprocess":
        cell["replacement"] = replacement
    try:
        t1 = wait(lambda: rc.progress(job).get("step", 0) >= 1, 240, "the first step")
        cell["cold_start_s"] = round(rc.progress(job).get("time", t1) - t_submit, 3)
        wait(lambda: rc.progress(job).get("step", 0) >= FAULT_AT_STEP
             and rc.progress(job).get("world_size") == 6, 180, f"step {FAULT_AT_STEP} on 3 nodes")
        before = {n: b.workers(n) for n in ("node1", "node2", "node3")}
        at = rc.progress(job)
        cell["load_1m_at_fault"] = load_1m()
        t = time.time()
        node, victim = inject(b, fault)
        cell.update(fault_node=node, fault_step=at["step"])
        survivors = {n: set(p) - {victim} for n, p in before.items() if victim is not None or n != node}
        w = rc.Watch(at["step"], t)
        end = t + timeout
        while time.time() < end and not w.done:
            w.poll(rc.progress(job), rc.events(job))
            if not w.done:
                time.sleep(0.05)
        now = {n: set(b.workers(n)) for n in survivors}
        cell["load_1m_at_resume"] = load_1m()
        cell.update(w.result(timeout))
        cell["pids_kept"] = all(survivors[n] <= now[n] for n in survivors)
        cell["survivors_restarted"] = sum(len(survivors[n] - now[n]) for n in survivors)
        if path == "inprocess" and replacement == "shrink" and victim is not None and w.done:
            cell.update(rc.regrow(job, t, lambda: wait(lambda: rc.grown(rc.events(job), t), 90,
                                                       "the replacement's grow")))
    except TimeoutError as e:   # the job never got to the fault: a broken cell, said as such
        cell.update(how="not_measured", reason=str(e))
    finally:
        try:
            b.cancel(job_id)
        finally:
            b.sc.restore(b.cluster)
    return cell


def signal_cases(b: Bench, res: dict[str, Any]) -> None:
    """A warning signal -> every rank exited with a committed checkpoint; then its requeue."""
    job_id, job, t0 = b.submit("--nodes", "2")
    try:
        wait(lambda: rc.progress(job).get("step", 0) >= 1, 240, "first step")
        res["cold_start_2nodes_s"] = round(rc.progress(job)["time"] - t0, 3)
        wait(lambda: rc.progress(job).get("step", 0) >= FAULT_AT_STEP, 120, f"step {FAULT_AT_STEP}")
        load = load_1m()
        t = time.time()
        subprocess.run(["scancel", "--signal=USR2", job_id], env=b.env, check=True)
        wait(lambda: bool(rc.outcomes(job)), 120, "the stop outcome")
        o = rc.outcomes(job)[-1]
        res["signal"] = {"signal_to_exit_s": round(o["time"] - t, 3), "steps_lost": o.get("lost_steps") or 0,
                         "load_1m_at_fault": load}
        t = o["time"]
        wait(lambda: rc.progress(job).get("allocation") == 1
             and rc.progress(job)["step"] > rc.progress(job)["start_step"], 180,
             "the requeued allocation's first step")
        res["requeue"] = {"requeue_to_resume_s": round(rc.progress(job)["time"] - t, 3), "steps_lost": 0,
                          "load_1m_at_resume": load_1m()}
    finally:
        b.cancel(job_id)


def succession_cases(b: Bench, res: dict[str, Any]) -> None:
    """The rendezvous host lost (issue 12): the survivors elect a new host, same allocation."""
    for fault, key in ((b.sc.crash, "rdzv_node_crash"), (b.sc.cut, "rdzv_node_cut")):
        job_id, job, _ = b.submit("--nodes", "2:3", "--max-restarts", "3")
        try:
            wait(lambda: rc.progress(job).get("step", 0) >= FAULT_AT_STEP
                 and rc.progress(job).get("world_size") == 6, 180, "step 10 on 3 nodes")
            before, t = rc.progress(job)["step"], time.time()
            fault(b.cluster, "node1")
            wait(lambda: rc.progress(job).get("world_size") == 4 and rc.progress(job)["time"] > t
                 and rc.progress(job)["step"] > rc.progress(job)["start_step"], 300, key)
            res[f"{key}_to_resume_s"] = rc.progress(job)["time"] - t
            res[f"{key}_steps_lost"] = before - rc.progress(job)["start_step"]
        finally:
            b.cancel(job_id)
            b.sc.restore(b.cluster)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--paths", nargs="+", choices=rc.PATHS, default=list(rc.PATHS))
    p.add_argument("--faults", nargs="+", choices=rc.FAULTS, default=list(rc.FAULTS))
    p.add_argument("--no-signal", action="store_true", help="skip the warning signal and requeue")
    p.add_argument("--replacement", choices=("wait", "shrink"), default="wait",
                   help="the in-process cells' --replacement (shrink: the survivors go on at world-1, the "
                        "replacement joins at a later step boundary)")
    p.add_argument("--global-batch", type=int, default=24,
                   help="the trainer's global batch: with --replacement shrink it must be divisible by "
                        "world x micro-batch at every world the job may shrink to (6, 5, 4: e.g. 60 with "
                        "--micro-batch 1), or the trainer refuses the shrunk world")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--passes", type=int, default=1,
                   help="measure the cells this many times in one hold of the cluster (each cell printed; "
                        "--json keeps the last pass's)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="a cell not back to training this long after its fault is recorded as a timeout")
    p.add_argument("--json", default="")
    p.add_argument("--merge", action="store_true",
                   help="keep the cells of the existing --json file that this run does not measure")
    p.add_argument("--only", choices=("cells", "succession"), default="cells")
    p.add_argument("--keep", default="", help="keep the job directories here (default: a temporary one)")
    args = p.parse_args()
    sc = _cluster()
    cluster = sc.Cluster(Path(os.environ.get("HPC_TEST_CLUSTER_DIR", "/run/hpc-test-cluster")), 3)
    with open(CLUSTER_LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"recovery bench: the test cluster is busy ({CLUSTER_LOCK}); waiting", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        t_up = time.time()
        (sc.restore if sc.is_healthy(cluster) else sc.up)(cluster)
        env = {**os.environ, "SLURM_CONF": str(cluster.state_dir / "etc" / "slurm.conf"), "WANDB_MODE": "offline"}
        run = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": _commit(),
               "cluster_ready_s": round(time.time() - t_up, 2), "load_1m_before": load_1m(),
               "machine": f"{os.cpu_count()} CPUs, shared"}
        res: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="hpc-recovery-") as tmp:
            root = Path(args.keep or tmp)
            root.mkdir(parents=True, exist_ok=True)
            b = Bench({**env, "HPC_HOME": str(root)}, root, sc, cluster, (args.global_batch, args.micro_batch))
            run["batch"] = {"global": args.global_batch, "micro": args.micro_batch}
            if args.only == "succession":
                succession_cases(b, res)
                print(json.dumps(res, indent=2))
                if args.json:
                    Path(args.json).write_text(json.dumps({"run": run, **res}, indent=2) + "\n")
                return
            if not args.no_signal:
                signal_cases(b, res)
            cells = []
            for n, path, fault in [(n, p, f) for n in range(args.passes) for p in args.paths for f in args.faults]:
                cell = run_cell(b, path, fault, args.timeout_s, args.replacement)
                cell.update(run=run["started"], **({"pass": n + 1} if args.passes > 1 else {}))
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    run["load_1m_after"] = load_1m()
    colds = [c["cold_start_s"] for c in cells if "cold_start_s" in c]
    if colds:
        run["cold_start_s_median"] = round(statistics.median(colds), 3)
    out = rc.merge(json.loads(Path(args.json).read_text()) if args.merge and Path(args.json).exists() else {},
                   run, res, cells)
    print(rc.table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return r.stdout.strip()


if __name__ == "__main__":
    main()
