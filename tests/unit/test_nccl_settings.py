"""NCCL's watchdog and flight recorder settings: GPU jobs only, coherent with the stall watch,
never over a user's value, logged as every other environment change. (No GPU here: the
decisions are tested; whether NCCL honours them is for the gpu tier on a GPU machine.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc.contract.jobspec import JobSpec
from runtime.launch.main import plan_launch
from runtime.liveness.nccl_watch import request_dumps

pytestmark = pytest.mark.unit


def changes(tmp_path: Path, env: dict[str, str], **spec: object) -> dict[str, object]:
    plan = plan_launch(JobSpec(script="train.py", **spec), tmp_path, env, rdzv_host="127.0.0.1",
                       node_rank=0, run_id="r")
    return {c.name: c for c in plan.env_changes if c.name.startswith("TORCH_NCCL_")} | \
        {"_worker": plan.worker_env}


def test_gpu_job_gets_the_flight_recorder_and_a_backstop_heartbeat(tmp_path: Path):
    got = changes(tmp_path, {}, gpus_per_node=8)
    assert got["TORCH_NCCL_ASYNC_ERROR_HANDLING"].new == "3"
    assert got["TORCH_NCCL_DUMP_ON_TIMEOUT"].new == "1"
    assert int(got["TORCH_NCCL_TRACE_BUFFER_SIZE"].new) > 0
    assert got["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].new == str(tmp_path / "logs" / "alloc-0" / "nccl-trace-rank-")
    assert got["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"].new == "1860"   # the collective timeout
    assert got["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"].new.endswith(f"hpc-liveness-{os.getuid()}-{os.getpid()}/nccl-rank-")
    assert got["_worker"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: (unset) -> '1860'" in got["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"].describe()


def test_cpu_job_sets_no_nccl_variable(tmp_path: Path):
    assert set(changes(tmp_path, {})) == {"_worker"}


def test_user_values_are_kept_and_logged_as_kept(tmp_path: Path):
    got = changes(tmp_path, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, gpus_per_node=4)
    c = got["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert c.kept_user_value and "kept (set by the user" in c.describe()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in got["_worker"]   # the inherited value stands


def test_fixed_stall_timeout_and_off(tmp_path: Path):
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" in changes(tmp_path, {}, gpus_per_node=1, stall_timeout="60")
    off = changes(tmp_path, {}, gpus_per_node=1, stall_timeout="off")
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" not in off and "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" not in off
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" in off   # NCCL's own timeout still dumps


def test_stall_watch_asks_each_listening_rank_for_a_dump(tmp_path: Path):
    live, gone = tmp_path / "nccl-rank-0.pipe", tmp_path / "nccl-rank-1.pipe"
    os.mkfifo(live)
    os.mkfifo(gone)                                    # rank 1 has no reader: skipped
    reader = os.open(live, os.O_RDONLY | os.O_NONBLOCK)   # what torch's rank 0 holds open
    try:
        assert request_dumps(tmp_path) == 1
        assert os.read(reader, 16).strip() == b"1"
    finally:
        os.close(reader)


def test_in_process_recovery_sets_its_nccl_values_before_torchs_agent_does(tmp_path: Path):
    """torch's elastic agent gives each worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless the agent's
    own environment has a value; on an H200 the in-process recovery then read torch's 1 as the
    user's, kept it and warned. The launcher sets the recovery's values itself, GPU count or not."""
    for gpus in (0, 4):
        got = changes(tmp_path, {}, gpus_per_node=gpus, recovery="inprocess")
        assert got["TORCH_NCCL_ASYNC_ERROR_HANDLING"].new == "0", gpus   # not 3: the recovery aborts
        assert got["_worker"]["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0" and got["_worker"]["NCCL_NVLS_ENABLE"] == "0"
        assert "in-process recovery" in got["TORCH_NCCL_ASYNC_ERROR_HANDLING"].reason
    assert changes(tmp_path, {}, gpus_per_node=4, recovery="inprocess")["TORCH_NCCL_DUMP_ON_TIMEOUT"].new == "1"
    kept = changes(tmp_path, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, gpus_per_node=4, recovery="inprocess")
    assert kept["TORCH_NCCL_ASYNC_ERROR_HANDLING"].kept_user_value   # a user's value stands (2 works)
