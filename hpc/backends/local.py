"""The local backend: ``hpc run``, the embedded default. No Slurm needed.

It writes the same job directory a Slurm job writes, then starts one per-node launcher per
(simulated) node on this machine, all meeting at a c10d rendezvous on 127.0.0.1 on a free
port. Rank 0's output streams to the terminal; every rank's output is in the job
directory. Ctrl-C (SIGINT) and SIGTERM are passed to the launchers, which pass the warning
on to the workers so they can save before exiting.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from hpc.contract import environment as job_env
from hpc.contract import jobdir
from hpc.contract.jobspec import JobSpec
from hpc.secrets import check_no_secrets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare(spec: JobSpec) -> Path:
    """Creates the job directory and writes ``jobspec.json`` (refuses to reuse a finished one).

    Raises:
        SpecError: for a secret in ``spec.env`` or the script's arguments (nothing is created).
    """
    check_no_secrets(spec)
    job_dir = jobdir.create(Path(spec.job_dir))
    path = job_dir / jobdir.JOBSPEC
    if path.exists():
        old = JobSpec.load(job_dir)
        if (old.script, old.nproc_per_node) != (spec.script, spec.nproc_per_node):
            print(f"hpc: note: {job_dir} held another job's spec; it is replaced "
                  "(checkpoints there are reused when compatible)", file=sys.stderr)
    jobdir.write_atomic(path, spec.to_json())
    return job_dir


def launcher_argv(spec: JobSpec, job_dir: Path, node_rank: int, port: int, run_id: str) -> list[str]:
    return [spec.python, "-m", "runtime.launch", "--job-dir", str(job_dir), "--node-rank",
            str(node_rank), "--rdzv-host", "127.0.0.1", "--rdzv-port", str(port), "--run-id", run_id, "--local"]


def run(spec: JobSpec) -> int:
    """Runs ``spec`` locally; returns the job's exit status."""
    job_dir = prepare(spec)
    nodes = spec.max_nodes
    port = spec.rdzv_port or free_port()
    run_id = uuid.uuid4().hex[:12]
    print(f"hpc run: {Path(spec.script).name} on {nodes} local node(s) x {spec.nproc_per_node} "
          f"process(es); job dir {job_dir}", file=sys.stderr, flush=True)
    started = time.monotonic()
    # Launchers get their own session so a terminal's Ctrl-C reaches only us: the first
    # Ctrl-C becomes a SIGTERM warning (workers save and exit), a second one stops hard.
    # Each `hpc run` on a job directory is a new allocation of that job (as a requeue is).
    env = dict(os.environ, **{job_env.ALLOCATION: str(len(jobdir.read_outcomes(job_dir)))})
    procs = [subprocess.Popen(launcher_argv(spec, job_dir, i, port, run_id), cwd=os.getcwd(),
                              env=env, start_new_session=True) for i in range(nodes)]
    interrupts = [0]

    def forward(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT:
            interrupts[0] += 1
            signum = signal.SIGTERM if interrupts[0] == 1 else signal.SIGINT
            print("hpc run: interrupted: asking the workers to save and stop (Ctrl-C again to "
                  "stop now)" if interrupts[0] == 1 else "hpc run: stopping now", file=sys.stderr)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    code = codes[0] if codes[0] != 0 else max(codes, key=abs)
    outcomes = jobdir.read_outcomes(job_dir)
    last = outcomes[-1] if outcomes else None
    what = f"{last.kind}" + (f" ({last.reason})" if last and last.reason else "") if last else "no outcome recorded"
    print(f"hpc run: {what} in {time.monotonic() - started:.1f}s, exit {code}; job dir {job_dir}",
          file=sys.stderr)
    if last and last.kind in ("preempted", "time_limit"):
        print(f"hpc run: to resume from step {last.step}, run the same command with "
              f"--job-dir {job_dir}", file=sys.stderr)
    result = job_dir / jobdir.RESULT
    if result.exists() and code == 0:
        print(f"hpc run: result {result}", file=sys.stderr)
    return code
