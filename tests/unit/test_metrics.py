"""Sinks and the exactly-once step rule, without processes or network.

The W&B-backed paths that need real offline runs and two ranks are in
tests/distributed/test_wandb.py; here W&B is either disabled (JSONL only) or made to fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.worker.metrics import JsonlSink, MetricsSink, NullSink, StepFilter, reduce_metrics, start_reduce
from hpc.contract.components import WandbConfig
from runtime.worker.wandb_sink import make_sink
from runtime.worker.wandb_sink import (
    FALLBACK_FILE,
    RUN_ID_FILE,
    STATE_FILE,
    WandbSettings,
    WandbSink,
    load_or_create_run_id,
)
from tests.wandb_offline import offline_env

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_null_sink_is_a_sink_and_does_nothing() -> None:
    sink = NullSink()
    assert isinstance(sink, MetricsSink)
    sink.log({"loss": 1.0}, 1)
    sink.event("preempted", 3, signal="USR2")
    sink.config({"a": 1})
    sink.close()
    sink.close(1)


def test_make_sink_gives_null_sink_off_rank_zero(tmp_path: Path) -> None:
    assert isinstance(make_sink(1, job_dir=tmp_path), NullSink)
    assert isinstance(make_sink(7, job_dir=tmp_path, config=WandbConfig(mode="online")), NullSink)
    assert not (tmp_path / RUN_ID_FILE).exists()  # non-zero ranks touch nothing


def test_jsonl_sink_appends_one_json_per_line_across_instances(hostile_dir: Path) -> None:
    path = hostile_dir / "sub" / "m.jsonl"
    sink = JsonlSink(path)
    assert isinstance(sink, MetricsSink)
    sink.config({"slurm/job_id": "42"})
    sink.log({"loss": 2}, 1)
    sink.event("preempted", 1, signal="USR2")
    sink.close(0)
    sink.close(0)
    sink.log({"loss": 3}, 2)  # after close: ignored, no crash
    JsonlSink(path).log({"loss": 1.5}, 2)
    lines = read_jsonl(path)
    assert [r["kind"] for r in lines] == ["config", "log", "event", "close", "log"]
    assert lines[1]["metrics"] == {"loss": 2.0} and lines[1]["step"] == 1
    assert lines[2]["fields"] == {"signal": "USR2"}
    assert lines[4]["step"] == 2


def test_step_filter_admits_each_step_once_and_persists(tmp_path: Path) -> None:
    state = tmp_path / STATE_FILE
    f = StepFilter(state, "run1")
    assert f.last_step is None and f.admits(0)
    for step in (1, 2, 5):
        assert f.admits(step)
        f.mark(step)
    assert not f.admits(5) and not f.admits(3) and f.admits(6)
    again = StepFilter(state, "run1")  # a requeued process
    assert again.last_step == 5 and not again.admits(4)
    assert StepFilter(state, "other-run").last_step is None  # state of another run is ignored
    state.write_text("{not json")
    assert StepFilter(state, "run1").last_step is None
    with pytest.raises(AssertionError):
        f.mark(5)


def test_run_id_is_created_once_and_reused(hostile_dir: Path) -> None:
    first = load_or_create_run_id(hostile_dir)
    assert len(first) == 8 and first.isalnum()
    assert load_or_create_run_id(hostile_dir) == first
    assert load_or_create_run_id(hostile_dir, preferred="zzz") == first
    assert (hostile_dir / RUN_ID_FILE).read_text().strip() == first
    assert load_or_create_run_id(hostile_dir / "new", preferred="fromckpt") == "fromckpt"
    assert not [p for p in hostile_dir.iterdir() if p.name.endswith(".tmp")]


def test_disabled_mode_dedups_steps_across_restarts(tmp_path: Path) -> None:
    settings = WandbSettings(mode="disabled")
    sink = WandbSink(tmp_path, settings, metadata={"slurm/job_id": "42"})
    for step in range(1, 8):
        sink.log({"loss": float(step)}, step)
    sink.close()
    # Crash after step 7, checkpoint at 4: steps 5..7 are redone and must not be logged again.
    sink = WandbSink(tmp_path, settings, resume_step=4)
    for step in range(5, 11):
        sink.log({"loss": 100.0 + step}, step)
    sink.event("preempted", 10, signal="USR2")
    sink.close()
    assert sink.dropped_steps == 3 and sink.last_logged_step == 10
    lines = read_jsonl(tmp_path / FALLBACK_FILE)
    steps = [r["step"] for r in lines if r["kind"] == "log"]
    assert steps == list(range(1, 11))
    by_step = {r["step"]: r["metrics"]["loss"] for r in lines if r["kind"] == "log"}
    assert by_step[7] == 7.0 and by_step[8] == 108.0  # first write wins
    events = [(r["name"], r["fields"]) for r in lines if r["kind"] == "event"]
    assert ("resumed", {"resume_step": 4, "last_logged_step": 7}) in events
    assert ("preempted", {"signal": "USR2"}) in events


def test_wandb_init_failure_falls_back_to_jsonl_and_training_continues(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    import wandb

    calls = []

    def broken_init(*args: object, **kwargs: object) -> None:
        calls.append(kwargs)
        raise RuntimeError("wandb service died")

    monkeypatch.setattr(wandb, "init", broken_init)
    job = tmp_path / "job"
    with pytest.warns(RuntimeWarning, match="W&B init failed"):
        sink = make_sink(0, job_dir=job, metadata={"slurm/job_id": "42"},
                         init_timeout_s=2)
    assert len(calls) == 2  # retried once, then gave up
    assert calls[0]["resume"] == "allow" and calls[0]["mode"] == "offline"
    assert calls[0]["settings"].init_timeout == 2
    assert sink.using_fallback
    for step in range(1, 4):
        sink.log({"loss": 1.0 / step}, step)
    sink.close()
    lines = read_jsonl(job / FALLBACK_FILE)
    assert [r["step"] for r in lines if r["kind"] == "log"] == [1, 2, 3]
    assert any(r["kind"] == "event" and r["name"] == "wandb_failed" for r in lines)
    assert any(r["kind"] == "config" and r["config"] == {"slurm/job_id": "42"} for r in lines)


def test_wandb_settings_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="offline, online, disabled"):
        WandbSettings(mode="cloud")
    with pytest.raises(ValueError, match="init_timeout_s"):
        WandbSettings(init_timeout_s=0)


def test_reduce_without_process_group_returns_local_floats() -> None:
    out = reduce_metrics({"loss": torch.tensor(2.5), "tokens": 10}, {"tokens": "sum"})
    assert out == {"loss": 2.5, "tokens": 10.0}
    assert all(type(v) is float for v in out.values())


def test_reduce_in_a_world_of_one_posts_no_collective() -> None:
    """A one-GPU job's default group is NCCL alone, with no backend for the CPU tensors the
    metrics pack ("No backend type associated with device type cpu" on an H200, where every
    logged row killed the worker): a world of one reduces nothing and must post nothing."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pending = start_reduce({"loss": 2.5, "tokens": 10}, {"tokens": "sum"})
        assert pending.works == []
        assert pending.result() == {"loss": 2.5, "tokens": 10.0}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("values", "ops", "match"), [
    ({"a": 1.0}, {"a": "avg"}, "unknown reduce op"),
    ({"a": 1.0}, {"b": "sum"}, "not in values"),
    ({"a": torch.ones(2)}, {}, "one element"),
])
def test_reduce_rejects_bad_input(values: dict, ops: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        reduce_metrics(values, ops)


def test_importing_the_metrics_modules_imports_neither_wandb_nor_torch() -> None:
    code = ("import sys, runtime.worker.metrics, runtime.worker.wandb_sink, runtime.worker.progress; "
            "print(sorted(m for m in ('wandb', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("spec_mode", "env", "expected"), [
    (None, {}, "offline"),
    (None, {"WANDB_MODE": "disabled"}, "disabled"),
    (None, {"WANDB_MODE": "dryrun"}, "offline"),        # wandb's legacy spellings
    (None, {"WANDB_MODE": "run"}, "online"),
    ("online", {"WANDB_MODE": "disabled"}, "online"),   # the job spec is the user's explicit choice
])
def test_session_wandb_mode_honours_the_spec_then_wandb_mode(spec_mode: str | None, env: dict,
                                                               expected: str) -> None:
    from hpc.contract.jobspec import JobSpec
    from runtime.session import wandb_mode

    spec = JobSpec(script="s", wandb_mode=spec_mode) if spec_mode else None
    assert wandb_mode(spec, env) == expected


