"""The fault campaign: one seeded schedule of real faults, the same job, baseline vs hpc-elastic.

On the repo's 3-node Slurm test cluster (root; brought up if needed, held with the cluster lock
for the whole campaign), each contender trains the same model (the example GPT, tiny preset,
global batch 24, 1 process per node, ``--nodes 2:3``: all 3 nodes while they are healthy) for the
same steps, saving every ``--save-every`` steps, and meets the same faults at the same training
steps (:func:`campaign_metrics.schedule`, one per seed):

- ``preempt``: a real preemption: a higher-priority job (partition ``high``, ``--exclusive``) on
  the job's nodes; Slurm signals, requeues it, and gives the nodes back after 4 s;
- ``worker_kill``: SIGKILL of one worker process (not on the rendezvous host);
- ``node_crash``: every process of a node killed (not the rendezvous host); its slurmd is started
  again once Slurm has marked it down (a repaired node);
- ``link_cut``: a node's link taken down (its processes live on); healed once Slurm noticed;
- ``freeze``: SIGSTOP of one worker (nothing exits, nothing is closed);
- ``rdzv_loss``: the node hosting the rendezvous store crashes (repaired as a crash).

Contenders: ``baseline``, what users run today (``benchmarks/baseline/baseline.sbatch``:
``--requeue``, ``torchrun --nnodes 2:3 --max-restarts 3``, c10d, the script's own ``torch.save``
and resume); ``restart``, ``hpc submit`` with today's restart path; ``inprocess``, ``spare`` and
``inprocess_spare`` (both flags) when their flags exist in ``hpc submit --help`` (else recorded
as not landed); ``torchft``, torchft 0.2.0 where it is installed
(``benchmarks/torchft/torchft.sbatch``: a lighthouse on the first node, one replica group per
node healed live by its peers, ``--no-kill``, ``--requeue`` and its own ``torch.save``).

Per run: the goodput ledger (``hpc report``'s for ours; for the baseline the same ledger built
from its step records and Slurm's accounting, :func:`campaign_metrics.plain_events`), the
node-seconds each fault cost (allocated from the fault until the job was back at the step it
had reached), steps computed twice, whether it finished, whether its final weights equal an
uninterrupted run of the same script at the same world size (run locally first), and the
machine's load. Printed as ratios to the baseline with the spread over seeds.

    python benchmarks/campaign.py --seeds 1 2 3 --json benchmarks/campaign.json \\
        --md benchmarks/RESULTS-campaign.md --png-dir docs

One seed per invocation (``--keep`` the same folder: its uninterrupted references are made
once), then ``--merge seed1.json seed2.json ... --json campaign.json``.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import campaign_metrics as cm  # noqa: E402
from hpc.contract.slurm_parse import expand_hostlist  # noqa: E402
from runtime.liveness import proc  # noqa: E402

TRAIN = REPO / "examples" / "train_gpt.py"
PLAIN = REPO / "benchmarks" / "baseline" / "train_plain.py"
SBATCH = REPO / "benchmarks" / "baseline" / "baseline.sbatch"
TFT_TRAIN = REPO / "benchmarks" / "torchft" / "train_torchft.py"
TFT_SBATCH = REPO / "benchmarks" / "torchft" / "torchft.sbatch"
CLUSTER_LOCK = Path("/run/hpc-test-cluster.lock")
GLOBAL_BATCH, MICRO = 12, 2   # divides at world size 2 and 3


def load_cluster_module():
    """tests/cluster/slurm_cluster.py (a script, loaded by path)."""
    name = "hpc_test_slurm_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tests/cluster/slurm_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclass(frozen=True)
class Config:
    """What every contender runs: steps, save interval, step pace, faults."""

    steps: int = 240
    save_every: int = 20
    step_sleep: float = 0.2
    kinds: tuple[str, ...] = cm.KINDS
    min_gap: int = 30
    margin: int = 15
    timeout_s: float = 900.0
    pg_timeout_s: float = 120.0
    # Every worker of every contender and of the references: the thread count changes the
    # float sums (an uninterrupted baseline at 1 and 2 threads ends with other weights), and
    # torchrun sets 1 thread with several processes per node (the local references) but not
    # with one (the cluster's runs): unset, the comparison was not like-for-like.
    threads: int = 1
    # The baseline script fixes DDP's gradient-bucket layout before its first step (opt-in,
    # ``train_plain.py --fixed-buckets``): plain DDP re-lays its buckets out after the first
    # step of every process, so a resumed run at 3+ ranks rounds its first step's sums
    # otherwise than the uninterrupted run. Off: the script as users write it.
    baseline_fixed_buckets: bool = False


# --------------------------------------------------------------------------- contenders


class Contender:
    """One way of running the job. Subclasses say how to submit, read progress and results."""

    name = ""
    resubmits = False   # whether a job that ended unfinished is submitted again (as a person would)

    def submit(self, env: dict[str, str], job: Path, cfg: Config) -> str:
        raise NotImplementedError

    def progress(self, job: Path) -> tuple[int, int, float, Any] | None:
        """(step, world size, time of the record, worker group), or None before the first step."""
        raise NotImplementedError

    def is_worker(self, cmd: list[bytes]) -> bool:
        raise NotImplementedError

    def rdzv_host(self, job: Path, nodes: list[str]) -> str:
        return nodes[0]

    def result(self, job: Path) -> dict | None:
        try:
            return json.loads((job / "result.json").read_text())
        except (OSError, ValueError):
            return None

    def ledger(self, job: Path, job_ids: list[str]):
        """The goodput ledger of the run (``job_ids``: every Slurm job it took, in order)."""
        raise NotImplementedError

    def recoveries(self, job: Path) -> list[tuple[float, int]]:
        """(time, step gone on from) of each in-process recovery (none but ours in-process)."""
        from hpc.contract.events import read_events
        try:
            return [(float(e["t"]), int(e["step"])) for e in read_events(job) if e["ev"] == "inproc_recovery"]
        except (OSError, ValueError, KeyError):
            return []

    def reference(self, world: int, cfg: Config, out: Path) -> str:
        """The weights digest of an uninterrupted local run at ``world`` processes."""
        raise NotImplementedError

    def numerics(self) -> str:
        """Contenders with the same value compute the same uninterrupted weights (they share one
        reference): the script, and for ours the recovery mode."""
        return type(self).__name__


class Baseline(Contender):
    """sbatch --requeue + torchrun --nnodes 2:3 --max-restarts 3 + the script's torch.save.

    A job of this script that ends unfinished (a real preemption with a grace time ends it:
    torchrun exits on the SIGTERM, the batch script with it, before Slurm would requeue it) is
    submitted again at once, as its user would (at no cost in reaction time); it resumes from
    its last save. The run records each resubmission: it did not finish unattended.
    """

    name = "baseline"
    resubmits = True

    def submit(self, env, job, cfg):
        job.mkdir(parents=True, exist_ok=True)
        args = " ".join(self.args(cfg) + ["--step-sleep", str(cfg.step_sleep),
                                          "--pg-timeout-s", str(cfg.pg_timeout_s)])
        benv = {**env, "PLAIN_PYTHON": sys.executable, "PLAIN_TRAIN": str(PLAIN), "PLAIN_OUT": str(job),
                "PLAIN_NNODES": "2:3", "PLAIN_NPROC": "1", "PLAIN_ARGS": args,
                "OMP_NUM_THREADS": str(cfg.threads)}
        r = subprocess.run(["sbatch", "--parsable", "-N", "2-3", "-p", "debug", "-o",
                            str(job / "slurm-%j.out"), str(SBATCH)], env=benv, capture_output=True,
                           text=True, check=True)
        job_id = r.stdout.strip().split(";")[0]
        (job / "slurm_job_id").write_text(job_id + "\n")
        return job_id

    @staticmethod
    def args(cfg: Config) -> list[str]:
        """train_plain.py's arguments, the same for the runs and the reference."""
        return ["--steps", str(cfg.steps), "--save-every", str(cfg.save_every), "--global-batch",
                str(GLOBAL_BATCH), "--micro-batch", str(MICRO),
                *(["--fixed-buckets"] if cfg.baseline_fixed_buckets else [])]

    def records(self, job: Path) -> list[dict]:
        try:
            lines = (job / "steps.jsonl").read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass   # a line being written
        return out

    def progress(self, job):
        records = self.records(job)
        for i in range(len(records) - 1, -1, -1):
            r = records[i]
            if r.get("ev") == "step":
                group = sum(1 for x in records[:i] if x.get("ev") == "start")
                return int(r["step"]), int(r["world"]), float(r["t"]), group
        return None

    def is_worker(self, cmd):
        return any(c.endswith(b"train_plain.py") for c in cmd) and b"torch.distributed.run" not in cmd

    def ledger(self, job, job_ids):
        from hpc.report.ledger import build
        runs: dict[int, dict[str, Any]] = {}
        for job_id in job_ids:
            for k, run in sorted(accounting_runs(job_id).items()):
                runs[len(runs)] = {**run, "job_id": job_id, "restart": k,
                                   "nodes": sorted(run.get("node_ends") or {})}
        return build(cm.plain_events(self.records(job), runs), slurm_runs=runs)

    def reference(self, world, cfg, out):
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(world), str(PLAIN), "--out", str(out), *self.args(cfg)],
                       check=True, capture_output=True, cwd=REPO, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": str(cfg.threads)})
        return json.loads((out / "result.json").read_text())["weights_sha256"]


