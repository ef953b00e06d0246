"""The NCCL path's decisions (runtime.inprocess.worker.nccl): the plan per backend, the
environment, and the bound of a training all-reduce.

The plan and the environment are pure. The bound is tested on real gloo operations (two ranks
of one world in two threads of this process), driven through the guard's own DDP hook with
the NCCL-style bound switched on: the bound is backend-agnostic (it queries
``Work.is_completed()``), so a silent peer's all-reduce must fail the step and call the abort
once, and a slow peer's that finishes within the bound must not. The abort of a real NCCL
communicator needs CUDA: tests/gpu/test_gpu_inprocess_nccl.py. The pure tests are marked
``unit``; those on real gloo groups run with the distributed lane (as test_inprocess_sockets).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from runtime.inprocess.worker import nccl  # noqa: E402
from runtime.inprocess.worker.guard import StepGuard  # noqa: E402


@pytest.mark.unit
def test_gloo_keeps_todays_path_and_nccl_aborts_with_a_side_group():
    g = nccl.plan("gloo")
    assert (g.abort_nccl, g.break_sockets, g.op_timeout, g.side_group, g.device_bound) == \
        (False, True, True, False, False)
    n = nccl.plan("nccl")
    # NCCL: abort the communicators, still break the gloo side groups, bound by the thread
    # (NCCL's own timeout ends the process), a gloo side group, the device bound.
    assert (n.abort_nccl, n.break_sockets, n.op_timeout, n.side_group, n.device_bound) == \
        (True, True, False, True, True)


@pytest.mark.unit
def test_the_test_plan_runs_the_nccl_steps_on_gloo_and_nothing_else():
    assert nccl.plan_for("gloo", {}) == nccl.plan("gloo")
    emulated = nccl.plan_for("gloo", {nccl.PLAN_ENV: "nccl"})
    assert emulated.backend == "gloo" and not emulated.device_bound
    assert (emulated.abort_nccl, emulated.op_timeout, emulated.side_group) == (True, False, True)
    assert nccl.plan_for("nccl", {nccl.PLAN_ENV: "nccl"}) == nccl.plan("nccl")
    with pytest.raises(ValueError, match="HPC_TEST_INPROC_PLAN='x'"):
        nccl.plan_for("gloo", {nccl.PLAN_ENV: "x"})


@pytest.mark.unit
def test_an_unknown_backend_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"'mpi'.*gloo, nccl.*--recovery restart"):
        nccl.plan("mpi")


@pytest.mark.unit
def test_the_environment_turns_the_watchdogs_teardown_off_and_keeps_the_users_values():
    changes, warnings = nccl.env_changes({})
    assert {c.name: (c.value, c.old) for c in changes} == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("0", None), "TORCH_NCCL_RETHROW_CUDA_ERRORS": ("0", None),
        "NCCL_NVLS_ENABLE": ("0", None)}
    assert warnings == []
    # CleanUpOnly (2) aborts without ending the process: kept, no warning.
    changes, warnings = nccl.env_changes({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in {c.name for c in changes} and warnings == []
    # Teardown (1) defeats the recovery: kept (never overridden), and said plainly.
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_NVLS_ENABLE": "0"}
    changes, warnings = nccl.env_changes(env)
    assert {c.name for c in changes} == {"TORCH_NCCL_RETHROW_CUDA_ERRORS"}
    [w] = warnings
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in w and "0 or 2" in w and "restart" in w
    assert nccl.apply_env(env) and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"


class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


@pytest.mark.unit
def test_the_bound_reports_each_late_generation_once_and_drops_finished_operations():
    now = [100.0]
    fired: list[tuple[int, float]] = []
    b = nccl.Bound(lambda gen, s: fired.append((gen, s)), clock=lambda: now[0])
    quick, slow, other = _Work(), _Work(), _Work()
    b.watch(quick, 0, 5.0)
    b.watch(slow, 0, 5.0)
    b.watch(other, 0, 9.0)
    quick.done = True
    assert b.check() == [] and b.pending() == 2      # the finished one is dropped
    now[0] = 105.5
    assert b.check() == [0] and fired == [(0, 5.0)]
    now[0] = 110.0
    assert b.check() == [] and fired == [(0, 5.0)]   # generation 0 is reported once
    b.watch(_Work(), 1, 1.0)
    now[0] = 111.5
    assert b.check() == [1] and fired[-1] == (1, 1.0)


def _two_ranks(timeout_s: float = 60) -> list:
    store = dist.HashStore()
    pgs: list = [None, None]

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore("b", store), rank, 2, timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(pgs), "the gloo groups did not form"
    return pgs


class _Bucket:   # what DDP hands its comm hook: the bucket's flat gradient buffer
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def buffer(self) -> torch.Tensor:
        return self.t


def _guard(bound_s: float, fired: list) -> StepGuard:
    guard = StepGuard({}, timeout_s=lambda: bound_s, rank=0)
    guard.bound = nccl.Bound(lambda gen, s: (fired.append(gen), guard.fail(f"bound {s}", gen=gen)))
    guard.bound.start()
    return guard


def test_a_silent_peers_all_reduce_fails_the_step_at_its_bound_and_aborts_once():
    pgs = _two_ranks()
    fired: list[int] = []
    guard = _guard(0.5, fired)
    try:
        t0 = time.monotonic()
        fut = guard.comm_hook(pgs[0], _Bucket(torch.full((4,), 2.0)))
        while not guard.failed and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert guard.failed and "bound 0.5" in guard.error and fired == [0], (guard.error, fired)
        assert 0.4 < took < 5, took
    finally:
        pgs[1].allreduce([torch.zeros(4)]).wait()   # the peer answers: the operation ends
        guard.bound.stop()
    assert fut.wait().tolist() == [1.0] * 4 and fired == [0]


def test_an_all_reduce_that_fails_fails_the_step_and_never_raises_into_ddp():
    # The group's error (here gloo's own 1-s timeout; on NCCL an aborted communicator) must
    # become a failed step with the local gradient, not an exception out of the backward
    # pass: it was one (the survivor of a killed peer raised and was restarted).
    pgs = _two_ranks(timeout_s=1.0)
    fired: list[int] = []
    guard = _guard(30.0, fired)
    try:
        fut = guard.comm_hook(pgs[0], _Bucket(torch.full((4,), 2.0)))
        assert fut.wait().tolist() == [1.0] * 4   # the local (divided) gradient, no exception
        assert guard.failed and guard.error.startswith("all-reduce:") and fired == [], guard.error
    finally:
        guard.bound.stop()


def test_a_slow_peer_within_the_bound_is_left_alone():
    pgs = _two_ranks()
    fired: list[int] = []
    guard = _guard(3.0, fired)
    try:
        fut = guard.comm_hook(pgs[0], _Bucket(torch.full((4,), 2.0)))
        time.sleep(0.5)   # the peer is late, not lost
        pgs[1].allreduce([torch.full((4,), 2.0)]).wait()   # its half of the mean (4 / 2)
        assert fut.wait().tolist() == [3.0] * 4
        time.sleep(4 * nccl.BOUND_POLL_S)
        assert not guard.failed and fired == [] and guard.bound.pending() == 0
    finally:
        guard.bound.stop()


def test_no_nccl_backend_on_a_gloo_group_means_nothing_to_abort():
    pgs = _two_ranks()
    assert nccl.nccl_backends(pgs) == [] and nccl.abort_all(pgs) == 0
    works = [pgs[r].allreduce([torch.ones(2)]) for r in (0, 1)]
    assert all(w.wait() for w in works)   # unaffected: they still reduce


def test_the_optimizer_step_waits_for_the_reduction_and_skips_a_step_failed_meanwhile():
    # NCCL runs on its stream while the CPU goes on: without the wait, the optimizer would
    # run (here: at once, on the unreduced gradient) before the all-reduce ended.
    pgs = _two_ranks()
    fired: list[int] = []
    guard = _guard(30.0, fired)
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=1.0)
    guard.guard_optimizer(opt)
    try:
        for failing in (False, True):
            guard.begin(0)
            before = w.detach().clone()
            fut = guard.comm_hook(pgs[0], _Bucket(torch.full((4,), 2.0)))
            w.grad = torch.ones(4)
            done = threading.Event()
            stepper = threading.Thread(target=lambda: (opt.step(), done.set()))
            stepper.start()
            assert not done.wait(0.5), "the optimizer stepped before the reduction ended"
            if failing:   # the fault watch fails the step while the reduction is stuck
                guard.fail("fault announced")
            else:
                pgs[1].allreduce([torch.full((4,), 2.0)]).wait()
            assert done.wait(10), "the optimizer step did not go on"
            stepper.join()
            if failing:
                assert torch.equal(w.detach(), before) and guard.failed
                pgs[1].allreduce([torch.zeros(4)]).wait()   # let the stuck operation end
            else:
                assert fut.wait().tolist() == [3.0] * 4 and torch.equal(w.detach(), before - 1)
                assert not guard.failed
    finally:
        guard.bound.stop()


class _UnreadableWork:
    """A finished operation as torch 2.11's NCCL hands it to Python: ``exception()`` raises
    TypeError (an exception pybind cannot convert), the future says how the operation ended."""

    def __init__(self, future_error: Exception | None) -> None:
        self.future_error = future_error

    def exception(self) -> None:
        raise TypeError("Unable to convert function return value to a Python type! The signature was")

    def get_future(self) -> "_UnreadableWork":
        return self

    def value(self) -> list[torch.Tensor]:
        if self.future_error is not None:
            raise self.future_error
        return [torch.ones(1)]


@pytest.mark.unit
def test_an_unreadable_work_exception_is_decided_by_the_future_and_a_real_error_still_fails() -> None:
    """On an H200 (torch 2.11) every NCCL step failed with that TypeError, no NCCL error logged."""
    from runtime.inprocess.worker.guard import work_error

    assert work_error(_UnreadableWork(None)) is None   # the operation ended well: the step goes on
    err = work_error(_UnreadableWork(RuntimeError("NCCL communicator was aborted")))
    assert isinstance(err, RuntimeError) and "aborted" in str(err)
    # a real (gloo) work: a finished all-reduce reads as no error
    import torch.distributed as dist
    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1)
    work = pg.allreduce([torch.ones(2)])
    work.wait()
    assert work_error(work) is None
