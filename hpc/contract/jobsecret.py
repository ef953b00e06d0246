"""The job's secret: the key that tells a message from one of the job's own processes.

The store host's lifelines listener (:mod:`runtime.inprocess.launcher.lifelines`) acts on what
a connection says: a worker's line that closes without ``bye`` is announced dead and the
survivors re-form. Anyone who can reach the port (another user of a shared node, any host of
the cluster network) could otherwise say so too. So every such message is signed with a key
that only the job's own user can read: 32 random bytes in the job directory, created once at
submission (or by the first launcher that finds none), mode 0600. The launchers and workers of
every allocation read the same file; a message without a valid signature is refused.

The key is written whole before it has its name (a private temporary file, then a hard link,
which fails when the name exists), so a reader never sees a partial key and two creators agree
on one. A key file that others may read, or that another user owns, is refused: its key signs
nothing.

Pure apart from the key file itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

KEY_BYTES = 32


class JobSecretError(RuntimeError):
    """The key file is unusable (others may read it, another user owns it, it is malformed)."""


def _check(path: Path) -> bytes:
    st = path.stat()
    if st.st_uid != os.getuid():
        raise JobSecretError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}): "
                             "its key signs nothing; remove it, a new one is made at the next start")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise JobSecretError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; the job's key must be "
                             f"readable by its user only (chmod 600 {path})")
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise JobSecretError(f"{path} holds no key ({KEY_BYTES} bytes in hex expected); "
                             "remove it, a new one is made at the next start")
    return key


def ensure(path: str | Path) -> bytes:
    """The job's key at ``path``, created (0600, whole or absent) when there is none yet."""
    path = Path(path)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(KEY_BYTES) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass   # another process made it first: its key is the job's
        finally:
            tmp.unlink(missing_ok=True)
    return _check(path)


def load(path: str | Path) -> bytes:
    """The job's key at ``path`` (:class:`JobSecretError` or ``OSError`` when unusable)."""
    return _check(Path(path))


def sign(key: bytes, message: bytes) -> str:
    """The signature of ``message`` under ``key`` (HMAC-SHA256, hex)."""
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def valid(key: bytes, message: bytes, signature: str) -> bool:
    """Whether ``signature`` is ``message``'s under ``key`` (in constant time)."""
    return hmac.compare_digest(sign(key, message), str(signature))