class TorchFT(Baseline):
    """torchft 0.2.0 (``benchmarks/torchft/torchft.sbatch`` + ``train_torchft.py``): a lighthouse
    on the first node, one replica group per node healed live by its peers, ``--no-kill``,
    ``--requeue`` and the script's own ``torch.save`` for whole-job restarts.

    Needs torchft in this interpreter (``benchmarks/torchft/install.sh``: the wheel without its
    dependencies, so that the pinned CPU torch stays). A job that ends unfinished is submitted
    again, as for the baseline. The lighthouse's node is the allocation's first (the
    ``rdzv_loss`` fault's target, as the baseline's c10d host).
    """

    name = "torchft"
    resubmits = True

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("torchft") is not None

    def submit(self, env, job, cfg):
        job.mkdir(parents=True, exist_ok=True)
        args = " ".join(self.args(cfg) + ["--step-sleep", str(cfg.step_sleep)])
        tenv = {**env, "TFT_PYTHON": sys.executable, "TFT_TRAIN": str(TFT_TRAIN), "TFT_OUT": str(job),
                "TFT_ARGS": args, "OMP_NUM_THREADS": str(cfg.threads)}
        r = subprocess.run(["sbatch", "--parsable", "-N", "2-3", "-p", "debug", "-o",
                            str(job / "slurm-%j.out"), str(TFT_SBATCH)], env=tenv, capture_output=True,
                           text=True, check=True)
        job_id = r.stdout.strip().split(";")[0]
        (job / "slurm_job_id").write_text(job_id + "\n")
        return job_id

    @staticmethod
    def args(cfg: Config) -> list[str]:
        """train_torchft.py's arguments, the same for the runs and the reference."""
        return ["--steps", str(cfg.steps), "--save-every", str(cfg.save_every), "--global-batch",
                str(GLOBAL_BATCH), "--micro-batch", str(MICRO)]

    def progress(self, job):
        records = self.records(job)
        for r in reversed(records):
            if r.get("ev") == "step":
                # One worker group per allocation: torchft heals a replica group live.
                return int(r["step"]), int(r["world"]), float(r["t"]), (str(r.get("job", "")),
                                                                        int(r.get("alloc", 0)))
        return None

    def is_worker(self, cmd):
        return any(c.endswith(b"train_torchft.py") for c in cmd) and b"torch.distributed.run" not in cmd

    def recoveries(self, job):
        """torchft's recoveries in place: each change of the step's participants."""
        return cm.torchft_recoveries(self.records(job))

    def ledger(self, job, job_ids):
        from hpc.report.ledger import build
        runs: dict[int, dict[str, Any]] = {}
        for job_id in job_ids:
            for k, run in sorted(accounting_runs(job_id).items()):
                runs[len(runs)] = {**run, "job_id": job_id, "restart": k,
                                   "nodes": sorted(run.get("node_ends") or {})}
        return build(cm.plain_events(cm.torchft_records(self.records(job)), runs), slurm_runs=runs)

    def reference(self, world, cfg, out):
        """``world`` replica groups on this machine, a lighthouse that waits for all of them
        (``--min_replicas world``: every step at ``world`` participants, as uninterrupted)."""
        import shutil
        import socket
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        lighthouse = Path(sys.executable).parent / "torchft_lighthouse"
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
        with open(out / "lighthouse.log", "w") as log:
            lh = subprocess.Popen([str(lighthouse), "--min_replicas", str(world), "--join_timeout_ms", "60000",
                                   "--bind", f"[::]:{port}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc-per-node", "1", str(TFT_TRAIN), "--out", str(out),
                                       *self.args(cfg)], cwd=REPO, env={**env, "REPLICA_GROUP_ID": str(r)},
                                      stdout=subprocess.DEVNULL, stderr=open(out / f"r{r}.log", "w"))
                     for r in range(world)]
            for p in procs:
                if p.wait(timeout=600):
                    raise RuntimeError(f"torchft reference at {world} replica groups failed: see {out}")
        finally:
            lh.kill()
            lh.wait()
        return json.loads((out / "result.json").read_text())["weights_sha256"]


