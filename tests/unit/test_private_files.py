"""The node-local files of a job (a warm standby's order holds the worker's whole environment,
a W&B key among it) are this user's alone: 0600 in a 0700 directory of their own; a directory
another user made first is not used."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from runtime import node_files
from runtime.inprocess import protocol as proto
from hpc.contract import jobdir

pytestmark = pytest.mark.unit
NOBODY = 65534


def test_an_order_is_written_0600_in_a_0700_directory_and_another_user_cannot_read_it() -> None:
    path = node_files.order_file(999_999_999)
    jobdir.write_atomic(Path(path), '{"env": {"WANDB_API_KEY": "k" }}', durable=False)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        folder = os.stat(os.path.dirname(path))
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
        assert os.getuid() == 0, "reading as another user needs root (scripts/test.sh runs as root)"
        r = subprocess.run(["cat", path], capture_output=True, text=True, user=NOBODY)
        assert r.returncode != 0 and "Permission denied" in r.stderr, r
    finally:
        os.unlink(path)


def test_a_directory_another_user_made_first_is_not_used(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert os.getuid() == 0, "planting another user's directory needs root (scripts/test.sh runs as root)"
    fake = 424_242                                   # "this user", for the test
    monkeypatch.setattr(os, "getuid", lambda: fake)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = [Path("/dev/shm") / f"hpc-{fake}", tmp_path / f"hpc-{fake}"]
    for d in planted:
        d.mkdir(mode=0o777, exist_ok=True)
        os.chown(d, NOBODY, NOBODY)
    try:
        with pytest.raises(OSError, match="not a directory of this user's alone"):
            node_files.private_dir()
        os.chown(planted[1], fake, fake)              # ours, but open to others
        os.chmod(planted[1], 0o755)
        with pytest.raises(OSError, match="mode 755"):
            node_files.private_dir()
        os.chmod(planted[1], 0o700)
        assert node_files.private_dir() == str(planted[1])
    finally:
        planted[0].rmdir()


def test_the_channel_file_for_kept_workers_is_private_too() -> None:
    from runtime.inprocess.launcher import adopt as inprocess_adopt

    path = inprocess_adopt.publish(999_999_998, proto.Rebind(1, "127.0.0.1:1", "s", ("a",)))
    try:
        assert path.parent == Path(node_files.private_dir()) and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert proto.Rebind.decode(path.read_text()).epoch == 1
    finally:
        path.unlink()


def test_records_of_ended_processes_are_removed_and_live_ones_kept() -> None:
    """A worker killed with SIGKILL leaves its order (its environment) in the private directory:
    the next launcher removes it, and the orders of live standbys and forked workers stay."""
    import subprocess
    import sys

    import time

    from runtime.liveness.proc import forget_stale_orders

    root = Path(node_files.private_dir())
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", node_files.FORK_MODULE])
    files: dict[str, Path] = {}
    try:
        while node_files.FORK_MODULE not in Path(f"/proc/{live.pid}/cmdline").read_bytes().decode():
            time.sleep(0.01)   # until it runs its own command line (before its exec: ours)
        files = {name: root / name for name in (f"standby-{ended.pid}.json", f"standby-{os.getpid()}.json",
                                                f"standby-{live.pid}.json", f"channel-{ended.pid}.json")}
        for path in files.values():
            path.write_text("{}")
        gone = forget_stale_orders()
        assert {f"standby-{ended.pid}.json", f"standby-{os.getpid()}.json", f"channel-{ended.pid}.json"} <= set(gone)
        assert files[f"standby-{live.pid}.json"].exists() and f"standby-{live.pid}.json" not in gone
    finally:
        live.kill()
        live.wait()
        for path in files.values():
            path.unlink(missing_ok=True)


def test_an_order_file_holds_no_secret_and_an_adopting_launcher_puts_its_own_back() -> None:
    """A kept worker's order on file lacks its W&B key and tokens; the launcher that adopts it
    after a host's loss starts a dead one's joiner with its own (the workers' inherited) key."""
    import sys
    import time

    from runtime.inprocess.launcher import adopt
    from runtime.liveness import proc

    env = {"RANK": "3", "LOCAL_RANK": "0", "WANDB_API_KEY": "k" * 40, "HF_TOKEN": "hf_t",
           "MY_DB_PASSWORD": "p", "WANDB_PROJECT": "gpt"}
    order = node_files.Order(argv=(sys.executable, "-m", "runtime.worker", "train.py"), env=env, cwd="/")
    assert node_files.Order.decode(order.record()).env == {"RANK": "3", "LOCAL_RANK": "0",
                                                           "WANDB_PROJECT": "gpt"}
    assert node_files.Order.decode(order.encode()).env == env     # the warm process gets it all
    standby = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", node_files.STANDBY_MODULE])
    path = Path(node_files.order_file(standby.pid))
    try:
        while node_files.STANDBY_MODULE not in Path(f"/proc/{standby.pid}/cmdline").read_bytes().decode():
            time.sleep(0.01)
        jobdir.write_atomic(path, order.record(), durable=False)
        assert "k" * 40 not in path.read_text() and "hf_t" not in path.read_text()
        assert "WANDB_API_KEY" not in proc.environ(standby.pid)
        launch = adopt.launch_of({0: standby.pid}, store="127.0.0.1:1", master_addr="127.0.0.1",
                                 master_port=2, epoch=1)
        joiner = launch["envs"][0]
        assert joiner["RANK"] == "3" and joiner["WANDB_PROJECT"] == "gpt"
        assert {k: joiner.get(k) for k in ("WANDB_API_KEY", "HF_TOKEN")} == \
            {k: os.environ.get(k) for k in ("WANDB_API_KEY", "HF_TOKEN")}   # the launcher's own
    finally:
        standby.kill()
        standby.wait()
        path.unlink(missing_ok=True)
