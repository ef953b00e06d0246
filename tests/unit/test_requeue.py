import pytest

from runtime.ending.requeue import claim, decide_requeue

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind,expected", [("time_limit", True), ("node_failure", True),
                                           ("preempted", True), ("app_error", False),
                                           ("finished", False), ("cancelled", False)])
def test_who_requeues(kind, expected):
    d = decide_requeue(kind, policy="auto", allocation=0, max_requeues=3, under_slurm=True)
    assert d.requeue is expected


def test_budget_and_policy_stop_requeues():
    assert not decide_requeue("time_limit", policy="auto", allocation=3, max_requeues=3, under_slurm=True).requeue
    assert "budget" in decide_requeue("time_limit", policy="auto", allocation=3, max_requeues=3,
                                      under_slurm=True).reason
    assert not decide_requeue("time_limit", policy="never", allocation=0, max_requeues=3, under_slurm=True).requeue
    assert not decide_requeue("time_limit", policy="auto", allocation=0, max_requeues=3, under_slurm=False).requeue


def test_claim_is_exactly_once(tmp_path):
    assert claim(tmp_path, 2)
    assert not claim(tmp_path, 2)
    assert claim(tmp_path, 3)
    assert claim(tmp_path, 2, "record") and not claim(tmp_path, 2, "record")


def test_rdzv_port_is_per_job_unless_set():
    from hpc.contract.jobspec import JobSpec
    from runtime.env import SlurmEnv
    from runtime.launch.main import rdzv_port

    spec = JobSpec(script="s")
    assert rdzv_port(spec, SlurmEnv(job_id="1234")) == 29400 + 234
    assert rdzv_port(spec, SlurmEnv(job_id="77_3")) == 29400 + 773
    assert rdzv_port(spec, SlurmEnv()) == 29400
    assert rdzv_port(spec.replace(rdzv_port=31000), SlurmEnv(job_id="5")) == 31000


def test_root_failure_is_the_cause_not_a_peers_broken_connection():
    from types import SimpleNamespace as F

    from runtime.launch.main import root_failure

    gloo = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[10.0.0.2]:4242. This is typically caused by a remote worker crashing.")
    failures = {0: F(timestamp=100.0, message={"message": gloo}),          # recorded first
                1: F(timestamp=100.2, message={"message": "ValueError: boom"}),
                2: F(timestamp=100.1, message={"message": gloo})}
    assert root_failure(failures)[0] == 1
    only_collateral = {3: F(timestamp=5.0, message=gloo), 1: F(timestamp=4.0, message=gloo)}
    assert root_failure(only_collateral)[0] == 1                          # then the earliest
    killed = {0: F(timestamp=2.0, message=gloo), 1: F(timestamp=3.0, message="Signal 9 (SIGKILL)")}
    assert root_failure(killed)[0] == 1
    # CI of 8c3b77e: rank 0 raised, its peer's broken connection was seen first, and the
    # agent's SIGTERM ended rank 0 while it was still exiting: rank 0 is still the cause.
    raised_then_stopped = {0: F(timestamp=10.0, exitcode=-15, message={"message": "RuntimeError: x"}),
                           1: F(timestamp=11.0, exitcode=1, message={"message": "ValueError: y"})}
    assert root_failure(raised_then_stopped)[0] == 0
    stopped = {0: F(timestamp=10.0, exitcode=-15, message="Signal 15 (SIGTERM) received by PID 7"),
               1: F(timestamp=11.0, exitcode=1, message={"message": "ValueError: y"})}
    assert root_failure(stopped)[0] == 1


def test_a_node_that_sees_its_allocation_still_training_is_the_one_left_behind():
    from runtime.ending.outcome import others_went_on
    fresh = {"allocation": 0, "step": 30, "world_size": 4, "time": 1000.0}
    assert "still training without this node" in others_went_on(fresh, 0, now=1003.0)
    # The host really lost: nobody trained since the store went away (timeout + election).
    assert others_went_on(fresh, 0, now=1020.0) is None
    assert others_went_on(fresh, 1, now=1003.0) is None          # another allocation's progress
    assert others_went_on(None, 0, now=1003.0) is None
    assert others_went_on({"allocation": 0, "time": "x"}, 0, now=1003.0) is None
