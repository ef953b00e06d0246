"""Metrics: one sink protocol, a null sink for non-zero ranks, and a collective reduction.

Why this shape: every rank runs the same training loop, but only rank 0 should talk to W&B.
Scattering `if rank == 0` through user code is how loops end up rank-divergent (and deadlock on
the next collective), so every rank gets a sink from `runtime.worker.wandb_sink.make_sink`: the W&B sink on rank 0, a
`NullSink` elsewhere, and the loop calls it unconditionally.

Reduction is collective: `reduce_metrics` must be called by every rank of the group together. It
packs all values that share an op into one tensor and does one `all_reduce` per op kind (at most
four per call, not one per metric), on a CPU/gloo group so logging never touches the GPU stream.

`BackgroundSink` runs rank 0's sink calls on a thread of their own, in order: a W&B log costs
~1-2 ms of Python and a socket write, and the exactly-once mark a small file write, which at a
10 ms step and a log every 10 steps would otherwise be 2-3 % of the training loop's time.

`StepFilter` is the exactly-once rule for history shared by the sinks: a step is logged only when
it is greater than every step already logged for this job, persisted in the job directory so it
survives requeues (see `runtime.worker.wandb_sink` for why we chose first-write-wins).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from hpc.contract.jobdir import write_atomic
from runtime.liveness import posted

LAST_LOSS = "_last/loss"   # a row's entry for the progress line: the last step's loss, reduced with it

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("hpc.metrics")
ReduceOp = Literal["mean", "sum", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("mean", "sum", "max", "min")


@runtime_checkable
class MetricsSink(Protocol):
    """Where rank-local code sends metrics, events and config. All methods must never raise."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar metrics for a global training step."""

    def event(self, name: str, step: int | None = None, **fields: Any) -> None:
        """Record a lifecycle event (preempted, restarted, node_lost, ...)."""

    def config(self, update: Mapping[str, Any]) -> None:
        """Merge values into the run configuration."""

    def close(self, exit_code: int = 0) -> None:
        """Flush and finish; safe to call twice."""


