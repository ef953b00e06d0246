"""`hpc sync`: which offline folders, in which order, exactly once, through wandb's real sync.

The orchestration (folders of the job's run, oldest first, the marker that makes a second sync
a no-op, resuming after a failed folder, retries, the credential and network checks) is checked
with a recording runner; the upload itself runs wandb's own `wandb sync` for real against
tests/fake_wandb_server.py (a local stand-in that answers the requests wandb 0.31's sync makes;
not W&B's server) and against a local endpoint that answers 503 to everything.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hpc.contract.errors import HpcError
from tests.conftest import REPO
from tests.distributed.support import key_env, real_sync_env
from tests.wandb_offline import offline_env

pytestmark = pytest.mark.distributed

MAKE_SEGMENTS = """
import sys, wandb
job, run_id = sys.argv[1], sys.argv[2]
for seg, steps in enumerate([(1, 4), (3, 7), (6, 9)]):
    run = wandb.init(id=run_id, resume="allow", dir=job, project="sync-test")
    for s in range(steps[0], steps[1] + 1):
        run.log({"loss": 1.0 / s, "segment": seg}, step=s)
    run.finish()
other = wandb.init(id="otherrun", dir=job, project="sync-test")   # not the job's run
other.finish()
"""


@pytest.fixture(scope="module")
def wandb_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job directory with three offline segments of its run, made by real wandb."""
    root = tmp_path_factory.mktemp("sync")
    job = root / "job's dir"
    job.mkdir()
    (job / "jobspec.json").write_text("{}")
    (job / "wandb_run_id").write_text("syncrun1\n")
    env = dict(os.environ) | offline_env(root / "env")
    r = subprocess.run([sys.executable, "-c", MAKE_SEGMENTS, str(job), "syncrun1"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return job


@pytest.fixture
def job(wandb_job: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "job"
    shutil.copytree(wandb_job, copy)
    return copy


class Recorder:
    def __init__(self, fail_on: int = 0) -> None:
        self.calls: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, cmd: list[str], timeout_s: float) -> None:
        self.calls.append(cmd)
        if self.fail_on and len(self.calls) == self.fail_on:
            raise HpcError("wandb sync failed (exit 1): injected")


@pytest.fixture
def listening() -> str:
    """A local port that accepts connections (the reachability check passes)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_plan_takes_the_jobs_run_oldest_first(job: Path) -> None:
    from hpc import sync

    p = sync.plan(job, settle_s=0)
    names = [f.name for f in p.folders]
    assert len(names) == 3 and all(n.startswith("offline-run-") and "syncrun1" in n for n in names)
    assert names == sorted(names, key=lambda n: (n.split("-")[2], int(n.split("-")[-1]) if n.count("-") > 3 else 0))
    assert p.pending == p.folders and not p.done
    assert sync.plan(job, settle_s=3600).pending == ()      # just written: still settling


def test_sync_uploads_in_order_once_and_a_second_sync_sends_nothing(job: Path, tmp_path: Path,
                                                                     listening: str) -> None:
    from hpc import sync

    rec, lines = Recorder(), []
    n = sync.sync(job, runner=rec, settle_s=0, env=key_env(tmp_path, listening), out=lines.append)
    folders = [f.name for f in sync.plan(job, settle_s=0).folders]
    assert n == 3 and [Path(c[-1]).name for c in rec.calls] == folders
    assert all(c[:4] == [sys.executable, "-m", "wandb", "sync"] and c[c.index("--id") + 1] == "syncrun1"
               for c in rec.calls)
    assert json.loads((job / "wandb_synced.json").read_text()) == {"run_id": "syncrun1",
                                                                   "folders": sorted(folders)}
    again = Recorder()
    assert sync.sync(job, runner=again, settle_s=0, env=key_env(tmp_path, listening),
                     out=lines.append) == 0
    assert again.calls == [] and "nothing to upload" in lines[-1]


def test_a_failed_folder_keeps_the_ones_before_and_the_next_sync_goes_on(job: Path, tmp_path: Path,
                                                                         listening: str) -> None:
    from hpc import sync

    folders = [f.name for f in sync.plan(job, settle_s=0).folders]
    with pytest.raises(HpcError, match="did not upload after 1 attempt.*1 folder\\(s\\) before it"):
        sync.sync(job, runner=Recorder(fail_on=2), attempts=1, settle_s=0,
                  env=key_env(tmp_path, listening), out=lambda s: None)
    assert sync.read_synced(job, "syncrun1") == {folders[0]}
    rec = Recorder()
    assert sync.sync(job, runner=rec, settle_s=0, env=key_env(tmp_path, listening), out=lambda s: None) == 2
    assert [Path(c[-1]).name for c in rec.calls] == folders[1:]


def test_retries_a_transient_failure(job: Path, tmp_path: Path, listening: str) -> None:
    from hpc import sync

    rec = Recorder(fail_on=1)
    assert sync.sync(job, runner=rec, attempts=2, settle_s=0, env=key_env(tmp_path, listening),
                     out=lambda s: None) == 3
    assert len(rec.calls) == 4 and rec.calls[0] == rec.calls[1]


def test_no_api_key_is_a_clear_error_before_anything_runs(job: Path, tmp_path: Path) -> None:
    from hpc import sync

    rec = Recorder()
    with pytest.raises(HpcError, match="no W&B API key for https://api.wandb.ai: run `wandb login`"):
        sync.sync(job, runner=rec, settle_s=0, env={"HOME": str(tmp_path)}, out=lambda s: None)
    assert rec.calls == []
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + "p" * 40 + "\n")
    sync.check_credentials({"HOME": str(tmp_path)})       # `wandb login` puts it there


def test_no_network_is_a_clear_error(job: Path, tmp_path: Path) -> None:
    from hpc import sync

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with pytest.raises(HpcError, match="cannot reach the W&B server .* nothing was uploaded"):
        sync.sync(job, runner=Recorder(), settle_s=0, env=key_env(tmp_path, closed), out=lambda s: None)
    assert not (job / "wandb_synced.json").exists()


class Unavailable(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.waits
@pytest.mark.timeout(180)
def test_real_wandb_sync_against_a_failing_server_ends_in_a_clear_error(job: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb's own `wandb sync` runs for real; the server answers 503 to everything (wandb
    retries it until the attempt's timeout: 8 s each, enough for a usage error to show)."""
    from hpc import sync

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for key, value in (offline_env(tmp_path / "env") | key_env(tmp_path, url)).items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("WANDB_MODE")
        with pytest.raises(HpcError) as e:
            sync.sync(job, attempts=2, timeout_s=8, settle_s=0, out=lambda s: None)
    finally:
        server.shutdown()
    said = str(e.value)
    assert "option" not in said, said                  # wandb ran the sync, not a usage error
    assert "did not upload after 2 attempt(s)" in said and "0 folder(s) before it" in said, said
    assert "wandb sync did not finish in 8 s" in said or "wandb sync failed" in said, said
    assert not (job / "wandb_synced.json").exists()


def test_cli_names_the_job_and_the_error(job: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "hpc", "sync", str(job)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    # The segments were written seconds ago: settling, nothing to upload yet, or no key.
    assert r.returncode in (0, 1), r.stderr
    assert "hpc sync" in r.stdout + r.stderr


# --------------------------------------------------------------------------- through wandb's real sync

SESSION_SEGMENTS = """
import sys
from runtime.worker.wandb_sink import WandbSink
job, first, last, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sink = WandbSink(job, resume_step=int(resume) if resume else None)
for step in range(first, last + 1):
    sink.log({"loss": 1.0 / step}, step)
sink.close()
"""


@pytest.mark.timeout(180)
def test_session_job_of_two_allocations_is_one_run_with_each_step_once_on_the_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our sink's offline segments (a crash at 10, resumed from 6) through wandb's real sync."""
    from hpc import sync
    from tests.fake_wandb_server import FakeWandbServer

    job = tmp_path / "job"
    job.mkdir()
    (job / "jobspec.json").write_text("{}")
    env = dict(os.environ) | offline_env(tmp_path / "env")
    for first, last, resume in ((1, 10, ""), (7, 15, "6")):
        r = subprocess.run([sys.executable, "-c", SESSION_SEGMENTS, str(job), str(first), str(last),
                            resume], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    run_id = (job / "wandb_run_id").read_text().strip()
    with FakeWandbServer() as server:
        real_sync_env(tmp_path, server.url, monkeypatch)
        assert sync.sync(job, settle_s=0, timeout_s=90, out=lambda s: None) == 2
        assert list(server.runs) == [run_id]
        run = server.runs[run_id]
        assert run.steps == list(range(1, 16)), run.steps        # every step once, in order
        assert run.complete and run.upserts >= 2
        before = len(server.requests)
        assert sync.sync(job, settle_s=0, timeout_s=90, out=lambda s: None) == 0
        assert len(server.requests) == before and run.steps == list(range(1, 16))


@pytest.mark.timeout(180)
def test_own_wandb_segments_reach_the_server_in_order_redone_steps_included(
        job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's own wandb.init segments (steps 1-4, 3-7, 6-9): wandb's sync sends them as written."""
    from hpc import sync
    from tests.fake_wandb_server import FakeWandbServer

    with FakeWandbServer() as server:
        real_sync_env(tmp_path, server.url, monkeypatch)
        assert sync.sync(job, settle_s=0, timeout_s=90, out=lambda s: None) == 3
        assert list(server.runs) == ["syncrun1"]
        # wandb 0.31's sync does not drop the redone steps (3, 4 and 6, 7): docs/own-script.md
        assert server.runs["syncrun1"].steps == [1, 2, 3, 4, 3, 4, 5, 6, 7, 6, 7, 8, 9]
        assert sync.sync(job, settle_s=0, timeout_s=90, out=lambda s: None) == 0


def test_follow_syncs_until_the_job_ended(job: Path, tmp_path: Path, listening: str) -> None:
    from hpc import sync
    from hpc.contract import jobdir

    rec, naps = Recorder(), []

    def nap(s: float) -> None:      # the job goes on, then finishes
        naps.append(s)
        kind = "preempted" if len(naps) == 1 else "finished"
        jobdir.append_outcome(job, jobdir.Outcome(allocation=len(naps) - 1, kind=kind, exit_code=0))

    n = sync.follow(job, every_s=7, sleep=nap, runner=rec, settle_s=0,
                    env=key_env(tmp_path, listening), out=lambda s: None)
    assert n == 3 and len(rec.calls) == 3 and naps == [7, 7]