class Ours(Contender):
    """``hpc submit`` of the example trainer; ``extra`` selects the recovery path."""

    def __init__(self, name: str, extra: tuple[str, ...] = (), flag: str = "", nodes: str = "2:3") -> None:
        self.name, self.extra, self.flag, self.nodes = name, extra, flag, nodes

    def landed(self) -> bool:
        """Whether ``hpc submit`` knows this contender's flag (inprocess, spare: as they land)."""
        if not self.flag:
            return True
        out = subprocess.run([sys.executable, "-m", "hpc", "submit", "--help"], capture_output=True,
                             text=True, cwd=REPO).stdout
        return self.flag in out

    def submit(self, env, job, cfg):
        r = subprocess.run([sys.executable, "-m", "hpc", "submit", str(TRAIN), "--nodes", self.nodes,
                            "--nproc-per-node", "1", "--job-dir", str(job), "--partition", "debug",
                            "--checkpoint-every-steps", str(cfg.save_every), "--max-restarts", "3",
                            "--env", "HPC_PROGRESS_EVERY_S=0", "--env", f"OMP_NUM_THREADS={cfg.threads}",
                            *self.extra, "--", "--preset", "tiny",
                            "--max-steps", str(cfg.steps), "--step-sleep", str(cfg.step_sleep),
                            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO)],
                           env=env, capture_output=True, text=True, cwd=REPO)
        if r.returncode:
            raise RuntimeError(f"hpc submit failed: {r.stdout}{r.stderr}")
        return (job / "slurm_job_id").read_text().strip()

    def progress(self, job):
        try:
            p = json.loads((job / "progress.json").read_text())
        except (OSError, ValueError):
            return None
        group = (p.get("allocation"), p.get("restart"), p.get("start_step"))
        return int(p["step"]), int(p["world_size"]), float(p["time"]), group

    def is_worker(self, cmd):
        return len(cmd) > 2 and cmd[1] == b"-m" and cmd[2] == b"runtime.worker"

    def rdzv_host(self, job, nodes):
        try:
            p = json.loads((job / "progress.json").read_text())
            cur = job / ".rdzv" / f"alloc-{p['allocation']}" / "current.json"
            host = json.loads(cur.read_text())["host"]
            if host in nodes:
                return host
        except (OSError, ValueError, KeyError):
            pass
        return nodes[0]

    def ledger(self, job, job_ids):
        from hpc.report.load import load
        return load(job, job_ids[0])

    @property
    def recovery(self) -> str:
        return self.extra[self.extra.index("--recovery") + 1] if "--recovery" in self.extra else "restart"

    def numerics(self) -> str:
        # In-process recovery's DDP reduces through its own comm hook: its uninterrupted weights
        # are not the restart path's (ca744931 vs d1485282 at world 3, train_gpt tiny, 40 steps).
        return f"Ours-{self.recovery}"

    def reference(self, world, cfg, out):
        subprocess.run([sys.executable, "-m", "hpc", "run", str(TRAIN), "--nodes", str(world),
                        "--nproc-per-node", "1", "--job-dir", str(out), "--env",
                        f"OMP_NUM_THREADS={cfg.threads}", "--recovery", self.recovery, "--", "--preset", "tiny",
                        "--max-steps", str(cfg.steps), "--global-batch", str(GLOBAL_BATCH),
                        "--micro-batch", str(MICRO)], check=True, capture_output=True, cwd=REPO,
                       timeout=600)
        return json.loads((out / "result.json").read_text())["weights_sha256"]


