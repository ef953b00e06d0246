"""The job's key: made once (0600, whole), the same for every process, refused when others may
read it or another user owns it; a signature made with any other key does not verify."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from hpc.contract import jobsecret

pytestmark = pytest.mark.unit


def test_the_key_is_made_once_private_and_read_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / ".hpc-secret"
    key = jobsecret.ensure(path)
    assert len(key) == jobsecret.KEY_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert jobsecret.ensure(path) == key == jobsecret.load(path)
    assert [p.name for p in tmp_path.iterdir()] == [".hpc-secret"]   # no temporary file left


def test_processes_that_make_it_at_once_agree_on_one_key(tmp_path: Path) -> None:
    path, keys = tmp_path / ".hpc-secret", []
    threads = [threading.Thread(target=lambda: keys.append(jobsecret.ensure(path))) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 16 and len(set(keys)) == 1


def test_a_key_others_may_read_is_refused_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / ".hpc-secret"
    jobsecret.ensure(path)
    path.chmod(0o644)
    with pytest.raises(jobsecret.JobSecretError, match=r"mode 0644.*chmod 600"):
        jobsecret.load(path)


@pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")
def test_a_key_another_user_owns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / ".hpc-secret"
    jobsecret.ensure(path)
    os.chown(path, 65534, 65534)   # nobody: a planted key
    with pytest.raises(jobsecret.JobSecretError, match="owned by uid 65534"):
        jobsecret.ensure(path)


@pytest.mark.parametrize("text", ["", "not hex", "ab" * 8])
def test_a_malformed_key_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / ".hpc-secret"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(jobsecret.JobSecretError, match="holds no key"):
        jobsecret.load(path)


def test_only_the_same_key_verifies_a_signature() -> None:
    key, other = bytes(32), bytes([1] * 32)
    sig = jobsecret.sign(key, b"hello")
    assert jobsecret.valid(key, b"hello", sig)
    assert not jobsecret.valid(other, b"hello", sig)
    assert not jobsecret.valid(key, b"hellO", sig)
    assert not jobsecret.valid(key, b"hello", "")
