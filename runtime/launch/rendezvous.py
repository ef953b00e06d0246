"""The rendezvous: a first round formed from the known node list in O(N), torch's c10d after.

torch's c10d dynamic rendezvous keeps its whole state (every participant and its last
keep-alive, O(N) bytes) in one store key that each joining node rewrites by compare-and-set,
retried at once on a collision: N nodes joining together make up to N(N+1)/2 attempts of O(N)
bytes (pytorch/pytorch#117066). Measured with the scale harness (docs/scale.md): 64 nodes
joined in 5 s to 112 s by load, 128 and 256 never within 300 s; on real nodes the store's one
loop needs >= 45 s at 1,024.

Here the launcher knows, before torch's agent starts, every node that should come: the
Slurm node list (or the current succession epoch's members), or the ``hpc run`` launchers.
So the first round is formed from that list with per-node keys (the ``hpc-static`` handler
registered with torch's handler registry, :class:`ListedFirstRound`):

1. each node claims its own key ``node/<node rank>`` (one compare-and-set, which also tells a
   restarted launcher that it already came) and adds one to the ``arrived`` counter;
2. the host (the store's owner, ``is_host``) polls the counter (one request per
   :data:`POLL_S`, however many nodes) and writes one ``decision`` key when all listed nodes
   arrived, or, with ``MIN < MAX``, ``last_call_timeout`` after MIN did (which ones: one
   ``check`` per listed key, once): the rule of c10d's round (:func:`decide`, pure);
3. every other node waits on the decision key (one blocking request), reads it (O(1) bytes:
   the missing node ranks, none normally) and takes its rank from its place in the node
   order: the host is rank 0.

About 5 requests and O(1) bytes per node: O(N) in total. Later rounds (a restart after a
failure, a late joiner, a re-formation of survivors) are torch's c10d handler's, unchanged,
and so are its keep-alives (every :func:`runtime.launch.main.rdzv_conf` interval, N/200 s
above 200 nodes). To move the others there, a node that leaves the listed round (to rejoin
after its workers failed, or arriving after the decision) adds one to the ``waiting`` counter,
which :meth:`ListedFirstRound.num_nodes_waiting` reports: the agents restart their workers
and meet in c10d's round, as torch's wait list would make them.

Used when every launcher is known and takes part (:func:`choose`): two or more nodes and no
hot spares (torch's redundancy list holds the spares, only in c10d's own rounds). Otherwise
c10d from the start, as before; the launcher logs which.
"""

from __future__ import annotations

import bisect
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger("hpc.launch")

BACKEND = "hpc-static"
HELD_C10D = "hpc-c10d"   # c10d's own handler, its store on the socket the launcher inherited
LISTEN_FD = "listen_fd"  # the rendezvous config naming that socket (hpc run's node 0)
POLL_S = 0.1            # the host's poll of the arrival counter
WAITING_CACHE_S = 1.0   # num_nodes_waiting asks the store at most this often (as c10d's cache)


@dataclass(frozen=True)
class Choice:
    """Which rendezvous the launcher runs, with the configs torch's agent passes on."""

    backend: str
    configs: dict[str, Any]
    reason: str


def choose(*, node_rank: int, expected: int, min_nodes: int, max_nodes: int, spares: int,
           configs: dict[str, Any]) -> Choice:
    """The listed first round when every launcher is known and takes part, else c10d (pure).

    Args:
        node_rank: This node's index in the node order (0 .. expected - 1).
        expected: How many launchers come (Slurm's node list, the epoch's members, ``hpc run``'s).
        min_nodes: MIN of ``--nodes MIN:MAX``.
        max_nodes: MAX.
        spares: Hot spares (``--spare-nodes``).
        configs: c10d's rendezvous configs (:func:`runtime.launch.main.rdzv_conf`, ``is_host``).
    """
    if spares:
        return Choice("c10d", configs, f"c10d: {spares} hot spare(s) wait on torch's redundancy list")
    if expected < 2:
        return Choice("c10d", configs, "c10d: a single node")
    if expected > max_nodes or expected < min_nodes or not 0 <= node_rank < expected:
        return Choice("c10d", configs, f"c10d: {expected} launchers for {min_nodes}:{max_nodes} nodes, "
                                       f"this node's rank {node_rank}")
    return Choice(BACKEND, dict(configs, node_rank=node_rank, expected=expected),
                  f"first round from the node list ({expected} nodes, per-node keys), later rounds c10d")


