"""The pre-join health check: the GPU verdict on nvidia-smi's CSV and dmesg's Xid lines (in
the formats nvidia-smi and the driver print; no GPU here to record from), the job-directory
probe for real, and the leave slots that keep a job at MIN."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.launch import health

pytestmark = pytest.mark.unit
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia_smi"


def states(name: str) -> list[health.GpuState]:
    return health.parse_gpu_query((FIX / name).read_text())


def test_healthy_node_passes():
    f = health.gpu_finding(states("healthy_8gpu.csv"), [], expected=8)
    assert f.ok and f.detail.startswith("8 GPU(s)")


def test_missing_gpu_ecc_errors_and_pending_retirement_fail():
    f = health.gpu_finding(states("ecc_pending.csv"), [], expected=8)
    assert not f.ok
    assert "2 GPU(s) visible, the job asks for 8" in f.detail
    assert "GPU 1 (00000000:2A:00.0): 2 uncorrected ECC error(s)" in f.detail
    assert "pending retirement" in f.detail


def test_not_supported_fields_are_not_errors():
    g = states("consumer_na.csv")
    assert g == [health.GpuState(0, "00000000:01:00.0", None, None)]
    assert health.gpu_finding(g, [], expected=1).ok


def test_fatal_xid_fails_an_application_xid_does_not():
    xids = health.parse_xids((FIX / "dmesg_xid79.txt").read_text())
    assert xids == [("0000:2a:00", 79), ("0000:18:00", 13)]
    f = health.gpu_finding(states("healthy_8gpu.csv"), xids, expected=8)
    assert not f.ok and f.detail == "Xid 79 on PCI 0000:2a:00 since boot"
    assert health.gpu_finding(states("healthy_8gpu.csv"), xids[1:], expected=8).ok


def test_job_dir_probe_for_real(tmp_path: Path):
    assert health.job_dir_writable(tmp_path, "n1").ok
    assert not list((tmp_path / "health").iterdir()), "the probe is removed"
    blocked = tmp_path / "file"
    blocked.write_text("a file where a directory should be")
    f = health.job_dir_writable(blocked, "n1")
    assert not f.ok and "cannot write and read back" in f.detail


def test_test_hook_makes_the_real_probe_fail_on_one_node_rank(tmp_path: Path):
    env = {health.TEST_FAIL: "1"}
    ok = health.run_checks(tmp_path, host="h", node_rank=0, gpus_per_node=0, network_problem=None, env=env)
    bad = health.run_checks(tmp_path, host="h", node_rank=1, gpus_per_node=0, network_problem=None, env=env)
    assert all(f.ok for f in ok)
    assert [f.check for f in bad if not f.ok] == ["job_dir"]


def test_network_problem_is_a_failed_check(tmp_path: Path):
    got = health.run_checks(tmp_path, host="h", node_rank=0, gpus_per_node=0,
                            network_problem="no route to node1", env={})
    assert got[0] == health.Finding("interfaces", False, "no route to node1")


def test_leave_slots_never_take_a_job_below_min(tmp_path: Path):
    claims = [health.claim_leave(tmp_path, 0, nodes=4, min_nodes=2, host=f"n{i}") for i in range(3)]
    assert claims == [True, True, False]
    assert not health.claim_leave(tmp_path, 0, nodes=2, min_nodes=2, host="n9")
    assert health.claim_leave(tmp_path, 1, nodes=4, min_nodes=2, host="n1"), "slots are per allocation"