class NullSink:
    """A sink that does nothing: what every rank but 0 gets."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:  # noqa: D102
        pass

    def event(self, name: str, step: int | None = None, **fields: Any) -> None:  # noqa: D102
        pass

    def config(self, update: Mapping[str, Any]) -> None:  # noqa: D102
        pass

    def close(self, exit_code: int = 0) -> None:  # noqa: D102
        pass


class JsonlSink:
    """Append one JSON object per line to a local file: the fallback when W&B is unavailable.

    Lines look like `{"kind": "log", "step": 3, "time": ..., "metrics": {...}}`; kinds are `log`,
    `event`, `config` and `close`. The file is opened in append mode and flushed per line, so a
    crash loses at most the line being written, and restarts append to the same file.

    Args:
        path: the file to append to; parent directories are created.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        record["time"] = time.time()
        self._file.write(json.dumps(record, default=str, sort_keys=True) + "\n")
        self._file.flush()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Append a `log` line."""
        self._write({"kind": "log", "step": int(step), "metrics": {k: float(v) for k, v in
                                                                      metrics.items()}})

    def event(self, name: str, step: int | None = None, **fields: Any) -> None:
        """Append an `event` line."""
        self._write({"kind": "event", "name": name, "step": step, "fields": fields})

    def config(self, update: Mapping[str, Any]) -> None:
        """Append a `config` line."""
        self._write({"kind": "config", "config": dict(update)})

    def close(self, exit_code: int = 0) -> None:
        """Append a `close` line and close the file."""
        if self._file is not None:
            self._write({"kind": "close", "exit_code": exit_code})
            self._file.close()
            self._file = None


class BackgroundSink:
    """Hands another sink's calls to a thread that makes them in the order they were given.

    ``log``, ``event`` and ``config`` return at once (their arguments are copied); ``close``
    waits for everything queued, then closes the wrapped sink (on the calling thread, which
    also serves exit paths after a crash: nothing here waits on another rank). Attributes
    other than the four methods (``run_id``...) are the wrapped sink's.

    Args:
        inner: The sink to drive (rank 0's W&B sink), or a function that makes it: it is then
            made on the thread, first (a ``wandb.init`` of seconds off the caller's path: the
            rank that becomes rank 0 at an in-process re-form goes on training meanwhile), and
            an attribute read waits for it.
    """

    def __init__(self, inner: MetricsSink | Callable[[], MetricsSink]) -> None:
        self._ready = threading.Event()
        self._make = inner if callable(inner) and not hasattr(inner, "log") else None
        self.inner: MetricsSink = NullSink() if self._make is not None else inner  # type: ignore[assignment]
        if self._make is None:
            self._ready.set()
        self._calls: queue.SimpleQueue[tuple[str, tuple[Any, ...], dict[str, Any]] | None] = \
            queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hpc-metrics-sink", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_ready", "_make", "inner"):
            raise AttributeError(name)
        self._ready.wait()
        return getattr(self.inner, name)

    def log(self, metrics: Mapping[str, float], step: int) -> None:  # noqa: D102
        self._put("log", dict(metrics), step)

    def event(self, name: str, step: int | None = None, **fields: Any) -> None:  # noqa: D102
        self._put("event", name, step, **fields)

    def config(self, update: Mapping[str, Any]) -> None:  # noqa: D102
        self._put("config", dict(update))

    def flush(self) -> None:
        """Returns when every call made so far has been made on the wrapped sink."""
        if self._closed:
            return
        done = threading.Event()
        self._put("_set", done)
        done.wait()

    def close(self, exit_code: int = 0) -> None:
        """Makes the queued calls, stops the thread, closes the wrapped sink; safe twice."""
        if self._closed:
            return
        self._closed = True
        self._calls.put(None)
        self._thread.join()
        self.inner.close(exit_code)

    def _put(self, method: str, *args: Any, **kwargs: Any) -> None:
        if not self._closed:
            self._calls.put((method, args, kwargs))

    def _run(self) -> None:
        if self._make is not None:
            try:
                self.inner = self._make()
            except Exception as e:  # noqa: BLE001 - metrics must never stop training
                log.warning("metrics sink could not be made (%r): this process logs nothing", e)
            self._ready.set()
        while (call := self._calls.get()) is not None:
            method, args, kwargs = call
            try:
                if method == "_set":
                    args[0].set()
                else:
                    getattr(self.inner, method)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - sinks must never raise; if one does, go on
                log.warning("metrics sink %s failed: %r", method, e)


class StepFilter:
    """Admit each step once per job: only steps above the highest step ever admitted.

    The high-water mark is persisted (atomically, after each admitted step) in a small JSON file
    keyed by run id, so a requeued or restarted job that resumes from an older checkpoint does
    not log the re-done steps a second time.

    Args:
        state_path: the JSON file (`JOB_DIR/wandb_state.json`), or None to keep it in memory.
        run_id: the run the mark belongs to; a file written for another run id is ignored.
    """

    def __init__(self, state_path: Path | None, run_id: str) -> None:
        self.state_path = state_path
        self.run_id = run_id
        self.last_step: int | None = None
        if state_path is not None and state_path.exists():
            try:
                state = json.loads(state_path.read_text())
            except (OSError, ValueError):
                state = {}
            if state.get("run_id") == run_id and isinstance(state.get("last_step"), int):
                self.last_step = state["last_step"]

    def admits(self, step: int) -> bool:
        """Whether `step` has not been logged yet (is above the high-water mark)."""
        return self.last_step is None or step > self.last_step

    def mark(self, step: int) -> None:
        """Record `step` as logged and persist it."""
        assert self.admits(step), f"step {step} <= last logged {self.last_step}"
        self.last_step = step
        if self.state_path is not None:
            # no fsync: this runs every logged step; a crash loses at most the last mark
            write_atomic(self.state_path,
                         json.dumps({"run_id": self.run_id, "last_step": step}) + "\n", durable=False)


def reduce_metrics(
    values: Mapping[str, float | torch.Tensor],
    ops: Mapping[str, ReduceOp],
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Reduce scalar metrics across the ranks of `group`; every rank must call it together.

    Values that share an op are packed into one float64 tensor and reduced with a single
    `all_reduce`, so a call costs at most one collective per op kind. Keys must be the same on all
    ranks (they are sorted, so their order need not be). Without an initialized process group the
    values are returned as floats unchanged (single-process runs).

    Args:
        values: metric name to a Python number or a one-element tensor (any device).
        ops: metric name to "mean", "sum", "max" or "min"; names missing here default to "mean".
        group: a CPU-capable (gloo) group; None means the default group, which must then be gloo.

    Returns:
        metric name to the reduced Python float, identical on every rank.

    Raises:
        ValueError: an op is not one of mean/sum/max/min, or an op names an unknown metric.
    """
    return start_reduce(values, ops, group).result()


class PendingReduction:
    """Metrics whose all-reduces are posted; :meth:`result` waits for them (see
    :func:`start_reduce`)."""

    def __init__(self, done: dict[str, float], posted: list[tuple[str, list[str], Any, Any]],
                 world: int) -> None:
        self._done, self._posted, self._world = done, posted, world

    @property
    def works(self) -> list[Any]:
        """The posted collectives (in-process recovery waits for them in a way it can leave)."""
        return [work for _, _, _, work in self._posted]

    def result(self) -> dict[str, float]:
        """The reduced metrics, identical on every rank (waits for the posted collectives)."""
        out = dict(self._done)
        for op, names, packed, work in self._posted:
            posted.wait(work)
            if op == "mean":
                packed /= self._world
            out.update(zip(names, packed.tolist()))
        self._posted = []
        self._done = out
        return out


def start_reduce(
    values: Mapping[str, float | torch.Tensor],
    ops: Mapping[str, ReduceOp],
    group: dist.ProcessGroup | None = None,
) -> PendingReduction:
    """As :func:`reduce_metrics`, without waiting: posts the all-reduces (``async_op``) and
    returns at once, so the training loop does not wait for a metric row. Every rank must
    call it at the same point of its sequence of collectives; the result can be taken later
    (the Session takes it at the next step)."""
    bad = {k: v for k, v in ops.items() if v not in REDUCE_OPS}
    if bad:
        raise ValueError(f"unknown reduce op(s) {bad}; valid ops: {', '.join(REDUCE_OPS)}")
    unknown = sorted(set(ops) - set(values))
    if unknown:
        raise ValueError(f"ops given for metrics that are not in values: {unknown}")
    scalars = {k: _to_float(v) for k, v in values.items()}

    import torch.distributed as dist

    # A world of one has nothing to reduce. It must post nothing either: its default group may
    # be NCCL alone (one GPU), which has no backend for these CPU tensors (found on an H200).
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return PendingReduction(scalars, [], 1)
    import torch

    by_op: dict[str, list[str]] = {}
    for name in sorted(scalars):
        by_op.setdefault(ops.get(name, "mean"), []).append(name)
    torch_op = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
                "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    posted = []
    for op in REDUCE_OPS:  # the same fixed order on every rank
        names = by_op.get(op)
        if not names:
            continue
        packed = torch.tensor([scalars[n] for n in names], dtype=torch.float64)
        posted.append((op, names, packed, dist.all_reduce(packed, op=torch_op[op], group=group,
                                                          async_op=True)))
    return PendingReduction({}, posted, dist.get_world_size(group))


def _to_float(value: float | torch.Tensor) -> float:
    if hasattr(value, "detach"):
        if value.numel() != 1:  # type: ignore[union-attr]
            raise ValueError(f"metric tensors must hold one element, got shape {tuple(value.shape)}")
        return float(value.detach().cpu().item())  # type: ignore[union-attr]
    return float(value)
