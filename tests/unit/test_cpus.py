"""OMP_NUM_THREADS from the job's CPU allowance (affinity set, cgroup v2 quota), not the host's."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.launch.cpus import _cgroup_cpu_max, cpu_allowance, job_cpus, omp_threads

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("affinity,cpu_max,host,want", [
    (4, None, 64, 4),                    # task/affinity bound the task to 4 of 64 CPUs
    (None, None, 64, 64),                # nothing known: the host's count
    (64, "max 100000", 64, 64),          # a cgroup without a quota
    (64, "200000 100000", 64, 2),        # two CPUs' worth of quota on a 64-CPU host
    (64, "150000 100000", 64, 2),        # 1.5 CPUs: rounded up, a thread may use the half
    (1, "800000 100000", 64, 1),         # the tighter of the two wins
    (8, "garbage", 64, 8), (8, "0 100000", 64, 8), (None, None, None, 1),
])
def test_cpu_allowance(affinity, cpu_max, host, want) -> None:
    assert cpu_allowance(affinity, cpu_max, host) == want


@pytest.mark.parametrize("cpus,workers,want", [(16, 4, 4), (2, 8, 1), (7, 2, 3), (1, 1, 1)])
def test_omp_threads_is_an_equal_share_at_least_one(cpus, workers, want) -> None:
    assert omp_threads(cpus, workers) == want


def test_cgroup_reader_takes_the_tightest_quota_on_the_path(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    leaf = root / "system.slice" / "slurmstepd.scope" / "job_7"
    leaf.mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "system.slice" / "cpu.max").write_text("400000 100000\n")
    (leaf / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup-self"
    proc.write_text("0::/system.slice/slurmstepd.scope/job_7\n")
    assert _cgroup_cpu_max(proc, root) == "400000 100000"
    proc.write_text("12:cpu,cpuacct:/slurm/job_7\n")   # cgroup v1: no cpu.max to read
    assert _cgroup_cpu_max(proc, root) is None
    assert _cgroup_cpu_max(tmp_path / "missing", root) is None


def test_job_cpus_reads_this_process() -> None:
    import os
    assert 1 <= job_cpus() <= (os.cpu_count() or 1)
