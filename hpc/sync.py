"""``hpc sync JOB``: push a job's offline W&B runs to the server, in order, into its one run.

Compute nodes often have no internet, so jobs log to W&B offline (the default): every start of
rank 0 (each allocation, each elastic restart) leaves one ``JOB_DIR/wandb/offline-run-<time>-<id>``
folder, all with the job's run id (``JOB_DIR/wandb_run_id``). ``hpc sync`` runs on the login
node, which has network, and uploads them:

* through wandb's own ``wandb sync`` (a subprocess: its real code path, nothing re-implemented),
  one folder at a time, oldest first, each with ``--id`` so all land in the one run;
* idempotently: after each folder uploads, its name is added to ``JOB_DIR/wandb_synced.json``
  (atomic write), and a folder already there (or that wandb itself marked ``.synced``) is never
  sent again, so a second ``hpc sync`` duplicates nothing and an interrupted one resumes;
* with retries (tenacity) on a failed or timed-out upload, each attempt bounded (wandb without
  network otherwise retries for minutes);
* with a clear error before anything is sent when there is no API key or the server cannot be
  reached;
* leaving for later a folder written in the last ``settle_s`` seconds (a running allocation
  is still appending to it).

wandb is never imported here: the login node stays light and the upload runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import netrc
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from hpc.contract import jobdir, jobpaths
from hpc.contract.jobpaths import JobPaths
from hpc.contract.wandb_records import offline_folders
from hpc.contract.errors import HpcError, SpecError

SYNCED = jobpaths.WANDB_SYNCED          # what hpc sync uploaded already (folder names)
DEFAULT_BASE_URL = "https://api.wandb.ai"
RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True)
class SyncPlan:
    """What ``hpc sync`` would do for one job (pure value).

    Attributes:
        job_dir: The job directory.
        run_id: The job's W&B run id.
        folders: Every offline folder of that run, oldest first.
        done: Names of folders uploaded before (our marker or wandb's ``.synced``).
        unsettled: Names of folders still being written (left for a later sync).
    """

    job_dir: Path
    run_id: str
    folders: tuple[Path, ...]
    done: frozenset[str]
    unsettled: frozenset[str]

    @property
    def pending(self) -> tuple[Path, ...]:
        return tuple(f for f in self.folders if f.name not in self.done | self.unsettled)


def read_synced(job_dir: Path, run_id: str) -> set[str]:
    """Folder names recorded as uploaded for ``run_id``."""
    data = jobdir.read_json(Path(job_dir) / SYNCED) or {}
    return set(data.get("folders", [])) if data.get("run_id") == run_id else set()


def story_folders(job_dir: Path, run_id: str) -> set[str]:
    """Offline folders holding the job's story (:mod:`hpc.report.wandb_story`): its writer
    finished them, so they are never left to settle."""
    state = jobdir.read_json(JobPaths(job_dir).wandb_story) or {}
    return set(state.get("folders", [])) if state.get("run_id") == run_id else set()


def mark_synced(job_dir: Path, run_id: str, folder: str) -> None:
    """Adds ``folder`` to the marker (atomic: a crash leaves the old or the new list)."""
    done = read_synced(job_dir, run_id) | {folder}
    jobdir.write_atomic(Path(job_dir) / SYNCED,
                        json.dumps({"run_id": run_id, "folders": sorted(done)}, indent=1) + "\n")


def plan(job_dir: Path, *, now: float | None = None, settle_s: float = 30.0) -> SyncPlan:
    """Which offline folders of the job to upload, in order.

    Raises:
        HpcError: the job has no W&B run id (it never started W&B).
    """
    job_dir = Path(job_dir)
    try:
        run_id = JobPaths(job_dir).wandb_run_id.read_bytes().decode("utf-8", "replace").strip()
    except FileNotFoundError:
        raise HpcError(f"{job_dir} has no W&B run ({jobdir.WANDB_RUN_ID} is missing): the job "
                       "has not started yet, or W&B was disabled for it") from None
    if not RUN_ID_RE.fullmatch(run_id):   # it goes to `wandb sync --id` and into a pattern
        raise HpcError(f"{JobPaths(job_dir).wandb_run_id} holds {run_id[:80]!r}, not a W&B run id "
                       "(letters, digits, - and _): the file was changed or damaged; put the run's "
                       "id back (the offline-run-*-ID folders under wandb/ name it)")
    folders = offline_folders(JobPaths(job_dir).wandb_dir, run_id)
    done = read_synced(job_dir, run_id) | {
        f.name for f in folders if (f / f"run-{run_id}.wandb.synced").exists()}
    now = time.time() if now is None else now
    stories = story_folders(job_dir, run_id)   # finished by their writer
    unsettled = {f.name for f in folders if f.name not in stories
                 and now - (f / f"run-{run_id}.wandb").stat().st_mtime < settle_s}
    return SyncPlan(job_dir, run_id, tuple(folders), frozenset(done), frozenset(unsettled))


def base_url(env: Mapping[str, str]) -> str:
    return env.get("WANDB_BASE_URL", "").strip() or DEFAULT_BASE_URL


def check_credentials(env: Mapping[str, str]) -> None:
    """An API key for the server in the environment or ``~/.netrc`` (where ``wandb login`` puts it).

    Raises:
        HpcError: no key, saying how to get one in place.
    """
    if env.get("WANDB_API_KEY", "").strip() or env.get("WANDB_IDENTITY_TOKEN_FILE", "").strip():
        return
    host = urlparse(base_url(env)).hostname or ""
    path = env.get("NETRC") or str(Path(env.get("HOME", str(Path.home()))) / ".netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise HpcError(f"no W&B API key for {base_url(env)}: run `wandb login` on this node or "
                   "export WANDB_API_KEY, then run hpc sync again (nothing was uploaded)")


def check_reachable(env: Mapping[str, str], timeout_s: float = 5.0) -> None:
    """Opens a TCP connection to the server (wandb would retry for minutes instead).

    Raises:
        HpcError: the server cannot be reached, with the reason.
    """
    url = urlparse(base_url(env))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return
    except OSError as e:
        raise HpcError(f"cannot reach the W&B server {base_url(env)} ({e}): hpc sync needs "
                       "network (run it on a login node, or set WANDB_BASE_URL for a local "
                       "server); nothing was uploaded, the offline runs stay in JOB_DIR/wandb") from None


def sync_command(folder: Path, run_id: str, *, project: str = "", entity: str = "") -> list[str]:
    """The ``wandb sync`` command for one folder into the job's run (pure)."""
    cmd = [sys.executable, "-m", "wandb", "sync", "--id", run_id, "--include-synced",
           "--no-include-online"]
    if project:
        cmd += ["--project", project]
    if entity:
        cmd += ["--entity", entity]
    return [*cmd, str(folder)]


Runner = Callable[[list[str], float], None]


def run_wandb(cmd: list[str], timeout_s: float) -> None:
    """Runs ``wandb sync``; raises :class:`HpcError` with its output unless it succeeded."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                           env=dict(os.environ, WANDB_SILENT="false"))
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise HpcError(f"wandb sync did not finish in {timeout_s:.0f} s: the server "
                       f"{base_url(os.environ)} is unavailable or too slow (wandb retries "
                       f"failed requests); {out.strip()[-500:]}".rstrip("; ")) from None
    said = (r.stdout + r.stderr).strip()
    if r.returncode != 0 or re.search(r"\berror\b", said, re.IGNORECASE):
        raise HpcError(f"wandb sync failed (exit {r.returncode}): {said[-800:]}")


def sync(job_dir: Path, *, project: str = "", entity: str = "", attempts: int = 3,
         timeout_s: float = 600.0, settle_s: float = 30.0, runner: Runner = run_wandb,
         env: Mapping[str, str] | None = None, out: Callable[[str], None] = print,
         story: bool = True) -> int:
    """Uploads the job's pending offline folders, oldest first; returns how many.

    First, once the job has ended, its story (goodput table, timeline picture, faults and
    recoveries: :mod:`hpc.report.wandb_story`) is written into the run as one more offline
    folder, uploaded last with the others.

    Args:
        job_dir: The job directory.
        project, entity: Override the ones recorded in the runs (empty: keep them).
        attempts: Tries per folder (tenacity, exponential wait).
        timeout_s: Bound on one ``wandb sync`` attempt.
        settle_s: Folders written this recently are left for a later sync.
        runner: Runs one command (tests pass a fake; the default runs wandb for real).
        env: Environment for the credential and network checks (default ``os.environ``).
        out: Where progress lines go.
        story: Write the job's story into the run first (``--no-story``: do not).

    Raises:
        HpcError: no key, no network, or a folder that would not upload (the folders before it
            are recorded as synced; run hpc sync again).
    """
    import tenacity

    env = os.environ if env is None else env
    if story:
        from hpc.report import wandb_story   # the ledger and its loader (Slurm client, tenacity)

        p = plan(job_dir, settle_s=settle_s)
        outcomes = jobdir.read_outcomes(p.job_dir)
        ended = bool(outcomes) and outcomes[-1].kind in FINAL_KINDS and not p.unsettled
        try:
            wandb_story.write(p.job_dir, p.run_id, p.folders, ended=ended, project=project,
                              entity=entity, out=out)
        except HpcError as e:   # the uploads matter more: they go on, the next sync tries again
            out(f"hpc sync: warning: {e}")
    p = plan(job_dir, settle_s=settle_s)
    for name in sorted(p.unsettled):
        out(f"hpc sync: {name} was written in the last {settle_s:.0f} s (running?): left for later")
    if not p.pending:
        out(f"hpc sync: nothing to upload for run {p.run_id} ({len(p.folders)} offline "
            f"folder(s), {len(p.done)} synced before)")
        return 0
    check_credentials(env)
    check_reachable(env)
    for i, folder in enumerate(p.pending, 1):
        cmd = sync_command(folder, p.run_id, project=project, entity=entity)
        out(f"hpc sync: [{i}/{len(p.pending)}] {folder.name} -> run {p.run_id}")
        try:
            for attempt in tenacity.Retrying(stop=tenacity.stop_after_attempt(attempts),
                                             wait=tenacity.wait_exponential(min=1, max=30),
                                             retry=tenacity.retry_if_exception_type(HpcError),
                                             reraise=True):
                with attempt:
                    runner(cmd, timeout_s)
        except HpcError as e:
            raise HpcError(f"{folder.name} did not upload after {attempts} attempt(s): {e}. "
                           f"{i - 1} folder(s) before it are recorded as synced; run hpc sync "
                           "again to go on") from None
        mark_synced(p.job_dir, p.run_id, folder.name)
    out(f"hpc sync: {len(p.pending)} folder(s) uploaded into run {p.run_id}")
    return len(p.pending)


# Outcomes after which a job runs no more allocations (the others are followed by a requeue).
FINAL_KINDS = frozenset({"finished", "app_error", "cancelled", "hang"})


def follow(job_dir: Path, *, every_s: float = 60.0, sleep: Callable[[float], None] = time.sleep,
           **kwargs: object) -> int:
    """Syncs every ``every_s`` seconds until the job ended and everything is uploaded.

    The job has ended when its last outcome is final (finished, an application error,
    cancelled, a hang). Returns how many folders were uploaded in all.
    """
    total = 0
    while True:
        outcomes = jobdir.read_outcomes(Path(job_dir))
        ended = bool(outcomes) and outcomes[-1].kind in FINAL_KINDS
        total += sync(job_dir, **kwargs)  # type: ignore[arg-type]
        if ended and not plan(job_dir, settle_s=0).pending:
            return total
        sleep(every_s)


def add_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("sync", help="upload a job's offline W&B runs into its one run "
                                     "(idempotent; run it where there is network)")
    sp.add_argument("job", help="job id or job directory")
    sp.add_argument("--project", default="", help="W&B project (default: the one in the runs)")
    sp.add_argument("--entity", default="", help="W&B entity (default: the API key's)")
    sp.add_argument("--timeout", type=float, default=600.0, metavar="S",
                    help="bound on one folder's upload attempt [default: 600]")
    sp.add_argument("--attempts", type=int, default=3, help="tries per folder [default: 3]")
    sp.add_argument("-f", "--follow", action="store_true",
                    help="keep syncing every --every seconds until the job has ended")
    sp.add_argument("--every", type=float, default=60.0, metavar="S",
                    help="with --follow: seconds between syncs [default: 60]")
    sp.add_argument("--no-story", action="store_true",
                    help="do not write the job's story (goodput table, timeline picture, faults) "
                         "into its run before uploading")


def main(args: argparse.Namespace) -> int:
    from hpc.contract.index import resolve   # here: `hpc --help` imports this module for add_parser only

    path = Path(args.job).expanduser()
    if path.is_dir() and jobdir.is_job_dir(path):
        job_dir = path
    else:
        record = resolve(args.job)
        if not record.job_dir:
            raise SpecError("JOB", args.job, "a job submitted from here or a job directory",
                            "hpc sync jobs/train_gpt-...")
        job_dir = Path(record.job_dir)
    options = dict(project=args.project, entity=args.entity, attempts=max(1, args.attempts),
                   timeout_s=args.timeout, story=not args.no_story)
    if args.follow:
        follow(job_dir, every_s=args.every, **options)
    else:
        sync(job_dir, **options)
    return 0
