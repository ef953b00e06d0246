"""The job's node-local files and the warm processes' orders (torch-free).

A warm process (a fork of the node's fork server, a warm standby) becomes a worker by taking on
an :class:`Order`: the command, environment, directory and log files a cold start would get.
``/proc`` shows the warm process's own command line and environment, so the order is kept in
:func:`order_file` for the readers of a worker's launch. Such a file holds the worker's
environment less its secret values (:func:`secret`: a W&B key, a token; a launcher that
needs them takes its own, :func:`with_secrets`), in the user's own 0700 directory,
:func:`private_dir`.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass


STANDBY_MODULE = "runtime.inprocess.worker.standby"   # a warm standby's ``python -m`` module (its command line)
FORK_MODULE = "runtime.worker.forkserver"   # the node's fork server's (its forked workers show it too)
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


def secret(name: str) -> bool:
    """Whether an environment variable's value is kept out of node-local files (its name says
    key, token, secret, password, credential or auth: ``WANDB_API_KEY``, ``HF_TOKEN``)."""
    return bool(_SECRET.search(name))


def with_secrets(env: Mapping[str, str], own: Mapping[str, str]) -> dict[str, str]:
    """``env`` (a worker's, read from its order file) with the secret variables of ``own`` (the
    reading launcher's environment, which its workers inherit) put back."""
    return {**{k: v for k, v in own.items() if secret(k)}, **env}


@dataclass(frozen=True)
class Order:
    """What makes a warm standby (:data:`STANDBY_MODULE`) the worker a cold start would be.

    A standby is a process the launcher started ahead of need, with python, torch and the
    Session already imported; when a worker dies, the launcher writes its joiner's order to
    the standby's stdin (one JSON line) instead of starting a process. The launcher also keeps
    it in the node-local file :func:`order_file`, because ``/proc`` shows the standby's own
    command line and environment: readers of a worker's launch there (the stall watch's
    worker list, a launcher adopting its workers after its host's loss) read the order instead.

    Attributes:
        argv: The worker's whole command line (``python -m runtime.worker SCRIPT ARGS...``).
        env: Its whole environment.
        cwd: Its working directory.
        stdout: The file its output goes to ("" keeps the standby's own).
        stderr: The file its errors go to ("" keeps the standby's own).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    stdout: str = ""
    stderr: str = ""

    def encode(self) -> str:
        """The whole order (for the warm process itself, over its pipe or socket)."""
        return json.dumps({**asdict(self), "env": dict(self.env)}, sort_keys=True)

    def record(self) -> str:
        """The order for :func:`order_file`: its secret values left out (:func:`secret`)."""
        return json.dumps({**asdict(self), "env": {k: v for k, v in self.env.items() if not secret(k)}},
                          sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Order:
        d = json.loads(raw)
        return cls(argv=tuple(str(a) for a in d["argv"]), env={str(k): str(v) for k, v in d["env"].items()},
                   cwd=str(d["cwd"]), stdout=str(d.get("stdout") or ""), stderr=str(d.get("stderr") or ""))


def order_file(pid: int) -> str:
    """Where standby ``pid``'s :class:`Order` is kept once it became a worker: node-local and
    memory-backed (``/dev/shm``, else the temporary directory), outside the launcher's heartbeat
    directory (removed when its agent ends, while a worker kept through a host's loss lives on).

    The record (:meth:`Order.record`) holds the worker's environment less its secret values: it
    lies in the user's own directory there (:func:`private_dir`), written 0600
    (:func:`hpc.contract.jobdir.write_atomic`)."""
    return os.path.join(private_dir(), f"standby-{pid}.json")


def private_dir() -> str:
    """``hpc-<uid>`` in ``/dev/shm`` (else the temporary directory): 0700, owned by this user.

    One that another user made first (to read or plant files), or that is open to others, is
    not used: then the temporary directory's, under the same rules.

    Raises:
        OSError: neither place gives such a directory.
    """
    shm = "/dev/shm"
    roots = ([shm] if os.path.isdir(shm) and os.access(shm, os.W_OK) else []) + [tempfile.gettempdir()]
    problems = []
    for root in roots:
        path = os.path.join(root, f"hpc-{os.getuid()}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            problems.append(f"{path}: {e.strerror or e}")
            continue
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return path
        problems.append(f"{path}: not a directory of this user's alone (mode {st.st_mode & 0o7777:o}, "
                        f"owner {st.st_uid})")
    raise OSError(f"no private directory for the job's node-local files: {'; '.join(problems)}")
