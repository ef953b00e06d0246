"""The console of ``hpc run``, for real: quiet by default, everything with ``-v``, and a failed
run summarised by the script's own error.

The quick start's console is one line that the job started (world size, job dir, W&B run),
then the script's output; the launcher's environment decisions, the stall watch's budgets and
the Session's set-up notes are in the job directory's logs only (``-v`` shows them). Each of
rank 0's lines carries one ``[rank0]:`` prefix, and a failing worker's traceback is printed
once per start of the workers (wandb's exception hook printed it, then chained to torch's,
which printed it again).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed
TRAIN = REPO / "examples" / "train_gpt.py"
PLAIN = REPO / "examples" / "ddp_plain.py"


def hpc_run(script: Path, job: Path, *args: str, script_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc", "run", str(script), "--nproc-per-node", "2",
                           "--job-dir", str(job), *args, "--", *script_args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def outcomes(job: Path) -> list[dict]:
    return [json.loads(x) for x in (job / "outcomes.jsonl").read_text().splitlines()]


def test_quick_start_console_is_quiet(tmp_path: Path) -> None:
    job = tmp_path / "quick"
    r = subprocess.run([sys.executable, "-m", "hpc", "run", str(TRAIN), "--nproc-per-node", "2",
                        "--job-dir", str(job), "--", "--preset", "tiny"], cwd=REPO,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    # One line before the script's output: that the job started, with world, job dir, W&B run.
    assert lines[0].startswith("hpc: started train_gpt.py: world 2 (1 node x 2 processes); "), lines
    assert f"job dir {job};" in lines[0] and "W&B run " in lines[0] and "offline" in lines[0], lines
    assert lines[1].startswith("[rank0]: train_gpt: preset tiny"), lines
    assert any("step 40/40" in x for x in lines) and any("train_gpt: done" in x for x in lines), lines
    # Nothing else: no INFO lines, no torch chatter, no doubled prefix (was 30 lines, 15 of
    # them INFO before the first training line).
    assert not [x for x in lines if " INFO " in x or "[rank0]: [rank0]:" in x or "[rank0]:[" in x], lines
    assert "find_unused_parameters=True was specified" not in r.stdout
    # started, the script's 2, saves, finished, result; and the progress lines, one per log
    # step at most one a second (docs/session.md), as many as the run's seconds allow
    progress = [x for x in lines if re.search(r"\[rank0\]: step \d+/40 \(", x)]
    assert len(lines) - len(progress) <= 10, lines
    # The logs have everything the console left out.
    node_log = next((job / "logs" / "alloc-0").glob("node-*.log")).read_text()
    assert "env NCCL_SOCKET_IFNAME" in node_log and "stall watch" in node_log
    assert "[hpc.session] INFO session: rank 0 of 2" in (job / "logs/alloc-0/restart-0/rank-0.log").read_text()


def test_verbose_failing_worker_traceback_once_per_start(tmp_path: Path) -> None:
    """-v shows the whole log; rank 0 fails at step 20 on both starts (one restart): two
    tracebacks, not four, each line with one prefix; the summary quotes the exception."""
    job = tmp_path / "fail"
    r = hpc_run(TRAIN, job, "-v", "--max-restarts", "1",
                script_args=("--preset", "tiny", "--fail-at-step", "20"))
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "INFO env NCCL_SOCKET_IFNAME" in r.stderr and "[hpc.session] INFO session: rank 0" in out
    assert out.count("Traceback (most recent call last)") == 2, out
    assert out.count("[rank0]: RuntimeError: injected failure at step 20") == 2, out
    assert "[rank0]: [rank0]:" not in out and "[rank0]:[" not in out, out
    assert "starting the workers again (restart 1 of 1)" in r.stderr, r.stderr
    error = "RuntimeError: injected failure at step 20 (--fail-at-step)"
    # Rank 0 exits with 1, or (CI of 8c3b77e) the agent's SIGTERM, sent once rank 1's broken
    # connection was seen, ends it while it is still exiting: either way rank 0's error is named.
    said = next((s for s in (f"rank 0 exited with 1: {error}", f"rank 0 raised {error} (then ended")
                if s in outcomes(job)[-1]["reason"]), None)
    assert said and said in r.stderr, (outcomes(job)[-1]["reason"], r.stderr)


def test_bad_argument_summary_quotes_the_script(tmp_path: Path) -> None:
    """A script that exits on a bad argument (argparse, status 2, no error file) is summarised
    by its own error line, not by torch's pointer to its documentation."""
    job = tmp_path / "badarg"
    r = hpc_run(PLAIN, job, "--max-restarts", "0", script_args=("--steps", "5", "--tp", "2"))
    assert r.returncode == 1, r.stdout + r.stderr
    reason = outcomes(job)[-1]["reason"]
    assert "exited with 2: ddp_plain.py: error: unrecognized arguments: --tp 2" in reason, reason
    assert "To enable traceback" not in reason + r.stderr + r.stdout
    assert "error: unrecognized arguments: --tp 2)" in r.stderr.splitlines()[-1], r.stderr
