"""Rank 0's W&B sink: one job is one W&B run, across requeues and elastic restarts.

What it does and why:

* **One run id per job.** The id is made once and stored in `JOB_DIR/wandb_run_id` (exclusive,
  atomic create, so two racing starts agree); every later start reuses it with `resume="allow"`.
  We do not use `resume="must"` (it fails in offline mode and on the very first start) nor
  `resume_from="<id>?_step=N"` (W&B's "rewind": a private-preview, server-side feature that needs
  online mode; offline runs cannot be resumed or rewound at all, wandb/wandb#4624 and #2423, and an
  offline rewind segment overwrites the earlier one on `wandb sync`, wandb/wandb#5865).
* **Each step at most once (first write wins).** Offline history is append-only across restarts:
  every start writes a new `offline-run-*` folder and `wandb sync` concatenates them. So the sink
  logs a step only if it is above the highest step ever logged for this run, persisted in
  `JOB_DIR/wandb_state.json` after each log. After a crash at step M with the last checkpoint at
  N < M, the re-done steps N+1..M are not logged again; their history keeps the values from the
  first attempt (same data, same weights at N, so close to the re-run's values, not bit-equal
  unless the run is deterministic). Offline, a resume reads the run's files (a rank 0 killed by
  SIGKILL marked steps its W&B service never wrote: at most `FLUSH_S` of rows and the open
  row): the re-run logs those. A `resumed` event records `resume_step` and the last logged
  step so the gap is visible. This works offline and online alike and never loses a step that
  reached W&B.
* **Events** (`preempted`, `restarted`, `node_lost`, ...) are history keys `events/<name>` = 1 with
  fields as `events/<name>/<field>`, merged into the next logged row (or the current row, when
  its step is the event's step). They chart at the step they happened and are read back from the
  offline file like any metric, without creating extra rows (which would duplicate a `_step`).
* **Failures never stop training.** `wandb.init` and `run.log` are retried briefly (tenacity),
  `init` is bounded by `settings.init_timeout` (online without network otherwise blocks ~90 s);
  then the sink warns once and continues into `JOB_DIR/metrics.jsonl` (`JsonlSink`).
* wandb is imported inside, never at module load: the login node stays light.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.contract import components, jobdir, jobpaths
from hpc.contract.components import WandbConfig
from hpc.contract.events import read_events
from hpc.contract.jobspec import WANDB_MODES
from hpc.contract.wandb_records import offline_folders
from hpc.contract.wandb_records import iter_records
from runtime.wandb_env import RUN_ID_FILE, load_or_create_run_id  # noqa: F401 - re-exported
from runtime.worker.metrics import JsonlSink, MetricsSink, NullSink, StepFilter

if TYPE_CHECKING:
    from runtime.env import WorkerEnv

log = logging.getLogger(__name__)

STATE_FILE = jobdir.WANDB_STATE
FALLBACK_FILE = jobdir.METRICS_JSONL
DEFAULT_PROJECT = "hpc-elastic"
# wandb-core writes the offline `.wandb` file when a 32-KiB block fills, at the run's end, and
# every `x_transaction_log_flush_interval` (15 s by default): a rank 0 that is SIGKILLed (or
# whose service dies with it) loses what was not written yet, while the step filter counts it
# as logged. One write call a second (no fsync) bounds that loss to about a second of rows.
FLUSH_S = 1.0
TAIL_BLOCKS = 4     # the last 128 KiB of an offline file: its newest rows, read after a lost rank 0
SETTLE_MAX_S = 15.0  # how long a new rank 0 waits for a lost one's W&B service to finish writing
QUIET_S = 3 * FLUSH_S   # an offline file unchanged this long: no service writes it any more


@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbSettings:
    """How rank 0 talks to W&B.

    Attributes:
        mode: "offline" (default; no network), "online", or "disabled" (JSONL file only).
        project: W&B project; empty means `hpc-elastic`.
        entity: W&B entity; empty means the API key's default.
        name: display name; empty lets W&B choose.
        dir: where wandb writes `wandb/offline-run-*`; None means the job directory.
        init_timeout_s: bound on one `wandb.init` attempt, in seconds.
        init_attempts: `wandb.init` attempts before falling back to the JSONL file.
        console: wandb console capture ("off": the launcher already keeps per-rank logs).
    """

    mode: str = components.WANDB.mode
    project: str = ""
    entity: str = ""
    name: str = ""
    dir: Path | None = None
    init_timeout_s: float = 15.0
    init_attempts: int = 2
    console: str = "off"

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"wandb mode {self.mode!r} is not one of {', '.join(WANDB_MODES)}; "
                             "e.g. --wandb-mode offline")
        if not self.init_timeout_s > 0:
            raise ValueError(f"init_timeout_s must be > 0, got {self.init_timeout_s}")
        if self.init_attempts < 1:
            raise ValueError(f"init_attempts must be >= 1, got {self.init_attempts}")


def _last_step(path: Path, last_blocks: int | None) -> int | None:
    """The highest ``_step`` of the history rows in one offline file (or its last blocks)."""
    written: int | None = None
    for record in iter_records(path, last_blocks=last_blocks):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                if (item.key or "/".join(item.nested_key)) == "_step" and item.value_json:
                    written = max(int(float(item.value_json)), written or 0)
    return written


def run_metadata(worker: WorkerEnv) -> dict[str, Any]:
    """Slurm and elastic facts for the run config, from the worker's environment."""
    return {
        "slurm/job_id": worker.slurm.job_id,
        "slurm/nodelist": worker.slurm.nodelist,
        "slurm/nnodes": worker.slurm.nnodes,
        "slurm/partition": worker.slurm.partition,
        "slurm/restart_count": worker.slurm.restart_count,
        "elastic/restart_count": worker.restart_count,
        "world_size": worker.world_size,
        "allocation": worker.allocation,
        "hostname": worker.hostname,
    }