def on_socket(choice: Choice, fd: int) -> Choice:
    """``choice`` with the host's store serving on ``fd``, a listening socket the launcher
    inherited (``hpc run`` binds it on loopback and hands it to node 0): c10d becomes
    :data:`HELD_C10D`, its handler unchanged (pure)."""
    return Choice(HELD_C10D if choice.backend == "c10d" else choice.backend,
                  dict(choice.configs, **{LISTEN_FD: fd}),
                  f"{choice.reason}; the store on the inherited socket (fd {fd})")


def decide(arrived: int, expected: int, min_nodes: int, *, now: float, min_since: float | None,
           last_call_s: float, deadline: float) -> str | None:
    """The host's decision on the listed round (pure): ``"all"``, ``"some"`` (MIN reached
    ``last_call_s`` ago: the ones arrived), ``"timeout"``, or None (wait)."""
    if arrived >= expected:
        return "all"
    if min_since is not None and arrived >= min_nodes and now - min_since >= last_call_s:
        return "some"
    if now >= deadline:
        return "timeout"
    return None


def members_of(decision: dict[str, Any]) -> list[int]:
    """The node ranks in the round, in order, from the decision key's content (pure)."""
    missing = set(decision.get("missing", ()))
    return [r for r in range(decision["expected"]) if r not in missing]


