"""In-process recovery on NCCL: the abort path (runtime.inprocess.worker.nccl), through ``hpc run``.

The real launcher, torch's elastic agent and Session workers (``inproc_train.py``, DDP on CUDA,
so the training group is NCCL) with ``--recovery inprocess``. Two tests, for what each GPU
count can prove (NCCL refuses two ranks of one communicator on one device):

- **one GPU**: a fault injected on the only rank between its gradient all-reduce and its
  optimizer step. The recovery's whole NCCL path runs in the same process: the communicators of
  the old generation are aborted (``ProcessGroupNCCL.abort``, found through
  ``ProcessGroup._get_backend``), the old groups are unregistered without a hang, a fresh NCCL
  group bound to the device is formed with its gloo side group, the state goes over that side
  group, DDP is rebuilt on the new group and training finishes. It does not show that an abort
  ends a collective blocked on a lost peer: a world of one has no peer.
- **two GPUs**: a worker SIGKILLed mid-run while its peer's NCCL all-reduce waits for it. The
  survivor must keep its PID: without the abort its wait never ends (NCCL has no error for a
  peer that vanished mid-kernel; torch's watchdog would end the process at the group's timeout),
  and the node's stall watch would restart everyone. The launcher starts a joiner in the killed
  worker's place; the world is 2 again, training finishes and the replicas are equal, with no
  checkpoint read to recover.

First run on a GPU (an H200, torch 2.11.0, session 8): the one-GPU test failed, on three
defects fixed since (torch 2.11 has no ``forward_sync_buffers``; torch's agent gave the workers
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``; ``Work.exception()`` raised TypeError on every step, which
counted as a failed step). Session 9, the same machine: it failed once more, on the Session's
metric row (a CPU tensor all-reduced on the one-GPU NCCL default group; fixed in
``runtime.worker.metrics.start_reduce``), then passed: abort 0.58 s after the detection, a new
NCCL group in 0.03 s, the state over the side group in 3 ms. The two-GPU test needs a machine
with two; it has not run.
The same two scenarios run on CPU with the NCCL plan's steps on gloo
(tests/distributed/test_inprocess_nccl_plan.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.conftest import need_cuda_devices
from tests.gpu.support import fault_on_one_rank, kill_one_of_two

pytestmark = pytest.mark.gpu


def test_one_gpu_the_recovery_aborts_its_nccl_group_and_forms_a_new_one_in_the_same_process(tmp_path: Path):
    need_cuda_devices(1)
    fault_on_one_rank(tmp_path, "nccl")


def test_two_gpus_a_killed_peers_survivor_is_released_by_the_abort_and_keeps_its_pid(tmp_path: Path):
    need_cuda_devices(2)
    kill_one_of_two(tmp_path, "nccl")
