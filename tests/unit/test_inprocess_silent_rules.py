"""The pure rules of runtime.inprocess.launcher.silent: which worker is frozen, whose workers a lost node held."""

from __future__ import annotations

from runtime.inprocess.launcher.silent import StoppedWorkers, victims


def test_a_worker_stopped_for_two_seconds_is_frozen():
    w = StoppedWorkers(stopped_s=2.0)
    assert w.frozen({10: "T", 11: "S"}, now=100.0) == []
    assert w.frozen({10: "T", 11: "R"}, now=101.9) == []
    assert w.frozen({10: "T", 11: "R"}, now=102.0) == [10]


def test_a_slow_or_briefly_stopped_or_traced_worker_is_left_alone():
    w = StoppedWorkers(stopped_s=2.0)
    w.frozen({10: "T", 11: "D", 12: "t"}, now=100.0)     # 12: a tracer's stop (a debugger, py-spy)
    w.frozen({10: "S", 11: "D", 12: "t"}, now=101.0)     # 10 continued (SIGCONT) within the bound
    assert w.frozen({10: "T", 11: "D", 12: "t"}, now=105.0) == []   # 10's stop starts over at 105
    assert w.frozen({10: "T", 11: "R", 12: "t"}, now=107.0) == [10]


def test_a_killed_worker_is_not_killed_again(monkeypatch):
    killed = []
    monkeypatch.setattr("os.kill", lambda pid, sig: killed.append(pid))
    w = StoppedWorkers(stopped_s=1.0)
    w.frozen({10: "T"}, now=0.0)
    for pid in w.frozen({10: "T"}, now=1.5):
        w.kill(pid, now=1.5)
    assert killed == [10] and "stopped (SIGSTOP) for 1.5s" in w.killed[10]
    assert w.frozen({10: "T"}, now=3.0) == []


def test_a_lost_nodes_workers_are_the_members_its_launcher_published():
    # Nodes may share a host name (hpc run's local nodes): the node's own list decides.
    uids = ["vm/11", "vm/31", "vm/5", "vm/32"]
    assert victims(uids, ["vm/31", "vm/32", "vm/40"]) == ["vm/31", "vm/32"]   # 40: not a member now
    assert victims(uids, []) == []