def test_session_wandb_mode_passes_an_unknown_value_on_to_be_rejected_by_name() -> None:
    from runtime.session import wandb_mode

    with pytest.raises(ValueError, match="'cloud' is not one of offline, online, disabled"):
        WandbSettings(mode=wandb_mode(None, {"WANDB_MODE": "cloud"}))


class _Recording:
    """A sink that records its calls (pure logic: what BackgroundSink hands it, and in what order)."""

    def __init__(self, fail_on: str = "") -> None:
        self.calls: list[tuple] = []
        self.fail_on = fail_on
        self.run_id = "abc123"

    def log(self, metrics, step):
        if self.fail_on == "log" and step == 2:
            raise RuntimeError("boom")
        self.calls.append(("log", dict(metrics), step))

    def event(self, name, step=None, **fields):
        self.calls.append(("event", name, step, fields))

    def config(self, update):
        self.calls.append(("config", dict(update)))

    def close(self, exit_code=0):
        self.calls.append(("close", exit_code))


def test_background_sink_keeps_the_order_and_drains_on_close():
    from runtime.worker.metrics import BackgroundSink

    inner = _Recording()
    sink = BackgroundSink(inner)
    row = {"loss": 1.5}
    for step in range(1, 101):
        sink.log(row, step=step)
        if step == 50:
            sink.event("preempted", step=50, signal="SIGUSR2")
    row["loss"] = 9.0                       # the caller's dict is copied when queued
    sink.config({"goodput/ratio": 0.9})
    assert sink.run_id == "abc123"          # attributes are the wrapped sink's
    sink.close(exit_code=1)
    sink.close()                            # safe twice
    sink.log({"loss": 0.0}, step=101)       # after close: ignored
    logs = [c for c in inner.calls if c[0] == "log"]
    assert [c[2] for c in logs] == list(range(1, 101))
    assert all(c[1] == {"loss": 1.5} for c in logs)
    assert inner.calls.index(("event", "preempted", 50, {"signal": "SIGUSR2"})) == 50
    assert inner.calls[-2:] == [("config", {"goodput/ratio": 0.9}), ("close", 1)]


