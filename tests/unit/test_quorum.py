"""The rendezvous host's watch for an allocation below MIN nodes (runtime/launch/quorum.py).

Pure logic with a fake clock and fake reads; the real proof is on the cluster
(``tests/slurm/test_fault_tolerance.py::test_lone_survivor_below_min_requeues``).
"""

from __future__ import annotations

from runtime.launch.quorum import QuorumWatch, short_of_min


def test_fewer_nodes_than_min_in_the_running_job_is_short():
    why = short_of_min("RUNNING", ("node1",), 2)
    assert why is not None and "only 1 node left" in why and "node1" in why and "MIN 2" in why


def test_a_node_slow_to_join_is_still_in_the_job_and_waited_for():
    assert short_of_min("RUNNING", ("node1", "node2"), 2) is None
    assert short_of_min("RUNNING", ("node1", "node2", "node3"), 2) is None


def test_a_job_that_is_not_running_or_unknown_is_left_alone():
    assert short_of_min("COMPLETING", ("node1",), 2) is None    # ending or being requeued
    assert short_of_min("RUNNING", (), 2) is None               # no node list: unknown


class Fake:
    def __init__(self, nodes):
        self.t, self.workers, self.nodes, self.asked, self.acted = 0.0, True, nodes, 0, 0

    def watch(self, min_nodes=2):
        def job():
            self.asked += 1
            return ("RUNNING", self.nodes)
        return QuorumWatch(min_nodes=min_nodes, working=lambda: self.workers, job=job,
                           act=lambda: setattr(self, "acted", self.acted + 1), clock=lambda: self.t,
                           idle_s=10, check_s=5)

    def run(self, w, until, step=1.0):
        while self.t < until:
            w.check()
            self.t += step


def test_a_lone_survivor_ends_the_rendezvous_after_the_idle_time_not_join_timeout():
    f = Fake(("node1",))
    w = f.watch()
    f.run(w, 30)                # workers running: Slurm is not asked, nothing happens
    assert (f.asked, f.acted) == (0, 0)
    f.workers = False           # the agent went back to the rendezvous after a node loss
    f.run(w, 39)
    assert (f.asked, f.acted) == (0, 0), "a rendezvous round that forms in seconds is not watched"
    f.run(w, 45)
    assert f.acted == 1 and w.short is not None and "below MIN 2" in w.short


def test_a_slow_joiner_is_waited_for_with_slurm_asked_only_every_check_interval():
    f = Fake(("node1", "node2"))
    f.workers = False           # the host waits for node2, slow to start
    w = f.watch()
    f.run(w, 600)
    assert f.acted == 0 and w.short is None
    assert 100 <= f.asked <= 120, f.asked   # one read per 5 s, not per poll


def test_the_watch_acts_once_slurm_drops_the_node_not_before():
    f = Fake(("node1", "node2"))
    f.workers = False
    w = f.watch()
    f.run(w, 40)
    assert f.acted == 0
    f.nodes = ("node1",)        # ~20-30 s after a crash Slurm drops node2 from the job
    f.run(w, 46)
    assert f.acted == 1


def test_workers_back_resets_the_idle_clock():
    f = Fake(("node1",))
    w = f.watch()
    f.workers = False
    f.run(w, 8)
    f.workers = True            # the round formed (MIN was reached after all)
    f.run(w, 9)
    f.workers = False
    f.run(w, 18)
    assert f.acted == 0, "the idle time counts from the last time workers ran"


def test_a_node_whose_workers_finished_is_not_waiting_in_a_rendezvous():
    # A cut link left node2 alone; its workers finished the training (world 1) and torch's
    # agent waits in its exit barrier for node3's agent, which never comes. Slurm holds 1 node
    # of MIN 2 by then: the watch must leave the finished job alone, not requeue it (campaign
    # of 2026-11-26, seed 1: a node failure 12 s after the last step, a second allocation).
    f = Fake(("node2",))
    done = False
    w = QuorumWatch(min_nodes=2, working=lambda: f.workers, job=lambda: ("RUNNING", f.nodes),
                    act=lambda: setattr(f, "acted", f.acted + 1), clock=lambda: f.t,
                    idle_s=10, check_s=5, finished=lambda: done)
    f.run(w, 5)
    f.workers, done = False, True
    f.run(w, 60)
    assert f.acted == 0 and w.short is None


def test_entering_torchs_exit_barrier_marks_the_node_finished():
    from types import SimpleNamespace

    from torch.distributed import HashStore
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from runtime.launch import quorum

    class Agent(quorum.MarksFinished, LocalElasticAgent):
        pass

    quorum._FINISHED.clear()
    agent = Agent.__new__(Agent)   # (torch's own fields that its barrier reads, no worker spec)
    agent._worker_group = SimpleNamespace(state="SUCCEEDED", group_world_size=1)
    agent._store, agent._exit_barrier_timeout, agent._in_exit_barrier = HashStore(), 5.0, False
    assert not quorum._FINISHED.is_set()
    agent._exit_barrier()   # torch's own barrier behind it, one agent: passes at once
    assert quorum._FINISHED.is_set()
