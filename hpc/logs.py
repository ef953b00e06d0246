"""``hpc logs [-f] JOB``: one rank's output across the job's whole life.

A job's output is spread over files that appear as it lives: each allocation (Slurm requeue)
and each elastic restart inside it writes ``logs/alloc-<A>/restart-<K>/rank-<R>.log``, and the
batch script's own output (launcher messages, srun's status) goes to ``logs/slurm-<id>.out``.
This prints them in life order (allocation, then restart, numerically) with a header per file,
then the batch output without its copy of rank 0's lines (shown already). With ``-f`` it keeps reading: new bytes in known files, and new files as
requeues and restarts create them, until Slurm reports a terminal state (polled with backoff,
one squeue/sacct call per poll), then drains what is left.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from hpc.contract.errors import SpecError
from hpc.contract.jobpaths import JobPaths
from hpc.contract.slurm import SlurmClient
from hpc.contract.index import JobRecord, resolve
from hpc.status import Poller

# Final for sure. PREEMPTED and NODE_FAIL may be followed by a requeue under the same id, so
# they count as final only after they stayed so for several polls.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE"}
MAYBE_FINAL_STATES = {"PREEMPTED", "NODE_FAIL"}
MAYBE_FINAL_POLLS = 3
# The launcher on node 0 copies rank 0's output into the batch output with this line prefix.
TEE_PREFIX = "[rank"


def rank_logs(job_dir: Path, rank: int = 0) -> list[Path]:
    """The rank's log files in life order: by allocation, rendezvous epoch, then restart."""
    return [p for *_, p in JobPaths(job_dir).rank_logs(rank)]


def log_files(job_dir: Path, job_id: str, rank: int = 0) -> list[Path]:
    """Everything ``hpc logs`` shows, in order: the rank's logs, then the batch output."""
    files = rank_logs(job_dir, rank)
    batch = JobPaths(job_dir).batch_log(job_id)
    if batch.is_file():
        files.append(batch)
    return files


class Follower:
    """Prints new bytes of a changing set of files, with a header whenever the file changes.

    Args:
        list_files: Returns the files to show, in order (called on every :meth:`step`).
        out: Where to print.
        drop_tee: Whether a file carries the launcher's copy of rank 0's output (lines starting
            with ``[rank``, already shown from the rank's own log); those lines are skipped, so
            such a file is printed by whole lines.
    """

    def __init__(self, list_files: Callable[[], list[Path]], out: TextIO,
                 drop_tee: Callable[[Path], bool] = lambda path: False) -> None:
        self.list_files, self.out, self.drop_tee = list_files, out, drop_tee
        self.offsets: dict[Path, int] = {}
        self._current: Path | None = None

    def step(self, final: bool = False) -> int:
        """Prints what is new; returns the number of bytes consumed.

        Args:
            final: The files are complete: print a last line without its newline too.
        """
        consumed = 0
        for path in self.list_files():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            if self.drop_tee(path) and not final:
                data = data[: data.rfind(b"\n") + 1]  # whole lines only
            if not data:
                continue
            text = data.decode(errors="replace")
            if self.drop_tee(path):
                text = "".join(line for line in text.splitlines(keepends=True)
                               if not line.startswith(TEE_PREFIX))
            if text and path != self._current:
                self.out.write(f"==> {path} <==\n")
                self._current = path
            self.out.write(text)
            self.out.flush()
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            consumed += len(data)
        return consumed


def follow(job: JobRecord, follower: Follower, poll_state: Callable[[], str],
           wait: Callable[[], None]) -> str:
    """Prints until the job is final, then drains; returns the final state.

    Args:
        job: The job.
        follower: Prints new output.
        poll_state: Returns the job's current Slurm state (one polite poll).
        wait: Sleeps until the next poll (with backoff).
    """
    for state in following(follower, poll_state):
        if state is not None:
            return state
        wait()
    raise AssertionError("following() ends with the final state")


def following(follower: Follower, poll_state: Callable[[], str]) -> Iterator[str | None]:
    """Steps ``follower`` once per poll: yields None while the job goes on (the caller waits
    before the next), then, after draining, the final state."""
    maybe_final = 0
    while True:
        follower.step()
        state = poll_state()
        maybe_final = maybe_final + 1 if state in MAYBE_FINAL_STATES else 0
        if state in FINAL_STATES or maybe_final >= MAYBE_FINAL_POLLS:
            follower.step(final=True)
            yield state
            return
        yield None


def main(args: argparse.Namespace) -> int:
    """``hpc logs [-f] [--rank R] JOB``."""
    job = resolve(args.job)
    if not job.job_dir:
        raise SpecError("JOB", args.job, "a job submitted with hpc (its directory is recorded "
                        "in $HPC_HOME/jobs.jsonl) or a job directory", "hpc logs runs/gpt")
    job_dir = Path(job.job_dir)
    batch = JobPaths(job_dir).batch_log(job.job_id)
    follower = Follower(lambda: log_files(job_dir, job.job_id, args.rank), sys.stdout,
                        drop_tee=lambda path: path == batch)
    if args.follow and not job.job_id:   # hpc run: no Slurm state to follow
        print("hpc logs: -f follows Slurm jobs; this is a job of hpc run (its own terminal shows "
              "it live): printing its output so far", file=sys.stderr)
    if not args.follow or not job.job_id:
        if not follower.step(final=True):
            print(f"hpc logs: no output yet in {JobPaths(job_dir).logs}", file=sys.stderr)
        return 0

    poller = Poller(SlurmClient(), [job])

    def poll_state() -> str:
        return poller.poll()[0].state

    state = follow(job, follower, poll_state, poller.wait)
    print(f"hpc logs: job {job.job_id} is {state}", file=sys.stderr)
    return 0
