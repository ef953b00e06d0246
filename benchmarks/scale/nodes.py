"""One OS process hosting many simulated node agents (threads), driven by :mod:`.run`.

Each agent is one node's control plane, with the project's real code:

* **join**: torch's c10d rendezvous handler with the launcher's settings
  (:func:`runtime.launch.main.rdzv_conf`, ``MIN = MAX = N``) against the real libuv ``TCPStore``;
  its keep-alive thread then runs as in a real agent;
* **keepalive**: a real :class:`~runtime.liveness.beacon.PeerBeacon` thread (its store client
  wrapped to count requests);
* **node records**: the stall watch's cross-node part (:class:`runtime.liveness.nodes.NodeBoard`:
  ``peers`` and ``publish``, what :meth:`Watchdog.check` does on the job directory every
  poll) over the heartbeats of 8 fake workers (records as real workers publish them;
  their own heartbeat files are node-local, ``/dev/shm``, and do not grow with N);
* **election**: :func:`runtime.succession.run_election` on the job directory after node 0
  (the rendezvous host) is declared lost.

The phases start on wall-clock times that :mod:`.run` writes into the control directory
(``go-<phase>.json``); this process answers with ``<phase>-<pid>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.scale.meter import CountingStore, FsCounter
from runtime.launch import rendezvous
from runtime.launch.main import rdzv_conf
from runtime.liveness.deadline import StallPolicy
from runtime.liveness.heartbeat import Heartbeat
from runtime.liveness.beacon import BEAT_S, PeerBeacon
from runtime.liveness.verdict import assess
from runtime.liveness.nodes import NodeBoard
from runtime.liveness.watchdog import POLL_S
from runtime import succession

RANKS_PER_NODE = 8
RUN_ID = "scale"


def host_name(rank: int) -> str:
    return f"node{rank:05d}"


class CountedBeacon(PeerBeacon):
    """The real beacon; its store client counts the requests it makes."""

    def __init__(self, *args: Any, counter: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counter = counter
        self.connect_errors: list = []

    def _connect(self):  # noqa: ANN202
        t = time.time()
        try:
            return CountingStore(super()._connect(), self.counter)
        except Exception as e:
            self.connect_errors.append((round(t, 2), round(time.time() - t, 2), type(e).__name__))
            raise

    def halt(self) -> None:
        """Stops the thread without saying done (a node that goes silent)."""
        self._stop.set()


def fake_beats(node_rank: int, now: float) -> list[Heartbeat]:
    """What the node's 8 workers last published: a step a moment ago (as a Session does)."""
    return [Heartbeat(pid=100000 + node_rank * RANKS_PER_NODE + i, rank=node_rank * RANKS_PER_NODE + i,
                      local_rank=i, restart=0, phase="step", step=1000, steps_done=1000,
                      time=now - 0.3, p99_s=0.5, samples=200, compute_s=0.4, alive_every_s=1.0,
                      alive=now - 0.2) for i in range(RANKS_PER_NODE)]


def drive(beacons: list[CountedBeacon], offset_s: float) -> None:
    """One driver thread: each beacon's :meth:`~PeerBeacon.step` once a beat, spread over the
    beat, until all are halted. A beat that runs late starts the next at once (no burst to
    catch up: a real beacon thread that runs late beats late too)."""
    step = BEAT_S / len(beacons)
    start = time.monotonic() + offset_s
    while not all(b._stop.is_set() for b in beacons):
        for i, b in enumerate(beacons):
            time.sleep(max(0.0, start + i * step - time.monotonic()))
            if not b._stop.is_set():
                b.step()
        start = max(start + BEAT_S, time.monotonic())


def wait_for(ctl: Path, name: str, timeout_s: float = 1800.0) -> dict:
    path = ctl / f"go-{name}.json"
    end = time.time() + timeout_s
    while not path.exists():
        if time.time() > end:
            raise TimeoutError(f"no {path} in {timeout_s}s")
        time.sleep(0.05)
    data = json.loads(path.read_text())
    if data.get("t"):
        time.sleep(max(0.0, data["t"] - time.time()))
    return data