class ListedFirstRound:
    """torch's ``RendezvousHandler`` whose first round is the listed one, the rest c10d's."""

    def __init__(self, params: Any, store: Any, inner: Any) -> None:
        self.params = params
        self.store = store              # the c10d rendezvous store (the host owns its server)
        self.raw_store = store          # the same, for the round's PrefixStore (the harness
                                        # counts the requests through ``store``)
        self.inner = inner              # torch's DynamicRendezvousHandler on the same store
        self.node_rank = int(params.config["node_rank"])
        self.expected = int(params.config["expected"])
        # The decider: the store's owner (``is_host``) unless told (the scale harness's store
        # runs in a process of its own).
        self.decider = bool(params.get_as_bool("decider", params.get_as_bool("is_host", False)))
        self.prefix = f"hpc.rendezvous.{params.run_id}."
        self.listed = False             # in the listed round (its workers run)
        self.rounds = 0
        self._waiting = (float("-inf"), 0)   # (when asked, the answer): num_nodes_waiting's cache
        self.c10d_every_s = max(WAITING_CACHE_S, float(params.get_as_int("keep_alive_interval", 1) or 1))

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _call(self, op: str, *args: Any) -> Any:
        """One store request; a failed one is torch's ``RendezvousConnectionError``, as in
        c10d's backend: the launcher takes it for a lost rendezvous host (succession)."""
        try:
            return getattr(self.store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as e:
            raise _lost(e) from e

    # --- torch's RendezvousHandler ----------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND   # torch's registry checks the handler's name against the asked one

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def shutdown(self) -> bool:
        return self.inner.shutdown()

    def num_nodes_waiting(self) -> int:
        """In the listed round: the nodes that left it or came after it (they wait in c10d's),
        asked at most once a second (one ``add``). In c10d's rounds: c10d's wait list, asked
        at most once per keep-alive interval: each ask reads c10d's whole O(N) state (torch's
        agent asks every 0.5 s, its cache lasts 1 s: O(N^2) bytes a second at every node's
        ask), so with N/200-s intervals above 200 nodes it is O(N) bytes a second."""
        at, n = self._waiting
        if time.monotonic() - at < (WAITING_CACHE_S if self.listed else self.c10d_every_s):
            return n
        n = int(self._call("add", self._key("waiting"), 0)) if self.listed else self.inner.num_nodes_waiting()
        self._waiting = (time.monotonic(), n)
        return n

    def next_rendezvous(self) -> Any:
        self.rounds += 1
        self._waiting = (float("-inf"), 0)
        if self.rounds == 1:
            info = self._listed_round()
            if info is not None:
                return info
        elif self.listed:
            self.listed = False
            self._call("add", self._key("waiting"), 1)   # the others: meet in c10d's round
        return self.inner.next_rendezvous()

    # --- the listed round -------------------------------------------------------------------
    def _listed_round(self) -> Any | None:
        """This node's place in the listed round, or None: it came late (c10d's round then)."""
        timeout_s = float(self.params.get_as_int("join_timeout", 600))
        first = self.arrive()
        decision = self.decide_round(timeout_s) if self.decider else self.await_decision(timeout_s)
        place = self.place(decision, first)
        return None if place is None else self._info(*place)

    def arrive(self) -> bool:
        """Claims this node's key and counts it in (2 requests); False: it was claimed before
        (this launcher was restarted), then the node is not counted again."""
        token = uuid.uuid4().hex
        mine = self._call("compare_set", self._key(f"node/{self.node_rank}"), "", token)
        first = _text(mine) == token
        if first:
            self._call("add", self._key("arrived"), 1)
        return first

    def await_decision(self, timeout_s: float) -> dict[str, Any]:
        """A node other than the host: the host's decision (2 requests, O(1) bytes normally)."""
        from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

        start = time.monotonic()
        try:
            self.store.wait([self._key("decision")], timedelta(seconds=timeout_s))
        except Exception as e:  # TCPStore's wait raises on its timeout, and on a lost store
            if time.monotonic() - start < timeout_s - 1:
                raise _lost(e) from e
            raise RendezvousTimeoutError(
                f"no decision on the listed rendezvous round within {timeout_s:.0f} s: {e}") from e
        return json.loads(self._call("get", self._key("decision")))

    def place(self, decision: dict[str, Any], first: bool) -> tuple[int, int] | None:
        """This node's (rank, world size) in the decided round, or None: it is not in it and
        waits in c10d's round (one request tells the members)."""
        from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

        if decision.get("timeout"):
            raise RendezvousTimeoutError(
                f"the listed rendezvous round of {self.expected} nodes did not reach "
                f"{self.params.min_nodes} in time ({decision.get('arrived')} arrived)")
        missing = sorted(set(decision.get("missing", ())))
        if not first or self.node_rank in missing:
            log.warning("rendezvous: this node (rank %d) came after the listed round was formed "
                        "(%s); joining torch's c10d round", self.node_rank,
                        "its key was already claimed" if not first else "not among its members")
            self._call("add", self._key("waiting"), 1)
            return None
        self.listed = True
        # Its place among the members in node order: O(missing), not O(N), work per node.
        return self.node_rank - bisect.bisect_left(missing, self.node_rank), self.expected - len(missing)

    def decide_round(self, timeout_s: float) -> dict[str, Any]:
        """The host: waits for the listed nodes as c10d's round would, writes the decision."""
        last_call_s = float(self.params.get_as_int("last_call_timeout", 30))
        start = time.monotonic()
        min_since = None
        while True:
            arrived = int(self._call("add", self._key("arrived"), 0))
            now = time.monotonic()
            if min_since is None and arrived >= self.params.min_nodes:
                min_since = now
            verdict = decide(arrived, self.expected, self.params.min_nodes, now=now, min_since=min_since,
                             last_call_s=last_call_s, deadline=start + timeout_s)
            if verdict is not None:
                break
            time.sleep(POLL_S)
        decision: dict[str, Any] = {"expected": self.expected, "arrived": arrived}
        if verdict == "timeout":
            decision["timeout"] = True
        elif verdict == "some":
            keys = [self._key(f"node/{r}") for r in range(self.expected)]
            decision["missing"] = [r for r, k in enumerate(keys) if not self._call("check", [k])]
        self._call("set", self._key("decision"), json.dumps(decision))
        log.info("rendezvous: listed round formed: %d of %d nodes in %.1f s (%s)",
                 len(members_of(decision)) if verdict != "timeout" else 0, self.expected,
                 time.monotonic() - start, verdict)
        return decision

    def _info(self, rank: int, world_size: int) -> Any:
        """torch's ``RendezvousInfo`` for the listed round (what c10d's handler returns); the
        workers' master address and port as ``RendezvousStoreInfo.build`` shares them (rank 0
        sets, the others read: 2 requests each)."""
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
        from torch.distributed.elastic.utils.distributed import get_free_port

        prefix = self.prefix + "round."
        addr_key, port_key = (prefix + RendezvousStoreInfo.MASTER_ADDR_KEY,
                              prefix + RendezvousStoreInfo.MASTER_PORT_KEY)
        if rank == 0:
            addr = self.params.local_addr or _fqdn()
            if self.use_agent_store:   # as torch's handler: rank 0 serves the workers' store
                self._server = dist.TCPStore(addr, 0, is_master=True, multi_tenant=True)
                port = self._server.port
            else:
                port = get_free_port()
            self._call("set", addr_key, addr)
            self._call("set", port_key, str(port))
        addr = _text(self._call("get", addr_key))
        port = int(_text(self._call("get", port_key)))
        log.info("rendezvous: rank %d of %d in the listed round", rank, world_size)
        return RendezvousInfo(dist.PrefixStore(prefix, self.raw_store), rank, world_size,
                              RendezvousStoreInfo(master_addr=addr, master_port=port))


def _lost(e: BaseException) -> Exception:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    return RendezvousConnectionError(
        f"The connection to the C10d store has failed ({type(e).__name__}: {e}).")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fqdn() -> str:
    import socket
    return socket.getfqdn()


_SERVED: set[int] = set()   # inherited sockets a store took: each serves one store


def _c10d_backend(params: Any) -> tuple[Any, Any]:
    """c10d's rendezvous backend and its store: torch's, except that the host's first store
    serves on the inherited socket :data:`LISTEN_FD` names (nobody can have taken the port)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend, create_backend)

    fd = params.config.get(LISTEN_FD)
    if fd is None or int(fd) in _SERVED or not params.get_as_bool("is_host", False):
        return create_backend(params)
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    _SERVED.add(int(fd))
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    store = dist.TCPStore(host, port, is_master=True, multi_tenant=True, master_listen_fd=int(fd),
                          timeout=timedelta(seconds=params.get_as_int("read_timeout", 60)))
    log.info("rendezvous: the store serves on the inherited socket %s:%d (fd %d)", host, port, fd)
    return C10dRendezvousBackend(store, params.run_id), store


def create(params: Any) -> ListedFirstRound:
    """torch's handler creator for :data:`BACKEND` (c10d's store and handler inside)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = _c10d_backend(params)
    return ListedFirstRound(params, store, create_handler(store, backend, params))


def create_held(params: Any) -> Any:
    """torch's handler creator for :data:`HELD_C10D`: c10d's handler, named so."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class Held(C10dRendezvousBackend):
        @property
        def name(self) -> str:   # the handler's name, which torch's registry checks
            return HELD_C10D

    _, store = _c10d_backend(params)
    return create_handler(store, Held(store, params.run_id), params)


def register() -> None:
    """Registers :data:`BACKEND` and :data:`HELD_C10D` with torch's rendezvous handler
    registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create)
    rendezvous_handler_registry.register(HELD_C10D, create_held)

