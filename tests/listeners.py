"""What listens on this machine, read from ``/proc`` (the tests of which address a store binds)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOOPBACK = "0100007F"   # 127.0.0.1 as /proc/net/tcp writes it


def listeners(port: int) -> set[str]:
    """The addresses a socket on this machine listens on at ``port`` (/proc/net/tcp, tcp6; in
    their hex form: ``0100007F`` is 127.0.0.1, ``00000000`` every interface)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:    # 0A: LISTEN
                found.add(address)
    return found


@contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on, for as long as the block runs."""
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        yield taken.getsockname()[1]
    finally:
        taken.close()


def workers_of(job_dir: Path) -> dict[int, dict[str, str]]:
    """The running workers of the job in ``job_dir`` (pid: environment): the processes that run
    ``python -m runtime.worker`` with ``HPC_JOB_DIR`` set to it (a forked or warm worker's
    command and environment are its order's, as the launcher's readers see them:
    :mod:`runtime.liveness.proc`; a worker's own children, such as wandb's, are not workers)."""
    from runtime.liveness import proc

    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            if proc.cmdline(pid)[1:3] != ["-m", "runtime.worker"]:
                continue
            env = proc.environ(pid)
            if env.get("HPC_JOB_DIR") == str(job_dir):
                found[pid] = env
    return found