class WandbSink:
    """A `MetricsSink` for global rank 0 that writes one W&B run per job (see module docstring).

    Args:
        job_dir: the job directory.
        settings: W&B settings.
        metadata: values for the run config (Slurm job id, node list, restart count, world size).
        resume_step: the checkpoint step this process resumed from (None on a fresh start).
        run_id: an id to use when the job directory has none yet (e.g. from a checkpoint).
    """

    def __init__(self, job_dir: Path | str, settings: WandbSettings | None = None, *,
                 metadata: Mapping[str, Any] | None = None, resume_step: int | None = None,
                 run_id: str | None = None, check_written: bool = False) -> None:
        self.job_dir = Path(job_dir)
        self.settings = settings or WandbSettings()
        self.run_id = load_or_create_run_id(self.job_dir, run_id)
        self._filter = StepFilter(self.job_dir / STATE_FILE, self.run_id)
        if check_written and self.settings.mode == "offline":
            self._trust_only_written()
        self._run: Any = None
        self._fallback: JsonlSink | None = None
        self._pending: dict[str, Any] = {}
        self._open_step: int | None = None  # step of the row this process logged last
        self._closed = False
        self.dropped_steps = 0
        if self.settings.mode == "disabled":
            self._fallback = JsonlSink(self.job_dir / FALLBACK_FILE)
        else:
            self._start(dict(metadata or {}))
        if self._fallback is not None and metadata:
            self._fallback.config(metadata)
        if resume_step is not None:
            last = self._filter.last_step
            self.event("resumed", None, resume_step=int(resume_step),
                       last_logged_step=-1 if last is None else last)

    def _trust_only_written(self) -> None:
        """The mark is lowered to the last step the run's offline files hold: a rank 0 that was
        SIGKILLed marked steps its service never wrote (up to ``FLUSH_S`` of rows, and wandb's
        open row, committed only by the next step). Its heir logs those again from its memory
        (in-process recovery); after a restart the re-done steps fill them."""
        root = Path(self.settings.dir) if self.settings.dir is not None else self.job_dir
        # A lost rank 0 on this node: its service is seen in /proc until it has written all it
        # will. One on another node: only its file going quiet tells (QUIET_S after a write).
        here = rank0_only_on(self.job_dir, socket.gethostname())
        settle_orphaned_writers(offline_folders(root / jobpaths.WANDB_DIR, self.run_id), self.run_id,
                                quiet_s=0.0 if here else QUIET_S)
        written: int | None = None
        # Steps only grow from one start's folder to the next: the newest folder with a row
        # holds the highest, in its last blocks unless a long summary or config came after.
        for folder in reversed(offline_folders(root / jobpaths.WANDB_DIR, self.run_id)):
            try:
                for blocks in (TAIL_BLOCKS, None):
                    written = _last_step(folder / f"run-{self.run_id}.wandb", blocks)
                    if written is not None:
                        break
            except (OSError, ValueError) as e:
                log.warning("W&B: cannot read %s (%s): steps marked logged stay so", folder, e)
                return
            if written is not None:
                break
        if self._filter.last_step is not None and (written is None or written < self._filter.last_step):
            log.warning("W&B: steps %s..%d were marked logged but are not in the run's files (the "
                        "rank 0 that logged them was lost): logged again if still held",
                        1 if written is None else written + 1, self._filter.last_step)
            self._filter.last_step = written

    @property
    def last_logged_step(self) -> int | None:
        """The highest step logged for this run so far (across restarts)."""
        return self._filter.last_step

    @property
    def using_fallback(self) -> bool:
        """Whether metrics go to the JSONL file instead of W&B."""
        return self._fallback is not None

    def _start(self, metadata: dict[str, Any]) -> None:
        import tenacity

        s = self.settings
        root = Path(s.dir) if s.dir is not None else self.job_dir
        try:
            root.mkdir(parents=True, exist_ok=True)
            if not os.access(root, os.W_OK):  # wandb would silently write to /tmp/wandb instead
                raise PermissionError(f"W&B directory {root} is not writable")
            import wandb

            for attempt in tenacity.Retrying(stop=tenacity.stop_after_attempt(s.init_attempts),
                                             wait=tenacity.wait_fixed(1.0), reraise=True):
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        # A timed-out init may still hold the run id in this process's W&B
                        # service ("run ID ... is in use"): start the retry from a clean one.
                        try:
                            wandb.teardown()
                        except Exception as e:  # noqa: BLE001
                            log.warning("W&B teardown before retrying init failed: %r", e)
                    self._run = wandb.init(
                        id=self.run_id, resume="allow", mode=s.mode,
                        project=s.project or DEFAULT_PROJECT, entity=s.entity or None,
                        name=s.name or None, dir=str(root), config=metadata,
                        settings=wandb.Settings(init_timeout=s.init_timeout_s, console=s.console,
                                                x_transaction_log_flush_interval=FLUSH_S))
            if metadata:  # on a resumed run, init's config does not override old values
                self._run.config.update(metadata, allow_val_change=True)
        except Exception as err:  # noqa: BLE001 - any W&B failure must not stop training
            self._fail("init", err)

    def _fail(self, what: str, err: BaseException) -> None:
        msg = (f"W&B {what} failed ({type(err).__name__}: {err}); metrics continue in "
               f"{self.job_dir / FALLBACK_FILE}")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception as finish_err:  # noqa: BLE001
                log.warning("W&B finish after a failure also failed: %r", finish_err)
        self._fallback = JsonlSink(self.job_dir / FALLBACK_FILE)
        self._fallback.event("wandb_failed", None, stage=what, error=repr(err))
        for key, value in self._pending.items():
            self._fallback.event(key.split("/", 1)[1], None, value=value)
        self._pending.clear()

    def _wandb_log(self, row: Mapping[str, Any], step: int) -> bool:
        import tenacity

        try:
            for attempt in tenacity.Retrying(stop=tenacity.stop_after_attempt(2),
                                             wait=tenacity.wait_fixed(0.1), reraise=True):
                with attempt:
                    self._run.log(dict(row), step=step)
            return True
        except Exception as err:  # noqa: BLE001
            self._fail("log", err)
            return False

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log metrics for `step` unless that step was already logged for this run.

        Args:
            metrics: metric name to number (reduced already; see `reduce_metrics`).
            step: the global training step; steps must increase within a process.
        """
        step = int(step)
        if self._closed:
            return
        if not self._filter.admits(step):
            self.dropped_steps += 1
            return
        row = {k: float(v) for k, v in metrics.items()}
        if self._run is not None:
            row.update(self._pending)
            if self._wandb_log(row, step):
                self._pending.clear()
                self._open_step = step
        if self._fallback is not None:
            self._fallback.log(metrics, step)
        self._filter.mark(step)

    def event(self, name: str, step: int | None = None, **fields: Any) -> None:
        """Record an event as `events/<name>` (+ `events/<name>/<field>`) in the history.

        Args:
            name: event name, e.g. "preempted", "restarted", "node_lost".
            step: the step it happened at, if known (kept as `events/<name>/step`).
            **fields: numbers or strings to keep with it.
        """
        if self._closed:
            return
        if self._fallback is not None:
            self._fallback.event(name, step, **fields)
            return
        record: dict[str, Any] = {f"events/{name}": 1}
        if step is not None:
            record[f"events/{name}/step"] = int(step)
        for key, value in fields.items():
            ok = isinstance(value, (int, float, str, bool))
            record[f"events/{name}/{key}"] = value if ok else str(value)
        self._pending.update(record)
        if step is not None and step == self._open_step:  # merge into the row still open
            if self._wandb_log(self._pending, step):
                self._pending.clear()

    def config(self, update: Mapping[str, Any]) -> None:
        """Merge `update` into the run config (later values win)."""
        if self._closed:
            return
        if self._run is not None:
            try:
                self._run.config.update(dict(update), allow_val_change=True)
            except Exception as err:  # noqa: BLE001
                self._fail("config", err)
        if self._fallback is not None:
            self._fallback.config(update)

    def close(self, exit_code: int = 0) -> None:
        """Flush pending events and finish the run; safe to call twice."""
        if self._closed:
            return
        if self._run is not None and self._pending:
            if self._open_step is not None:
                self._wandb_log(self._pending, self._open_step)
            else:  # no row in this process: a new row would duplicate a step; keep in config
                self.config({f"unattached/{k}": v for k, v in self._pending.items()})
            self._pending.clear()
        self._closed = True
        if self._run is not None:
            try:
                self._run.finish(exit_code=exit_code)
            except Exception as err:  # noqa: BLE001
                log.warning("W&B finish failed: %s", err)
            self._run = None
        if self._fallback is not None:
            self._fallback.close(exit_code)


def make_sink(
    rank: int,
    *,
    job_dir: Path | str,
    config: WandbConfig = components.WANDB,
    name: str = "",
    metadata: Mapping[str, Any] | None = None,
    resume_step: int | None = None,
    init_timeout_s: float = 15.0,
    run_id: str | None = None,
    check_written: bool = False,
) -> MetricsSink:
    """The sink for this rank: a `WandbSink` on global rank 0, a `NullSink` everywhere else.

    Args:
        rank: this process's global rank.
        job_dir: the job directory (holds `wandb_run_id`, `wandb_state.json`, `wandb/`,
            `metrics.jsonl`).
        config: the job's W&B settings (`JobSpec.wandb`): mode ("offline" by default, "online",
            or "disabled": rank 0 then writes only the JSONL file), project (empty:
            `hpc-elastic`) and entity (empty: the default for the API key).
        name: display name of the run (empty: W&B's choice).
        metadata: Slurm and job facts for the run config (job id, node list, restart count, world
            size, ...).
        resume_step: the checkpoint step this process resumed from, or None on a fresh start.
        init_timeout_s: bound on `wandb.init` per attempt (online without network blocks ~90 s).
        run_id: a W&B run id to adopt if the job directory has none yet (e.g. from a checkpoint
            manifest); the id in `JOB_DIR/wandb_run_id` always wins.
        check_written: a start after a lost rank 0 (a resume from a checkpoint, or the rank
            that became rank 0 at an in-process re-form): in offline mode only the steps in the
            run's offline files count as logged, so re-done or remembered rows fill what the
            lost process's service never wrote.

    Returns:
        A sink; the caller calls it on every rank without checking the rank.
    """
    if rank != 0:
        return NullSink()
    settings = WandbSettings(mode=config.mode, project=config.project, entity=config.entity,
                             name=name, init_timeout_s=init_timeout_s)
    return WandbSink(Path(job_dir), settings, metadata=metadata, resume_step=resume_step,
                     run_id=run_id, check_written=check_written)


def orphaned_services(run_file: str, proc: Path = Path("/proc")) -> list[int]:
    """PIDs of W&B services on this node whose process is gone (``wandb-core --pid P``, P dead)
    and that hold a file named ``run_file`` open (this run's: another job's do not count).

    A SIGKILLed rank 0's service outlives it: it still writes the rows it had received, then
    exits. Read before it has, the run's files lack rows that appear a moment later."""
    out = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"wandb-core") or b"--pid" not in argv:
            continue
        try:
            parent = int(argv[argv.index(b"--pid") + 1])
        except (IndexError, ValueError):
            continue
        if (proc / str(parent)).exists():
            continue
        try:
            files = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if any(os.path.basename(f) == run_file for f in files):
            out.append(int(entry.name))
    return out


