"""Every name in a job directory, declared once, and :class:`JobPaths`, the one object for its paths.

A job directory is shared by processes that never import each other (``hpc`` on the login
node, the per-node launchers, the workers, the batch shell), so a file name is a contract:
spelled twice, it can drift apart. Every file and folder name of a job directory is declared
here and nowhere else (``tests/unit/test_records.py`` fails when a name's literal appears in
a second module); code asks :class:`JobPaths` for a path (submitit's ``JobPaths`` is the model).
What each file holds, and who writes and reads it, is in :mod:`hpc.contract.records`.

Names with a ``{field}`` are patterns, filled by the :class:`JobPaths` method of that file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# --- the job's own files (top level) -------------------------------------------------------
JOBSPEC = "jobspec.json"               # what was asked (login node, once)
SBATCH = "job.sbatch"                  # the rendered batch script (Slurm backends)
SLURM_JOB_ID = "slurm_job_id"          # the Slurm job id (Slurm backends)
LOCK = ".hpc-lock.json"                # who runs the job now (hpc.contract.joblock)
RESERVE = ".hpc-reserve"               # space given back on a full disk (hpc.contract.diskspace)
SECRET = ".hpc-secret"                 # the key that signs the job's messages (hpc.contract.jobsecret)
SWEEP = "sweep.json"                   # a sweep's tasks and their arguments (hpc.sweeps)
SWEEP_TASK = "task-{index}"            # a sweep task's own job directory
RESULT = "result.json"                 # written by the example trainer
# --- records (hpc.contract.records) --------------------------------------------------------
OUTCOMES = "outcomes.jsonl"
EVENTS = "events.jsonl"
HANGS = "hangs.jsonl"
EXCLUSIONS = "exclusions.jsonl"
STRAGGLERS = "stragglers.jsonl"
RESUBMISSIONS = "resubmissions.jsonl"
JOBS = "jobs.jsonl"                    # the user's job index, in $HPC_HOME (not a job directory)
# --- rank 0's bookkeeping ------------------------------------------------------------------
EXIT_INTENT = "exit-intent.json"       # rank 0's reason for a clean exit
PROGRESS = "progress.json"             # rank 0's latest step
CHECKPOINTS = "checkpoints"            # the default checkpoint directory
CHECKPOINT_LATEST = "latest"           # in a checkpoint directory: the newest committed step
WANDB_RUN_ID = "wandb_run_id"          # one W&B run for the job's whole life
WANDB_STATE = "wandb_state.json"       # the last step logged to W&B (exactly-once history)
WANDB_DIR = "wandb"                    # W&B's own files (offline runs)
WANDB_SYNCED = "wandb_synced.json"     # what hpc sync uploaded already
WANDB_STORY = "wandb_story.json"       # the story hpc sync last wrote into the run (and its folders)
WANDB_STORY_DIR = "wandb_story"        # its timeline picture and the payload its writer read
METRICS_JSONL = "metrics.jsonl"        # rank 0's metrics when W&B is disabled or failing
# --- claims and requests between launchers and the batch shell -----------------------------
CLAIM = "{duty}-claim-alloc-{allocation}"          # who did a duty (requeue, record) once
REQUEUE_REQUEST_PREFIX = "requeue-request-alloc-"  # + allocation: node 0 asks the batch shell
# --- logs ----------------------------------------------------------------------------------
LOGS = "logs"
BATCH_LOG = "slurm-{job_id}.out"       # the batch script's output (Slurm's %j)
ALLOC = "alloc-{allocation}"           # one folder per allocation (logs, liveness, health, board)
NODE_LOG = "node-{host}.log"           # a node's launcher log
RESTART = "restart-{restart}"          # a worker group's logs
EPOCH_RESTART = "epoch-{epoch}-restart-{restart}"  # after the rendezvous host moved
RANK_LOG = "rank-{rank}.log"           # one worker's stdout and stderr
HANG_STACKS = "hang-{host}-{n}.txt"    # a stall's verdict and the node's Python stacks
STOP_NOTICE = "stop.json"              # the allocation's agreed stop (runtime.stopping)
# --- node-to-node boards -------------------------------------------------------------------
LIVENESS = "liveness"                  # liveness/alloc-A/node-N.json: each node's summary
LIVENESS_NODE = "node-{node_rank}.json"
LIVENESS_NODE_GLOB = "node-*.json"
LIVENESS_REPORTED = "reported"         # liveness/reported: hangs rank 0 logged to W&B
HEALTH = "health"                      # health/alloc-A/: the pre-join health claims
RDZV_BOARD = ".rdzv"                   # .rdzv/alloc-A/: the succession board
EPOCH = "epoch-{index}"
DECISION = "decision.json"
CURRENT = "current.json"


_ALLOC_RE = re.compile(r"alloc-([0-9]+)")
_RESTART_RE = re.compile(r"(?:epoch-([0-9]+)-)?restart-([0-9]+)")


def parse_alloc(name: str) -> int | None:
    """The allocation of a folder named :data:`ALLOC` (``alloc-3`` -> 3), else None."""
    m = _ALLOC_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_node_log(name: str) -> str | None:
    """The host of a file named :data:`NODE_LOG` (``node-gpu07.log`` -> ``gpu07``), else None."""
    prefix, _, suffix = NODE_LOG.partition("{host}")
    host = name[len(prefix):len(name) - len(suffix)]
    return host if name.startswith(prefix) and name.endswith(suffix) and host else None


def hpc_home(env: Mapping[str, str] = os.environ) -> Path:
    """Where the user's job index (:data:`JOBS`) lives: ``$HPC_HOME``, else ``~/.hpc``."""
    return Path(env.get("HPC_HOME") or Path.home() / ".hpc")


