"""The campaign's contenders: how each way of running the job is submitted, and how its progress,
result, goodput ledger and uninterrupted reference are read (``benchmarks/campaign.py`` runs them).

``Config`` is what every contender runs; ``CONTENDERS`` names them for the command line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import campaign_metrics as cm  # noqa: E402

TRAIN = REPO / "examples" / "train_gpt.py"
PLAIN = REPO / "benchmarks" / "baseline" / "train_plain.py"
SBATCH = REPO / "benchmarks" / "baseline" / "baseline.sbatch"
TFT_TRAIN = REPO / "benchmarks" / "torchft" / "train_torchft.py"
TFT_SBATCH = REPO / "benchmarks" / "torchft" / "torchft.sbatch"
GLOBAL_BATCH, MICRO = 12, 2   # divides at world size 2 and 3


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
        return self.sbatch(SBATCH, benv, job)

    @staticmethod
    def sbatch(script: Path, env: dict[str, str], job: Path) -> str:
        """Submits ``script`` on 2-3 nodes with its output in ``job``; records and returns the id."""
        r = subprocess.run(["sbatch", "--parsable", "-N", "2-3", "-p", "debug", "-o",
                            str(job / "slurm-%j.out"), str(script)], env=env, capture_output=True,
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
        from hpc.contract.ledger import build
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
        return self.sbatch(TFT_SBATCH, tenv, job)

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
        from hpc.contract.ledger import build
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
    # node's place with the state from a peer (runtime/inprocess/launcher/spare.py).
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