CONTENDERS: dict[str, Contender] = {
    "baseline": Baseline(),
    "restart": Ours("restart"),
    "inprocess": Ours("inprocess", ("--recovery", "inprocess"), flag="--recovery"),
    # 2 ranked nodes + 1 hot spare: the same 3 nodes, a world size that stays 2.
    "spare": Ours("spare", ("--spare-nodes", "1"), flag="--spare-nodes", nodes="2"),
    # The same with in-process recovery: the spare's workers wait as joiners and take a lost
    # node's place with the state from a peer (runtime/launch/inprocess_spare.py).
    "inprocess_spare": Ours("inprocess_spare", ("--recovery", "inprocess", "--spare-nodes", "1"),
                            flag="--spare-nodes", nodes="2"),
    # torchft 0.2.0 (issue 27's contender (e)), where it is installed.
    "torchft": TorchFT(),
}


def accounting_runs(job_id: str) -> dict[int, dict[str, Any]]:
    """Slurm's allocations of the job (sacct), waiting briefly for the last one to be recorded."""
    from hpc.contract.slurm import SlurmClient
    from hpc.report.load import runs_from_accounting
    runs: dict[int, dict[str, Any]] = {}
    for _ in range(20):
        runs = runs_from_accounting(SlurmClient(retry_total_s=10).accounting([job_id]), job_id)
        if runs and all(r.get("end") is not None for r in runs.values()):
            break
        time.sleep(1)
    return runs