def parse_restart(name: str) -> tuple[int, int] | None:
    """(epoch, restart) of a folder named :data:`RESTART` or :data:`EPOCH_RESTART`, else None."""
    m = _RESTART_RE.fullmatch(name)
    return (int(m.group(1) or 0), int(m.group(2))) if m else None


@dataclass(frozen=True)
class JobPaths:
    """The paths of one job directory. ``JobPaths(job_dir).outcomes`` and so on."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # the job's files
    @property
    def jobspec(self) -> Path:
        return self.root / JOBSPEC

    @property
    def sbatch(self) -> Path:
        return self.root / SBATCH

    @property
    def slurm_job_id(self) -> Path:
        return self.root / SLURM_JOB_ID

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def reserve(self) -> Path:
        return self.root / RESERVE

    @property
    def secret(self) -> Path:
        return self.root / SECRET

    @property
    def sweep(self) -> Path:
        return self.root / SWEEP

    def sweep_task(self, index: int) -> Path:
        return self.root / SWEEP_TASK.format(index=index)

    @property
    def result(self) -> Path:
        return self.root / RESULT

    # records
    @property
    def outcomes(self) -> Path:
        return self.root / OUTCOMES

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def hangs(self) -> Path:
        return self.root / HANGS

    @property
    def exclusions(self) -> Path:
        return self.root / EXCLUSIONS

    @property
    def stragglers(self) -> Path:
        return self.root / STRAGGLERS

    @property
    def resubmissions(self) -> Path:
        return self.root / RESUBMISSIONS

    # rank 0's bookkeeping
    @property
    def exit_intent(self) -> Path:
        return self.root / EXIT_INTENT

    @property
    def progress(self) -> Path:
        return self.root / PROGRESS

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def wandb_run_id(self) -> Path:
        return self.root / WANDB_RUN_ID

    @property
    def wandb_state(self) -> Path:
        return self.root / WANDB_STATE

    @property
    def wandb_dir(self) -> Path:
        return self.root / WANDB_DIR

    @property
    def wandb_synced(self) -> Path:
        return self.root / WANDB_SYNCED

    @property
    def wandb_story(self) -> Path:
        return self.root / WANDB_STORY

    @property
    def wandb_story_dir(self) -> Path:
        return self.root / WANDB_STORY_DIR

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_JSONL

    # claims
    def claim(self, allocation: int, duty: str) -> Path:
        return self.root / CLAIM.format(duty=duty, allocation=allocation)

    def requeue_request(self, allocation: int) -> Path:
        return self.root / f"{REQUEUE_REQUEST_PREFIX}{allocation}"

    # logs
    @property
    def logs(self) -> Path:
        return self.root / LOGS

    def batch_log(self, job_id: str) -> Path:
        return self.logs / BATCH_LOG.format(job_id=job_id)

    def alloc_logs(self, allocation: int) -> Path:
        return self.logs / ALLOC.format(allocation=allocation)

    def node_log(self, allocation: int, host: str) -> Path:
        return self.alloc_logs(allocation) / NODE_LOG.format(host=host)

    def allocations(self) -> list[int]:
        """The allocations that have a log folder, in order."""
        try:
            names = [p.name for p in self.logs.iterdir()]
        except OSError:
            return []
        return sorted(a for a in map(parse_alloc, names) if a is not None)

    def node_hosts(self, allocation: int) -> list[str]:
        """The hosts whose launcher logged in ``allocation`` (its node logs), sorted."""
        try:
            names = [p.name for p in self.alloc_logs(allocation).iterdir()]
        except OSError:
            return []
        return sorted(h for h in map(parse_node_log, names) if h is not None)

    def rank_log(self, allocation: int, restart: int, rank: int, epoch: int = 0) -> Path:
        folder = (EPOCH_RESTART.format(epoch=epoch, restart=restart) if epoch
                  else RESTART.format(restart=restart))
        return self.alloc_logs(allocation) / folder / RANK_LOG.format(rank=rank)

    def rank_logs(self, rank: int) -> list[tuple[int, int, int, Path]]:
        """Every log of ``rank`` as (allocation, epoch, restart, path), in life order."""
        out = []
        try:
            allocs = list(self.logs.iterdir())
        except OSError:
            return []
        for alloc in allocs:
            a = parse_alloc(alloc.name)
            if a is None or not alloc.is_dir():
                continue
            for restart in alloc.iterdir():
                r = parse_restart(restart.name)
                path = restart / RANK_LOG.format(rank=rank)
                if r is not None and path.is_file():
                    out.append((a, *r, path))
        return sorted(out)

    def hang_stacks(self, allocation: int, host: str, n: int) -> Path:
        return self.alloc_logs(allocation) / HANG_STACKS.format(host=host, n=n)

    def stop_notice(self, allocation: int) -> Path:
        return self.alloc_logs(allocation) / STOP_NOTICE

    # boards
    def liveness(self, allocation: int) -> Path:
        return self.root / LIVENESS / ALLOC.format(allocation=allocation)

    def liveness_node(self, allocation: int, node_rank: int) -> Path:
        return self.liveness(allocation) / LIVENESS_NODE.format(node_rank=node_rank)

    def liveness_nodes(self, allocation: int) -> list[Path]:
        """Every node's published liveness summary of one allocation."""
        return sorted(self.liveness(allocation).glob(LIVENESS_NODE_GLOB))

    @property
    def liveness_reported(self) -> Path:
        return self.root / LIVENESS / LIVENESS_REPORTED

    @property
    def health_root(self) -> Path:
        return self.root / HEALTH

    def health(self, allocation: int) -> Path:
        return self.health_root / ALLOC.format(allocation=allocation)

    def rdzv_board(self, allocation: int) -> Path:
        return self.root / RDZV_BOARD / ALLOC.format(allocation=allocation)

    def rdzv_epoch(self, allocation: int, index: int) -> Path:
        return self.rdzv_board(allocation) / EPOCH.format(index=index)

    def rdzv_decision(self, allocation: int, index: int) -> Path:
        return self.rdzv_epoch(allocation, index) / DECISION

    def rdzv_current(self, allocation: int) -> Path:
        return self.rdzv_board(allocation) / CURRENT
