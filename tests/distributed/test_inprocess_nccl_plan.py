"""The NCCL path's plumbing on CPU: the gpu tier's two scenarios with the NCCL plan on gloo.

``HPC_TEST_INPROC_PLAN=nccl`` runs every step of the NCCL plan that needs no CUDA
(:func:`runtime.inprocess.worker.nccl.plan_for`): the gloo side group made beside the training
group in the same order by members and joiners, the Session's control traffic and the state
transfer over it, the thread's bound of every training all-reduce instead of a per-operation
timeout, the optimizer's wait for the reduction, and the abort's search (no NCCL backend on
CPU). The real launcher, torch's elastic agent and Session workers, as in
tests/gpu/test_gpu_inprocess_nccl.py, which runs the same scenarios on NCCL where a GPU exists.
What this cannot show: the abort of a real NCCL communicator.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.support import fault_on_one_rank, kill_one_of_two

pytestmark = [pytest.mark.distributed, pytest.mark.inprocess]


def test_a_fault_on_the_only_rank_recovers_in_process_through_the_nccl_plan(tmp_path: Path):
    fault_on_one_rank(tmp_path, "gloo", HPC_TEST_INPROC_PLAN="nccl")


def test_a_killed_peer_is_replaced_and_the_replicas_end_equal_through_the_nccl_plan(tmp_path: Path):
    kill_one_of_two(tmp_path, "gloo", HPC_TEST_INPROC_PLAN="nccl")