def rank0_only_on(job_dir: Path, host: str) -> bool:
    """Whether every rank 0 of the job so far ran on ``host``, this one and an earlier one at
    least (their ``session_start`` events): then an earlier rank 0's W&B service, if it still
    writes, is this node's to see. An earlier rank 0 without a record (lost before its events
    were written) leaves it unknown: False."""
    hosts = [e.get("node") for e in read_events(job_dir) if e.get("ev") == "session_start" and e.get("rank") == 0]
    return len(hosts) >= 2 and all(h == host for h in hosts)


def settle_orphaned_writers(folders: list[Path], run_id: str, *, max_s: float = SETTLE_MAX_S,
                            quiet_s: float = QUIET_S, clock: Any = time.monotonic,
                            sleep: Any = time.sleep) -> float:
    """Waits, at most ``max_s``, until a lost rank 0's W&B service has written all it will: no
    orphaned service left on this node (:func:`orphaned_services`) and the newest offline file
    unchanged for ``quiet_s`` (a service on another node: only its writes tell). Returns the
    seconds waited. Read earlier, the new rank 0 logged again steps that the old service wrote
    right after (CI of 6768ed4: steps 7..10 twice)."""
    newest = folders[-1] / f"run-{run_id}.wandb" if folders else None
    start = clock()
    while clock() - start < max_s:
        try:
            age = time.time() - newest.stat().st_mtime if newest is not None else quiet_s
        except OSError:
            age = quiet_s
        if age >= quiet_s and not orphaned_services(f"run-{run_id}.wandb"):
            break
        sleep(0.2)
    waited = clock() - start
    if waited >= max_s:
        log.warning("W&B: the lost rank 0's service still writes %s after %.0fs: reading it now",
                    newest, waited)
    return waited
