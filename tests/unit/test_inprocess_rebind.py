"""Keeping in-process workers through the rendezvous host's loss, the parts that need no cluster
(the cluster test is ``tests/slurm/test_succession_on_cluster.py``):

- the launcher's rule of when its workers can be kept, and the ``--adopt`` value;
- its stand-in for torch's process context, on real child processes (alive, exited, killed);
- the node-local channel: the worker's watch takes a newer epoch once, and first breaks a real
  store request blocked on the old store (a crashed host never answers it);
- the re-form in a store with no history: the survivors, knowing the last generation from
  memory, mark the lost node's workers dead and close at once on the newest step.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from hpc.contract import environment as job_env
from hpc.contract import recovery_settings
from runtime.inprocess import rules
from runtime.inprocess import protocol as proto
from runtime.inprocess.launcher import adopt
from runtime.liveness import proc
from runtime.inprocess.worker import rebind
from runtime.inprocess.worker.membership import Membership


def test_workers_are_kept_only_with_succession_no_spares_and_every_local_rank_alive():
    ok = dict(succession=True, spares=0, kept={0: 11, 1: 12}, nproc=2)
    assert adopt.why_not(**ok) is None
    assert "no succession outside Slurm" in adopt.why_not(**{**ok, "succession": False})
    assert "1 hot spare" in adopt.why_not(**{**ok, "spares": 1})
    why = adopt.why_not(**{**ok, "kept": {0: 11}})
    assert "local rank(s) 1 not running" in why and "last checkpoint" in why


def test_the_adopt_value_round_trips_and_ignores_junk():
    kept = {1: 4321, 0: 1234}
    assert adopt.format_adopt(kept) == "0:1234,1:4321"
    assert adopt.parse_adopt(adopt.format_adopt(kept)) == kept
    assert adopt.parse_adopt("") == {} and adopt.parse_adopt(None) == {}
    assert adopt.parse_adopt("0:12,x:3,4") == {0: 12}


def test_lost_uids_are_the_workers_on_hosts_outside_the_new_epoch():
    uids = ["node1/10", "node1/11", "node2/20", "node3/30"]
    assert rules.lost_uids(uids, ["node2", "node3"]) == ["node1/10", "node1/11"]
    rec = proto.Rebind(1, "node2:29400", "hpc/inproc/node2:4000", ("node2", "node3"))
    assert proto.Rebind.decode(rec.encode()) == rec


def test_adopted_processes_are_watched_reaped_and_reported_like_torchs_context():
    ok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    bad = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ctx = adopt.AdoptedProcesses({0: ok.pid, 1: bad.pid})
    assert ctx.pids() == {0: ok.pid, 1: bad.pid}
    assert ctx.wait(0) is None                      # both run
    time.sleep(1.0)
    assert ctx.wait(0) is None                      # one ended (a zombie, not reaped): still running
    assert Path(f"/proc/{ok.pid}/stat").exists()
    bad.kill()
    result = ctx.wait(5)
    assert result is not None and result.is_failed()
    assert result.return_values == {0: None} and result.failures[1].exitcode == -9
    assert not Path(f"/proc/{ok.pid}/stat").exists()   # reaped once all ended


def test_an_adopted_worker_reaped_elsewhere_is_judged_by_whether_the_training_finished():
    # Its exit status is gone: read as exit 0 it once ended an unfinished job as "finished";
    # read as failed, a finished job ended as an application error. The store's mark decides.
    for finished, failed in ((lambda: False, True), (None, True), (lambda: 1 / 0, True), (lambda: True, False)):
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()                                   # someone else reaped it
        result = adopt.AdoptedProcesses({0: proc.pid}, finished=finished).wait(5)
        assert result is not None and result.is_failed() is failed, (finished, result)
        if failed:
            assert result.failures[0].exitcode == 1


def _orphaned_popen_then_another_popen(keep: bool) -> int:
    """A running worker's Popen dropped (its agent gone), kept by keep_handles or not; the
    worker ends; this process starts another child (a joiner): subprocess reaps its orphans."""
    import gc

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    pid = proc.pid
    if keep:
        adopt.keep_handles(SimpleNamespace(handlers={0: proc}))
    del proc
    gc.collect()
    time.sleep(1.5)                               # it ended (a zombie)
    subprocess.run([sys.executable, "-c", "pass"], check=True)   # the joiner's start
    return pid


def test_workers_kept_in_place_keep_their_exit_status_for_the_adoption():
    pid = _orphaned_popen_then_another_popen(keep=True)
    result = adopt.AdoptedProcesses({0: pid}).wait(5)
    assert result is not None and not result.is_failed(), result.failures   # its real exit 0
    # Without keep_handles the status is gone (subprocess reaped it): counted as failed.
    pid = _orphaned_popen_then_another_popen(keep=False)
    result = adopt.AdoptedProcesses({0: pid}).wait(5)
    assert result is not None and result.is_failed()


def test_closing_adopted_processes_stops_them():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.monotonic()
    adopt.AdoptedProcesses({0: proc.pid}).close(timeout=5)
    assert time.monotonic() - t0 < 5 and not Path(f"/proc/{proc.pid}/stat").exists()


def test_the_epoch_watch_breaks_a_request_blocked_on_the_old_store_then_offers_the_new_one(tmp_path):
    old = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", old.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    channel = tmp_path / "channel.json"
    broken: list[bool] = []
    watch = rebind.EpochWatch(channel, 0, address=lambda: f"127.0.0.1:{old.port}",
                              on_new=lambda: broken.append(True))
    watch.start()
    failed: list[float] = []

    def blocked() -> None:   # a store request the old host will never answer (60 s bound)
        try:
            client.wait(["never"])
        except Exception:   # noqa: BLE001 - the broken connection
            failed.append(time.monotonic())
    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.5)
    channel.write_text(proto.Rebind(0, "x:1", "s", ("a",)).encode())   # not newer: ignored
    time.sleep(0.6)
    assert not watch.pending() and not failed
    t0 = time.monotonic()
    rec = proto.Rebind(1, "127.0.0.1:2", "hpc/inproc/n2:5", ("n2", "n3"))
    channel.write_text(rec.encode())
    assert watch.take(5) == rec and broken == [True]
    t.join(10)
    assert failed and failed[0] - t0 < 5, "the blocked store request did not end"
    assert watch.take(0) is None   # offered once
    watch.stop()


def test_without_a_watch_a_failed_store_request_is_not_waited_on():
    with pytest.raises(RuntimeError, match="gone"):
        rebind.wait_for(None, RuntimeError("gone"))


def test_survivors_re_form_in_a_store_without_history_and_do_not_wait_for_the_lost_node():
    """The new store knows nothing: each survivor knows the last generation (gen 4) from
    memory and marks node1's workers dead; the first arrival leads, closes at once (the join
    window is 60 s here) and the newest step held wins."""
    new = dist.HashStore()
    old = ("node1/1", "node1/2", "node2/3", "node2/4", "node3/5", "node3/6")
    survivors = [Membership(new, u, window_s=60.0) for u in old[2:]]
    for m in survivors:
        m.gen, m.uids = 4, old
        for u in rules.lost_uids(m.uids, ["node2", "node3"]):
            new.set(proto.dead(u), "lost with its node")
    got: dict[str, object] = {}
    steps = {"node2/3": 17, "node2/4": 17, "node3/5": 18, "node3/6": 17}
    threads = [threading.Thread(target=lambda m=m: got.update({m.me: m.reform(steps[m.me], old.index(m.me),
                                                                              reason="host lost")}))
               for m in survivors]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 20, "the leader waited for the lost node's workers"
    ms = set(got.values())
    assert len(ms) == 1
    [m] = ms
    assert m.gen == 5 and m.uids == old[2:] and m.world_size == 4
    assert m.step == 18 and m.uids[m.source] == "node3/5"


class _Restarted(Exception):
    pass


def test_the_fence_gets_the_main_thread_out_of_a_blocked_store_request_to_restart_keeping_workers(monkeypatch):
    """The workers die with the thread that started them (PR_SET_PDEATHSIG): the restart that
    keeps them must run on the launcher's main thread, which sits in torch's requests to the
    lost store. The fence breaks those requests and signals it; the main thread takes the
    restart (here it raises instead of ``execv``, which a test cannot do) within a second."""
    import signal

    from runtime.launch import main as launch

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    f = launch._Fence(None, 0, members=2, is_host=False, rdzv_endpoint=f"127.0.0.1:{server.port}")
    f.host_lost = "the rendezvous store has not answered for 10s: its host is lost"
    taken: list[tuple[int, dict]] = []

    def restart(children: list[int], epoch: int, adopt: dict | None = None) -> None:
        taken.append((threading.get_ident(), dict(adopt or {})))
        raise _Restarted
    monkeypatch.setattr(launch, "_restart_launcher", restart)
    previous = signal.signal(launch.KEEP_SIGNAL, lambda *_: f.exec_kept())
    asker = threading.Thread(target=lambda: f._yield_to_main({0: 123, 1: 456}), daemon=True)
    t0 = time.monotonic()
    try:
        with pytest.raises(_Restarted):
            # (started inside: the signal may come while the main thread still waits in start())
            asker.start()
            while time.monotonic() - t0 < 30:   # torch's agent, blocked on the lost host's store
                try:
                    client.wait(["never"])
                except dist.DistNetworkError:   # broken: back in Python, where the handler runs
                    time.sleep(0.1)
    finally:
        f.keep_now = None   # (the asker stops signalling)
        asker.join(5)
        signal.signal(launch.KEEP_SIGNAL, previous)
    assert time.monotonic() - t0 < 5
    assert taken == [(threading.main_thread().ident, {0: 123, 1: 456})]


def test_a_host_that_lost_its_majority_and_the_controller_does_not_let_its_workers_re_form_alone():
    """The cut-off host's workers re-formed alone and committed a checkpoint step the
    survivors then could not save (seen on the cluster: 'step-000012 already exists')."""
    from runtime.inprocess.launcher.run import UnlessCutOff

    said: list[dict] = []
    asked: list[bool] = []

    def reachable(answer: bool):
        return lambda: asked.append(answer) or answer

    cut = UnlessCutOff(said.append, members=3, reachable=reachable(False))
    cut({1: ("node2", 5.0)})                        # 2 of 3 left: a majority, announced
    assert said == [{1: ("node2", 5.0)}] and not asked
    cut({1: ("node2", 6.0), 2: ("node3", 5.0)})     # 1 of 3 left, no controller: held back
    cut({1: ("node2", 7.0), 2: ("node3", 6.0)})
    assert len(said) == 1 and asked == [False]      # asked once
    gone = UnlessCutOff(said.append, members=3, reachable=reachable(True))
    gone({1: ("node2", 5.0), 2: ("node3", 5.0)})    # the controller answers: the others are gone
    assert said[-1] == {1: ("node2", 5.0), 2: ("node3", 5.0)}


def test_a_cut_host_that_sees_its_peers_stop_one_after_another_is_held_back_from_the_first():
    """CI of d306e5b: the cut host named node3 lost while node2, as silent, was not yet named:
    '2 of 3 left' announced node3, the host's workers re-formed alone (world 2) and saved step
    10, and the survivors, going on in place, died on 'step-000010 already exists'. The nodes
    left are those in sight: none here, so the first loss is held back already; a real single
    loss (the other node in sight) is announced at once; a held host asks the controller again
    only after a while, and goes on once its peer is back in sight."""
    from runtime.inprocess.launcher.run import UnlessCutOff

    said: list[dict] = []
    asked: list[float] = []
    now = [100.0]
    sight = [0]

    def controller_down() -> bool:
        asked.append(now[0])
        return False

    cut = UnlessCutOff(said.append, members=3, reachable=controller_down,
                       in_sight=lambda: sight[0], clock=lambda: now[0])
    cut({2: ("node3", 5.2)})                   # node2 as silent, only not 5 s yet: held
    now[0] += 1.0
    cut({2: ("node3", 6.2)})                   # not asked again within ASK_AGAIN_S
    assert said == [] and asked == [100.0]
    now[0] += UnlessCutOff.ASK_AGAIN_S
    cut({1: ("node2", 7.0), 2: ("node3", 11.2)})
    assert said == [] and asked == [100.0, 106.0]

    healthy = UnlessCutOff(said.append, members=3, reachable=controller_down,
                           in_sight=lambda: 1, clock=lambda: now[0])
    healthy({2: ("node3", 5.1)})               # node2 beats on: a majority in sight, announced
    assert said == [{2: ("node3", 5.1)}] and len(asked) == 2

    slow = UnlessCutOff(said.append, members=3, reachable=controller_down,
                        in_sight=lambda: sight[0], clock=lambda: now[0])
    slow({2: ("node3", 5.1)})                  # node2's beats late for a moment: held
    assert len(said) == 1
    sight[0] = 1                               # back in sight: announced
    slow({2: ("node3", 6.1)})
    assert said[-1] == {2: ("node3", 6.1)}


def test_the_nodes_in_sight_are_those_whose_counters_advanced_lately():
    """Not those not yet named lost: a peer silent 4 s is not in sight with a 2.5 s window;
    as the root, another group's members count while its key advances."""
    from runtime.liveness.beacon import PeerTracker

    t = PeerTracker(0, hosts={0: "node1"})
    t.observe(1, 5, now=10.0)
    t.observe(2, 7, now=10.0)
    t.observe(1, 6, now=13.0)                     # node rank 1 beat at 13; rank 2 last at 10
    assert t.in_sight(14.0, 2.5, {0: 3}) == 1
    assert t.in_sight(16.0, 2.5, {0: 3}) == 0
    t.note("group/1", (32, 1), now=13.5)          # group 1 (32 nodes) folded lately
    assert t.in_sight(14.0, 2.5, {0: 32, 1: 32}) == 1 + 32
    t.done.add(1)                                 # a node that ended cleanly is not in sight
    assert t.in_sight(14.0, 2.5, {0: 3}) == 0