def answer(ctl: Path, name: str, data: dict) -> None:
    tmp = ctl / f".{name}-{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, ctl / f"{name}-{os.getpid()}.json")


class Host:
    """The agents ``first .. first+count-1`` of an ``nodes``-node job."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.ranks = list(range(a.first, a.first + a.count))
        self.ctl, self.job_dir = Path(a.ctl), Path(a.job_dir)
        self.fs = FsCounter(self.job_dir)
        self.rdzv_requests = [0]
        self.rdzv_bytes = [0]
        self.beacon_requests = [0]
        self.handlers: dict[int, Any] = {}
        self.beacons: dict[int, CountedBeacon] = {}

    # --- join ---------------------------------------------------------------------------
    def make_handlers(self, join_timeout_s: float) -> None:
        """Each agent's rendezvous handler, as the launcher makes it
        (:func:`runtime.launch.rendezvous.choose`: the listed first round for N known nodes),
        or torch's c10d handler alone with ``--rdzv c10d``; their store clients count."""
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        conf = dict(rdzv_conf(self.a.nodes), join_timeout=int(join_timeout_s))
        if self.a.keep_alive:   # an experiment: another keep-alive interval than the launcher's
            conf["keep_alive_interval"] = self.a.keep_alive
        rendezvous.register()
        for r in self.ranks:
            # The store's server runs apart here: no agent is its host; node 0 decides.
            choice = rendezvous.choose(node_rank=r, expected=self.a.nodes, min_nodes=self.a.nodes,
                                       max_nodes=self.a.nodes, spares=0, configs=dict(conf, is_host=False))
            backend, configs = (choice.backend, dict(choice.configs, decider=r == 0)) \
                if self.a.rdzv == "launcher" else ("c10d", dict(conf, is_host=False))
            self.rdzv_backend = backend
            params = RendezvousParameters(backend, self.a.endpoint, RUN_ID, self.a.nodes, self.a.nodes,
                                          local_addr=host_name(r), **configs)
            h = get_rendezvous_handler(params)
            inner = h.inner if isinstance(h, rendezvous.ListedFirstRound) else h
            backend_ = inner._state_holder._backend   # count its requests (torch's private name)
            backend_._store = CountingStore(backend_._store, self.rdzv_requests, self.rdzv_bytes)
            if isinstance(h, rendezvous.ListedFirstRound):
                h.store = CountingStore(h.store, self.rdzv_requests, self.rdzv_bytes)
            self.handlers[r] = h

    def join(self) -> dict:
        done: dict[int, float] = {}
        errors: list[str] = []
        cpu0 = sum(os.times()[:2])

        def one(r: int) -> None:
            try:
                self.handlers[r].next_rendezvous()
                done[r] = time.time()
            except Exception as e:  # recorded, never invented
                errors.append(f"node {r}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in self.ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"done": done, "errors": errors[:5], "rdzv_requests": self.rdzv_requests[0],
                "rdzv_backend": getattr(self, "rdzv_backend", None),
                "rdzv_bytes": self.rdzv_bytes[0], "cpu_s": sum(os.times()[:2]) - cpu0}

    # --- keepalive, load window and detection --------------------------------------------
    def start_beacons(self) -> None:
        """Starts the beacons spread over one beat (launchers never start in the same ms).

        With ``--beacons-per-thread K`` > 1, K nodes' beacons share one driver thread that
        calls each one's :meth:`PeerBeacon.step` (the beacon thread's own loop body: connect
        when needed, beat) once a beat, their beats spread over it: 1,024 beacon threads in
        two processes on 2 cores reached only 617 beating in 162 s."""
        per = self.a.beacons_per_thread
        for r in self.ranks:
            b = CountedBeacon(self.a.endpoint, RUN_ID, node_rank=r, host=host_name(r),
                              max_nodes=self.a.nodes, counter=self.beacon_requests)
            self.beacons[r] = b
            if per <= 1:
                time.sleep(BEAT_S / len(self.ranks))
                b.start()
        if per > 1:
            beacons = list(self.beacons.values())
            slices = [beacons[i:i + per] for i in range(0, len(beacons), per)]
            for k, part in enumerate(slices):
                threading.Thread(target=drive, args=(part, k * BEAT_S / len(slices)),
                                 name=f"beacons-{k}", daemon=True).start()

    def beating(self, timeout_s: float) -> dict:
        """Waits until every beacon here has beaten and read its peers once (a node that never
        beat is tracked by nobody: its silence is not a loss, see docs/scale.md)."""
        end = time.time() + timeout_s
        waiting = list(self.beacons.values())
        while waiting and time.time() < end:
            waiting = [b for b in waiting if b.tracker.store_ok_at is None]
            time.sleep(0.1)
        return {"beating": len(self.beacons) - len(waiting), "of": len(self.beacons),
                "connect_errors": {r: b.connect_errors for r, b in self.beacons.items() if b.connect_errors}}

    def window(self, go: dict) -> dict:
        """Counts requests over ``[t0, t1]``; then watches the victim's detection."""
        time.sleep(max(0.0, go["t0"] - time.time()))
        b0, r0 = self.beacon_requests[0], self.rdzv_requests[0]
        time.sleep(max(0.0, go["t1"] - time.time()))
        b1, r1 = self.beacon_requests[0], self.rdzv_requests[0]
        span = go["t1"] - go["t0"]
        victim = go["victim"]
        observers = [r for r in self.ranks if r != victim][: self.a.observers]
        if 0 in self.ranks and 0 not in observers:
            observers = [0, *observers[:-1]]
        # Healthy nodes named lost (false positives) while nobody is silent: up to the stop.
        wrongly: set[int] = set()
        while time.time() < go["t_stop"]:
            for r in observers:
                try:
                    wrongly.update(self.beacons[r].tracker.lost(time.monotonic()))
                except RuntimeError:
                    pass
            time.sleep(0.5)
        out = {"beacon_req": b1 - b0, "rdzv_req": r1 - r0, "span_s": span,
               "false_lost": sorted(wrongly)}
        seen: dict[int, float] = {}
        end = go["t_stop"] + go["detect_timeout_s"]
        while time.time() < end and len(seen) < len(observers):
            mono = time.monotonic()
            for r in observers:
                if r in seen:
                    continue
                try:
                    if victim in self.beacons[r].tracker.lost(mono):
                        seen[r] = time.time()
                except RuntimeError:   # the beacon thread changed the dict meanwhile
                    pass
            time.sleep(0.1)
        out["detected"] = {str(r): t - go["t_stop"] for r, t in seen.items()}
        mono = time.monotonic()
        out["missed"] = {str(r): self._view(r, victim, mono) for r in observers if r not in seen}
        out["observers"] = len(observers)
        return out

    def _view(self, r: int, victim: int, mono: float) -> dict:
        """What observer ``r``'s tracker holds about ``victim`` (why it did not name it)."""
        t = self.beacons[r].tracker
        count, since = t.seen.get(victim, (None, None))
        return {"victim_count": count, "victim_still_s": None if since is None else round(mono - since, 1),
                "store_ok_s_ago": None if t.store_ok_at is None else round(mono - t.store_ok_at, 1),
                "victim_done": victim in t.done, "peers_seen": len(t.seen)}

    def stop_liveness(self) -> None:
        for b in self.beacons.values():
            b.halt()
        for h in self.handlers.values():
            try:
                getattr(h, "inner", h)._stop_heartbeats()
            except Exception:
                pass

    # --- the stall watch's node records -------------------------------------------------------
    def records(self, go: dict) -> dict:
        """What :meth:`Watchdog.check` does on the job directory over ``ticks`` polls (their
        clock advanced by the poll period): publish this node's record, every 2 s. The other
        nodes' progress and busy ranks come from the store's summary, not from files."""
        policy = StallPolicy()
        boards = {r: NodeBoard(self.job_dir, allocation=0, node_rank=r, host=host_name(r))
                  for r in self.ranks}
        ticks = go["ticks"]
        if not ticks:
            return {}
        before = dict(self.fs.counts)
        started, t0 = time.time(), time.time()
        for k in range(ticks):
            now = t0 + k * POLL_S
            for r, board in boards.items():
                self.fs.local.owner = r
                board.publish(assess(fake_beats(r, now), {}, now, policy), (), now)
            self.fs.local.owner = None
        took = time.time() - started
        reads = {r: self.fs.counts.get(r, 0) - before.get(r, 0) for r in self.ranks}
        return {"ops_per_node_tick": statistics.mean(reads.values()) / ticks,
                "tick_s": took / ticks, "agents": len(self.ranks)}

    # --- succession --------------------------------------------------------------------------
    def elect(self, ctl: Path) -> dict:
        """Every survivor here runs the election from the common start. Their threads exist and
        wait before it: starting 1,023 threads on 2 cores while the first ones already poll took
        7.4 s, which a cluster (every node starts at once) does not have."""
        order = [host_name(r) for r in range(self.a.nodes)]
        epoch = succession.epoch_zero(order[0], order)
        board = succession.Board(self.job_dir, 0)
        decided: dict[int, Any] = {}
        go = threading.Event()

        def one(r: int) -> None:
            go.wait()
            self.fs.local.owner = r
            e = succession.run_election(board, epoch, host_name(r), order=order, min_nodes=1)
            decided[r] = (time.time(), e.epoch.index if e.epoch else None,
                          e.epoch.host if e.epoch else None, len(e.epoch.members) if e.epoch else 0)

        if self.a.no_election:
            wait_for(ctl, "elect")
            return {"decided": {}, "fs_ops": 0}
        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in self.ranks if r != 0]
        for t in threads:
            t.start()
        wait_for(ctl, "elect")
        before = dict(self.fs.counts)
        go.set()
        for t in threads:
            t.join()
        ops = {r: self.fs.counts.get(r, 0) - before.get(r, 0) for r in decided}
        return {"decided": {str(r): v for r, v in decided.items()},
                "fs_ops": sum(ops.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--job-dir", required=True)
    p.add_argument("--ctl", required=True)
    p.add_argument("--observers", type=int, default=8)
    p.add_argument("--join-timeout", type=float, default=600.0)
    p.add_argument("--skip-liveness", action="store_true", help="no join, keepalive, detection")
    p.add_argument("--no-join", action="store_true", help="no rendezvous handlers (join skipped)")
    p.add_argument("--no-election", action="store_true", help="the election phase is skipped")
    p.add_argument("--rdzv", choices=("launcher", "c10d"), default="launcher",
                   help="the launcher's rendezvous (listed first round) or torch's c10d alone")
    p.add_argument("--keep-alive", type=float, default=0.0,
                   help="the rendezvous keep_alive_interval (s) instead of rdzv_conf's")
    p.add_argument("--beacons-per-thread", type=int, default=1,
                   help="nodes whose beacons one driver thread steps (1: each its own thread)")
    a = p.parse_args(argv)
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(512 << 10)
    host = Host(a)
    ctl = host.ctl
    if not a.skip_liveness and not a.no_join:
        host.make_handlers(a.join_timeout)
    answer(ctl, "ready", {})
    if wait_for(ctl, "join").get("skip"):
        answer(ctl, "joined", {"done": {}, "errors": [], "rdzv_requests": 0})
    else:
        answer(ctl, "joined", host.join())
    go = wait_for(ctl, "load", timeout_s=600)
    if go.get("skip"):
        answer(ctl, "load", {})
    else:
        host.start_beacons()
        answer(ctl, "beating", host.beating(go["timeout_s"]))
        answer(ctl, "load", host.window(wait_for(ctl, "window", timeout_s=600)))
        host.stop_liveness()
    answer(ctl, "records", host.records(wait_for(ctl, "records")))
    answer(ctl, "elect", host.elect(ctl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