# --------------------------------------------------------------------------- faults


@dataclass
class Injector:
    """Injects the faults on the cluster and repairs nodes in the background."""

    sc: Any
    cluster: Any
    env: dict[str, str]
    rng: random.Random
    repairs: list[threading.Thread] = field(default_factory=list)
    repairing: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)

    def job_nodes(self, job_id: str) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], env=self.env,
                             capture_output=True, text=True).stdout.strip()
        return expand_hostlist(out) if out and out != "(null)" else []

    def inject(self, kind: str, contender: Contender, job: Path, job_id: str) -> str:
        """Injects ``kind``; returns what was hit (for the record)."""
        nodes = self.job_nodes(job_id)
        host = contender.rdzv_host(job, nodes) if nodes else ""
        up = cm.nodes_up(nodes, self.sc.node_states(self.cluster), self.repairing)
        if kind == "preempt":
            r = subprocess.run(["sbatch", "--parsable", "-p", "high", "--exclusive", "-N", str(len(up)),
                                "-w", ",".join(up), "-t", "2", "-o", str(job / "high-%j.out"),
                                "--wrap", "sleep 4"], env=self.env, capture_output=True, text=True)
            return f"high-priority job {r.stdout.strip()} on {','.join(up)} {r.stderr.strip()}"
        targets = cm.fault_targets(kind, nodes, host, up)
        if kind in ("worker_kill", "freeze"):
            for node in targets:
                # A warm standby that became a joiner is a worker (its order's command line),
                # an idle one is not (ours: runtime.launch.standby).
                pids = [p for p in self.sc.node_processes(node, lambda argv: True)
                        if contender.is_worker([a.encode() for a in proc.cmdline(p)])]
                if pids:
                    pid = self.rng.choice(pids)
                    os.kill(pid, signal.SIGKILL if kind == "worker_kill" else signal.SIGSTOP)
                    return f"worker pid {pid} on {node}"
            return "no worker found"
        node = host if kind == "rdzv_loss" else self.rng.choice(targets)
        if kind in ("node_crash", "rdzv_loss"):
            self.sc.crash(self.cluster, node)
            self._repair(node, job_id, lambda: self.sc.restart_slurmd(self.cluster, node))
        elif kind == "link_cut":
            self.sc.cut(self.cluster, node)
            self._repair(node, job_id, lambda: self.sc.heal(self.cluster, node))
        return node

    def _repair(self, node: str, job_id: str, fix) -> None:
        """Once Slurm noticed (node down, or dropped from the job), or after 120 s: repair."""
        self.repairing.add(node)

        def run() -> None:
            end = time.time() + 120
            while time.time() < end:
                state = self.sc.node_states(self.cluster).get(node, "")
                if "down" in state or "fail" in state or node not in self.job_nodes(job_id):
                    break
                time.sleep(1)
            fix()
            self.repairing.discard(node)
            self.log.append(f"{time.time():.1f} repaired {node}")
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.repairs.append(t)


# --------------------------------------------------------------------------- one run


ENDED = ("GONE", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def squeue_state(env: dict[str, str], job_id: str) -> str:
    r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True)
    if r.returncode and "Invalid job id" not in r.stderr:
        return "UNKNOWN"
    return r.stdout.strip() or "GONE"