def test_an_adopted_workers_joiner_writes_where_the_worker_wrote(tmp_path: Path):
    """After a succession the launcher adopts its workers (its torch context, with their log
    files, is gone): a dead one's joiner must write to the same file (the campaign: three
    joiners after a host loss died with exit code 1 and left no trace of why)."""
    log = tmp_path / "rank-2.log"
    with log.open("wb") as f:
        to_file = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=f)
    to_pipe = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        for p in (to_file, to_pipe):   # (in its exec, a process's /proc command line reads empty)
            deadline = time.time() + 30
            while "-c" not in proc.cmdline(p.pid) and time.time() < deadline:
                time.sleep(0.01)
        launch = adopt.launch_of({0: to_file.pid, 1: to_pipe.pid}, store="node2:29413",
                                 master_addr="node2", master_port=29400, epoch=1)
    finally:
        for p in (to_file, to_pipe):
            p.kill()
            p.wait()
    assert launch["outs"] == {0: str(log), 1: ""}
    assert launch["envs"][0][recovery_settings.STORE_ENV] == "node2:29413"
    # The new epoch: with the worker's own (0), the joiner's epoch watch took the current
    # epoch's record for a new one and broke its connections to the new store.
    assert launch["envs"][0][job_env.RDZV_EPOCH] == "1"
