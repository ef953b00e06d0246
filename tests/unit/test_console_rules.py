"""The console's rules (pure): which of rank 0's lines it shows, and how a failed rank is
summarised (the script's own last error line, not torch's boilerplate)."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from types import SimpleNamespace as F

import pytest

from runtime.console import DDP_UNUSED_EXPECTED, NOTE, ConsoleFormatter, LineFilter, RankTee
from runtime.ending.outcome import TORCH_NO_ERROR_FILE, failure_reason, last_error_line, root_failure

pytestmark = pytest.mark.unit

SESSION_INFO = "2026-11-25 19:41:32,115 [hpc.session] INFO session: rank 0 of 2, backend gloo"
DDP_NOTE = f"2026-11-25 19:41:32,135 [hpc.session] INFO DDP: {DDP_UNUSED_EXPECTED}, so a resumed run ..."
TORCH_DDP = ("[rank0]:[W1125 19:41:34.165071626 reducer.cpp:1529] Warning: find_unused_parameters=True "
             "was specified in DDP constructor, but did not find any unused parameters")
SAVED = "2026-11-25 19:41:35,730 [hpc.checkpoint] NOTE checkpoint: saved step-000040 (1.9 MB)"
STOPPING = "2026-11-25 19:41:35,730 [hpc.session] WARNING stopping at step 20: SIGUSR2"


def test_quiet_filter_keeps_what_matters() -> None:
    f = LineFilter(verbose=False)
    shown = [f(x) for x in (SESSION_INFO, DDP_NOTE, "train_gpt: preset tiny", TORCH_DDP, SAVED,
                            STOPPING, "[rank0]: Traceback (most recent call last):")]
    assert shown == [None, None, "train_gpt: preset tiny", None,
                     "checkpoint: saved step-000040 (1.9 MB)", "warning: stopping at step 20: SIGUSR2",
                     "Traceback (most recent call last):"]


def test_a_scripts_own_logger_is_not_ours() -> None:
    """Only the hpc.* loggers' lines are ours to hide; a script's logger named hpc_train is not."""
    own = "2026-11-25 19:41:32,115 [hpc_train] INFO epoch 1 done"
    assert LineFilter(verbose=False)(own) == own
    assert last_error_line(f"{own}\n") == own


def test_torch_ddp_warning_kept_when_nobody_explained_it() -> None:
    """A script's own DDP(find_unused_parameters=True) gets torch's advice; only the Session's
    choice, explained in its log, makes the warning expected."""
    assert LineFilter(verbose=False)(TORCH_DDP) == TORCH_DDP.removeprefix("[rank0]:")


def test_verbose_filter_shows_everything_with_one_prefix() -> None:
    f = LineFilter(verbose=True)
    assert f(SESSION_INFO) == SESSION_INFO and f(DDP_NOTE) == DDP_NOTE
    assert f(TORCH_DDP) == TORCH_DDP.removeprefix("[rank0]:")
    assert f("[rank0]: [rank0]: x") == "[rank0]: x"      # only torch's own prefix goes


def test_tee_follows_restarts_and_drains(tmp_path: Path) -> None:
    out = io.StringIO()
    tee = RankTee(out, verbose=False, interval_s=60)      # only explicit drains copy
    first, second = tmp_path / "restart-0.log", tmp_path / "restart-1.log"
    first.write_text(f"{SESSION_INFO}\nstep 1\nno newline yet")
    tee.follow(first)
    tee.drain()
    second.write_text("again\n")
    tee.follow(second)                                   # the first file is finished first
    tee.close()
    assert out.getvalue() == "[rank0]: step 1\n[rank0]: no newline yet\n[rank0]: again\n"


def test_launcher_console_format() -> None:
    fmt = ConsoleFormatter("hpc node 1")
    rec = logging.LogRecord("hpc.launch", NOTE, __file__, 1, "started %s", ("x",), None)
    assert fmt.format(rec) == "hpc node 1: started x"
    rec = logging.LogRecord("hpc.launch", logging.WARNING, __file__, 1, "lost", (), None)
    assert fmt.format(rec) == "hpc node 1: warning: lost"


ARGPARSE_TAIL = """\
usage: train_gpt.py [-h] [--preset {default,small,tiny}]
                    [--activation-checkpointing] [--log-every LOG_EVERY]
train_gpt.py: error: unrecognized arguments: --tp 2
[W1125 19:50:01.000 ProcessGroupGloo.cpp:1] Warning: something unrelated
[hpc worker] SIGTERM: finishing the W&B run so that its data is kept

"""


def test_last_error_line_skips_boilerplate() -> None:
    assert last_error_line(ARGPARSE_TAIL) == "train_gpt.py: error: unrecognized arguments: --tp 2"
    traceback = "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\"\n" \
                "[rank0]: ValueError: bad lr\n2026-11-25 19:41:35,730 [hpc.session] INFO closing\n"
    assert last_error_line(traceback) == "ValueError: bad lr"
    assert last_error_line(f"\n{TORCH_NO_ERROR_FILE}\n") is None


def test_failure_reason_prefers_the_error_file_then_the_output() -> None:
    recorded = F(exitcode=1, message={"message": "RuntimeError: boom", "extraInfo": {}})
    assert failure_reason(0, recorded, ARGPARSE_TAIL) == "rank 0 exited with 1: RuntimeError: boom"
    ended = F(exitcode=-15, message={"message": "RuntimeError: boom", "extraInfo": {}})
    assert failure_reason(0, ended, ARGPARSE_TAIL) == (
        "rank 0 raised RuntimeError: boom (then ended by SIGTERM while exiting, as the agent "
        "stopped the workers)")
    no_file = F(exitcode=2, message=TORCH_NO_ERROR_FILE)
    assert failure_reason(1, no_file, ARGPARSE_TAIL) == \
        "rank 1 exited with 2: train_gpt.py: error: unrecognized arguments: --tp 2"
    said = failure_reason(1, no_file, "")
    assert TORCH_NO_ERROR_FILE not in said and said.startswith("rank 1 exited with 2: (no error message")


def test_root_failure_is_not_a_worker_the_agent_stopped() -> None:
    """One worker exits with 2; torch's agent SIGTERMs the other, whose failure carries the
    same whole-second timestamp: the cause is the one that exited by itself."""
    failures = {0: F(timestamp=100, exitcode=-15, message="Signal 15 (SIGTERM) received by PID 7"),
                1: F(timestamp=100, exitcode=2, message=TORCH_NO_ERROR_FILE)}
    assert root_failure(failures)[0] == 1


def test_started_line_names_world_job_dir_and_wandb_run(tmp_path: Path) -> None:
    from hpc.contract.jobspec import JobSpec
    from runtime.launch.main import plan_launch, started_line

    spec = JobSpec(script=str(tmp_path / "train.py"), job_dir=str(tmp_path), nproc_per_node=4,
                   nodes=(2, 3))
    plan = plan_launch(spec, tmp_path, {}, rdzv_host="127.0.0.1", node_rank=0, run_id="r")
    line = started_line(plan, {**plan.worker_env})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert line == (f"started train.py: world 8-12 (2:3 nodes x 4 processes); job dir {tmp_path}; "
                    f"W&B run {run_id} (offline, in {tmp_path}/wandb)")
    assert "W&B off" in started_line(plan, {"WANDB_MODE": "disabled"})