def run_one(contender: Contender, seed: int, cfg: Config, env: dict[str, str], sc, cluster,
            root: Path) -> tuple[dict[str, Any], Any]:
    """One contender through one seed's schedule; returns the run's record."""
    plan = cm.schedule(seed, cfg.steps, cfg.kinds, min_gap=cfg.min_gap, margin=cfg.margin)
    job = root / f"{contender.name}-seed{seed}"
    inj = Injector(sc, cluster, env, random.Random(seed))
    t_submit = time.time()
    job_id = contender.submit(env, job, cfg)
    job_ids, resubmitted = [job_id], []
    trace: list[tuple[float, int, int, Any]] = []
    faults: list[dict[str, Any]] = []
    loads: list[float] = []
    pending = list(plan)
    state, last_load = "", 0.0
    while time.time() < t_submit + cfg.timeout_s:
        p = contender.progress(job)
        if p and (not trace or (p[0], p[3]) != (trace[-1][1], trace[-1][3])):
            trace.append((p[2], p[0], p[1], p[3]))
        state = squeue_state(env, job_id)
        if pending and p and p[0] >= pending[0][0] and state == "RUNNING":
            step, kind = pending.pop(0)
            t = time.time()
            what = inj.inject(kind, contender, job, job_id)
            faults.append({"kind": kind, "t": t, "step": p[0], "scheduled_step": step, "target": what})
            print(f"  [{contender.name} seed {seed}] {t - t_submit:6.1f} s step {p[0]}: {kind} ({what})",
                  flush=True)
        if state in ENDED:
            if contender.resubmits and contender.result(job) is None and len(resubmitted) < 3:
                resubmitted.append({"t": time.time(), "state": state, "step": p[0] if p else 0})
                job_id = contender.submit(env, job, cfg)
                job_ids.append(job_id)
                print(f"  [{contender.name} seed {seed}] {time.time() - t_submit:6.1f} s: ended {state} "
                      f"unfinished; submitted again as job {job_id}", flush=True)
                continue
            break
        if time.time() - last_load > 5:
            loads.append(os.getloadavg()[0])
            last_load = time.time()
        time.sleep(0.2)
    timed_out = state not in ENDED
    t_end = time.time()
    if timed_out:
        subprocess.run(["scancel", job_id], env=env)
    for t in inj.repairs:
        t.join(timeout=150)
    time.sleep(2)
    result = contender.result(job)
    ledger = contender.ledger(job, job_ids)
    end_alloc = max((a.end for a in ledger.allocations), default=t_end)
    recoveries = contender.recoveries(job)
    costs = cm.fault_costs(faults, [(t, s, g) for t, s, _, g in trace], ledger.allocations, end_alloc,
                           recoveries)
    worlds = sorted({w for _, _, w, _ in trace})
    finished = bool(result) and int(result.get("final_step", -1)) == cfg.steps and not timed_out
    world = int(result["world_size"]) if result else 0
    record = {
        "contender": contender.name, "seed": seed, "job_ids": job_ids, "job_dir": str(job),
        "resubmitted": resubmitted, "finished_unattended": finished and not resubmitted,
        "schedule": plan, "faults": costs, "faults_not_reached": pending, "finished": finished,
        "timed_out": timed_out, "final_state": state, "wall_s": t_end - t_submit,
        "goodput": ledger.goodput, "allocated_node_s": ledger.allocated_node_s,
        "categories": ledger.categories, "lost_steps": ledger.lost_steps,
        "allocations": len(ledger.allocations), "worlds_seen": worlds, "final_world": world,
        "weights_sha256": (result or {}).get("weights_sha256"), "load_1m": cm.spread(loads),
        "threads": (result or {}).get("threads"),
        "repairs": inj.log, "trace": trace, "inproc_recoveries": recoveries,
    }
    record = cm.with_trace_steps_twice(record)   # a crashed host's last events are lost
    print(f"  [{contender.name} seed {seed}] done in {record['wall_s']:.0f} s: finished {finished}, "
          f"goodput {ledger.goodput * 100:.1f}%, allocated {ledger.allocated_node_s:.0f} node-s, "
          f"lost per fault {[round(f['lost_node_s']) for f in costs]}, steps twice {record['lost_steps']}, "
          f"worlds {worlds}", flush=True)
    return record, ledger