def test_background_sink_goes_on_after_a_failing_call_and_flush_waits():
    from runtime.worker.metrics import BackgroundSink

    inner = _Recording(fail_on="log")
    sink = BackgroundSink(inner)
    for step in (1, 2, 3):
        sink.log({"loss": float(step)}, step=step)
    sink.flush()
    assert [c[2] for c in inner.calls if c[0] == "log"] == [1, 3]
    sink.close()


def test_background_sink_made_on_its_thread_takes_calls_at_once_and_keeps_them():
    """The rank that becomes rank 0 at an in-process re-form opens the W&B run on the sink's
    thread: calls made meanwhile wait in the queue, an attribute read waits for the sink."""
    import threading

    from runtime.worker.metrics import BackgroundSink

    gate, made_on = threading.Event(), []
    inner = _Recording()

    def make():
        made_on.append(threading.current_thread().name)
        gate.wait(10)            # a slow wandb.init
        return inner

    sink = BackgroundSink(make)
    sink.log({"loss": 1.0}, step=7)          # returns although the sink is not made yet
    sink.event("resumed", step=None, resume_step=6)
    assert inner.calls == []
    gate.set()
    assert sink.run_id == "abc123"          # waits for the made sink
    sink.close()
    assert made_on == ["hpc-metrics-sink"]
    assert [c[0] for c in inner.calls] == ["log", "event", "close"] and inner.calls[0][2] == 7


def test_background_sink_whose_making_fails_logs_nothing_and_closes():
    from runtime.worker.metrics import BackgroundSink

    def make():
        raise RuntimeError("no W&B here")

    sink = BackgroundSink(make)
    sink.log({"loss": 1.0}, step=1)
    sink.flush()
    sink.close()