def run_campaign(contenders: list[Contender], seeds: list[int], cfg: Config, env: dict[str, str],
                 sc, cluster, root: Path, png_dir: Path | None = None,
                 worlds: tuple[int, ...] = (2, 3), background_references: bool = False,
                 partial: Path | None = None) -> dict[str, Any]:
    """References first (local, uninterrupted, at each world size in ``worlds``; or beside the
    runs, ``background_references``: quicker, but they load the machine the runs measure), then
    seed by seed every contender in turn."""
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]   # sacct, for the ledgers (SlurmClient reads os.environ)
    references: dict[tuple[str, int], str] = {}
    t0 = time.time()

    def make_references() -> None:
        done: dict[tuple[str, int], str] = {}   # one per script and world size
        for c in contenders:
            for world in worlds:
                script = c.numerics()
                out = root / f"ref-{c.name}-w{world}"
                if (script, world) not in done and (out / "result.json").exists():
                    # Made by an earlier invocation with the same --keep (one seed per
                    # invocation): the same script, steps and threads give the same digest.
                    done[(script, world)] = json.loads((out / "result.json").read_text())["weights_sha256"]
                if (script, world) not in done:
                    done[(script, world)] = c.reference(world, cfg, out)
                references[(c.name, world)] = done[(script, world)]
        print(f"references (local, uninterrupted): {time.time() - t0:.0f} s", flush=True)
    maker = threading.Thread(target=make_references, daemon=True)
    maker.start()
    if not background_references:
        maker.join()
    runs, pictures, failed = [], {}, []
    load_before = os.getloadavg()
    for seed in seeds:
        for c in contenders:
            sc.restore(cluster)
            try:
                record, ledger = run_one(c, seed, cfg, env, sc, cluster, root)
            except Exception as e:   # one broken run must not lose the others (recorded)
                print(f"  [{c.name} seed {seed}] run failed: {e!r}", flush=True)
                failed.append({"contender": c.name, "seed": seed, "error": repr(e)})
                continue
            runs.append(record)
            if partial is not None:
                partial.write_text(json.dumps({"runs": runs, "failed": failed}, default=str) + "\n")
            if png_dir is not None and seed == seeds[0]:
                from hpc.report import plot
                pictures[c.name] = str(plot.render_png(
                    ledger, png_dir / f"campaign-{c.name}.png",
                    title=f"{c.name}, seed {seed}, {len(record['faults'])} faults"))
    sc.restore(cluster)
    maker.join()
    for r in runs:
        try:
            slurm_frame(r)   # a hung tail is in Slurm's frame only
        except Exception as e:   # noqa: BLE001 - the ledger's frame stays; said in the record
            r["slurm_frame_error"] = repr(e)
        ref = references.get((r["contender"], r["final_world"]))
        r["weights_equal"] = bool(ref and r.pop("weights_sha256", None) == ref)
        r["reference_world_available"] = ref is not None
    summary = cm.summarize(runs)
    return {"config": asdict(cfg), "seeds": seeds, "contenders": summary, "runs": runs, "failed": failed,
            "pictures": pictures, "references": {f"{k[0]}-w{k[1]}": v for k, v in references.items()},
            "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
                        "campaign_s": time.time() - t0}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--contenders", nargs="+", default=["baseline", "restart", "inprocess", "spare"],
                   help=f"of {', '.join(CONTENDERS)}; ones whose flag has not landed are skipped")
    p.add_argument("--faults", default=",".join(cm.KINDS), help="comma-separated kinds")
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--save-every", type=int, default=Config.save_every)
    p.add_argument("--step-sleep", type=float, default=Config.step_sleep)
    p.add_argument("--min-gap", type=int, default=Config.min_gap)
    p.add_argument("--margin", type=int, default=Config.margin)
    p.add_argument("--timeout-s", type=float, default=Config.timeout_s, help="per run")
    p.add_argument("--threads", type=int, default=Config.threads,
                   help="OMP_NUM_THREADS of every worker, runs and references alike")
    p.add_argument("--baseline-fixed-buckets", action="store_true",
                   help="the baseline fixes DDP's bucket layout (train_plain.py --fixed-buckets)")
    p.add_argument("--background-references", action="store_true",
                   help="make the uninterrupted references beside the runs (quicker; they load the "
                        "machine the runs measure)")
    p.add_argument("--json", default="")
    p.add_argument("--md", default="", help="write the results table here")
    p.add_argument("--png-dir", default="", help="draw the first seed's ledger of each contender here")
    p.add_argument("--keep", default="", help="keep job directories here (default: a temporary one)")
    p.add_argument("--from-partial", default="", metavar="PATH",
                   help="summarize a campaign cut short from its JSON.partial record (--keep: its "
                        "job directories, where the uninterrupted references are)")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="join records of earlier invocations (e.g. one seed each, the cluster "
                        "free between them) into one (--json, --md); runs nothing")
    args = p.parse_args()
    if args.merge:
        write(cm.merge([json.loads(Path(m).read_text()) for m in args.merge]), args.json, args.md)
        return
    if args.from_partial:
        out = from_partial(Path(args.from_partial), Path(args.keep))
        write(out, args.json, args.md)
        return
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; valid: {', '.join(CONTENDERS)}")
    contenders, skipped = [], {}
    for name in args.contenders:
        c = CONTENDERS[name]
        if isinstance(c, TorchFT) and not c.installed():
            skipped[name] = "torchft is not installed in this interpreter (benchmarks/torchft/install.sh)"
            print(f"skipping {name}: {skipped[name]}")
            continue
        if isinstance(c, Ours) and not c.landed():
            skipped[name] = f"`hpc submit` has no {c.flag} yet (not landed)"
            print(f"skipping {name}: {skipped[name]}")
            continue
        contenders.append(c)
    cfg = Config(steps=args.steps, save_every=args.save_every, step_sleep=args.step_sleep,
                 kinds=tuple(args.faults.split(",")), min_gap=args.min_gap, margin=args.margin,
                 timeout_s=args.timeout_s, threads=args.threads,
                 baseline_fixed_buckets=args.baseline_fixed_buckets)
    sc = load_cluster_module()
    cluster = sc.Cluster(Path(os.environ.get("HPC_TEST_CLUSTER_DIR", str(sc.DEFAULT_STATE_DIR))), 3)
    with open(CLUSTER_LOCK, "a") as lock:
        print("waiting for the cluster lock ...", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
        sc.up(cluster)
        with tempfile.TemporaryDirectory(prefix="hpc-campaign-") as tmp:
            root = Path(args.keep or tmp)
            env = {**cluster.env, "HPC_HOME": str(root / "hpc-home"), "WANDB_MODE": "offline"}
            out = run_campaign(contenders, args.seeds, cfg, env, sc, cluster, root,
                               Path(args.png_dir) if args.png_dir else None,
                               background_references=args.background_references,
                               partial=Path(args.json + ".partial") if args.json else None)
    out["skipped"] = skipped
    write(out, args.json, args.md)


def write(out: dict[str, Any], json_path: str, md_path: str) -> None:
    """Prints the tables; writes the JSON record and the markdown tables where asked."""
    table = cm.markdown(out["contenders"]) + "\nEvery run:\n\n" + cm.runs_markdown(out["runs"])
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if md_path:
        Path(md_path).write_text(table)


def slurm_frame(record: dict[str, Any]) -> None:
    """Each fault's cost on Slurm's frame of the run too (sacct: every allocation's start and each
    node's end): the ledger ends an allocation whose launchers wrote no end (a job cancelled while
    hung) at its last event, so it leaves out a hang's node-time; Slurm does not."""
    from types import SimpleNamespace
    allocs, ends = [], []
    for job_id in record.get("job_ids") or [record.get("job_id")]:
        for run in accounting_runs(str(job_id)).values():
            if run.get("start") is None or run.get("end") is None:
                continue
            ends.append(run["end"])
            allocs.append(SimpleNamespace(start=run["start"], node_ends={
                n: (t if t is not None else run["end"]) for n, t in (run.get("node_ends") or {}).items()}))
    if not allocs:
        return
    trace = [(t, s, tuple(g) if isinstance(g, list) else g) for t, s, _, g in record["trace"]]
    faults = [{k: f[k] for k in ("kind", "t", "step", "scheduled_step", "target")} for f in record["faults"]]
    record["faults_ledger_frame"] = record["faults"]
    slurm = cm.fault_costs(faults, trace, allocs, max(ends),
                           [tuple(r) for r in record.get("inproc_recoveries") or ()])
    # Each frame can only miss node-time (the ledger a hang's tail, sacct an allocation of a
    # requeued job it did not list: seen): a fault costs the larger of the two.
    for f, led in zip(slurm, record["faults_ledger_frame"]):
        f["lost_node_s_slurm"], f["lost_node_s_ledger"] = f["lost_node_s"], led["lost_node_s"]
        f["lost_node_s"] = max(f["lost_node_s"], led["lost_node_s"])
        f["recovered"] = led["recovered"] and f["recovered"]
    record["faults"] = slurm
    record["allocated_node_s_slurm"] = cm.node_seconds(allocs, min(a.start for a in allocs), max(ends))
    # The goodput on the larger frame too: a hung tail is allocated time the ledger never saw.
    if record["allocated_node_s_slurm"] > record.get("allocated_node_s", 0) > 0:
        record["goodput_ledger"] = record["goodput"]
        record["goodput"] = record["goodput"] * record["allocated_node_s"] / record["allocated_node_s_slurm"]


def from_partial(path: Path, root: Path) -> dict[str, Any]:
    """The record of a campaign cut short: its finished runs, the weights compared with the
    references it had made (``root/ref-NAME-wW/result.json``)."""
    data = json.loads(path.read_text())
    refs: dict[tuple[str, int], str] = {}
    for res in root.glob("ref-*-w*/result.json"):
        name, world = res.parent.name[len("ref-"):].rsplit("-w", 1)
        refs[(name, int(world))] = json.loads(res.read_text())["weights_sha256"]
    for (name, world), digest in list(refs.items()):   # shared by contenders of the same numerics
        if name in CONTENDERS:
            for other, c in CONTENDERS.items():
                if c.numerics() == CONTENDERS[name].numerics():
                    refs.setdefault((other, world), digest)
    runs = data["runs"]
    for r in runs:
        slurm_frame(r)
        ref = refs.get((r["contender"], r["final_world"]))
        r["weights_equal"] = bool(ref and r.pop("weights_sha256", None) == ref)
        r["reference_world_available"] = ref is not None
    seeds = sorted({int(r["seed"]) for r in runs})
    return {"seeds": seeds, "contenders": cm.summarize(runs), "runs": runs,
            "failed": data.get("failed", []), "cut_short": True,
            "references": {f"{k[0]}-w{k[1]}": v for k, v in refs.items()}}


if __name__ == "__main__":
    main()
