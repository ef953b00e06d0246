"""The listed first rendezvous round (runtime/launch/rendezvous.py): its rule, and its store cost.

The cost is counted on an in-memory store that answers the handful of TCPStore calls the round
makes (pure logic: the real TCPStore path runs in tests/distributed/test_listed_rendezvous_local.py and
in the 64-node harness test). torch's c10d round needs up to N(N+1)/2 compare-and-sets of O(N)
bytes; this one must stay O(1) requests and bytes per node at 10,000 nodes.
"""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from runtime.launch import rendezvous
from runtime.launch.main import rdzv_conf
from runtime.launch.rendezvous import BACKEND, ListedFirstRound, choose, decide, members_of


class CountingStore:
    """The TCPStore calls of the listed round, in memory; every call counted with its bytes."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.requests = 0
        self.bytes = 0

    def _count(self, *parts: object) -> None:
        self.requests += 1
        self.bytes += sum(len(p) if isinstance(p, (str, bytes)) else 8 for p in parts)

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        self._count(key, n)
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if key not in self.data and expected == "":
            self.data[key] = desired.encode()
        out = self.data.get(key, expected.encode())
        self._count(key, expected, desired, out)
        return out

    def check(self, keys: list[str]) -> bool:
        self._count(*keys)
        return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: object) -> None:
        self._count(*keys)
        if not all(k in self.data for k in keys):
            raise RuntimeError("Socket Timeout")

    def get(self, key: str) -> bytes:
        self._count(key, self.data[key])
        return self.data[key]

    def set(self, key: str, value: str) -> None:
        self._count(key, value)
        self.data[key] = value.encode() if isinstance(value, str) else value


def handler(store: CountingStore, node_rank: int, expected: int, *, nodes: tuple[int, int] | None = None,
            last_call: int | None = None) -> ListedFirstRound:
    lo, hi = nodes or (expected, expected)
    conf = dict(rdzv_conf(hi), is_host=node_rank == 0)
    if last_call is not None:
        conf["last_call_timeout"] = last_call
    choice = choose(node_rank=node_rank, expected=expected, min_nodes=lo, max_nodes=hi, spares=0, configs=conf)
    assert choice.backend == BACKEND
    params = RendezvousParameters(BACKEND, "127.0.0.1:1", "job-1", lo, hi, **choice.configs)
    return ListedFirstRound(params, store, inner=None)


def join_all(n: int, *, arrive: range | None = None, nodes: tuple[int, int] | None = None,
             last_call: int | None = None) -> tuple[CountingStore, dict[int, tuple[int, int] | None]]:
    """Every node's join, in the order a real start makes them: the others arrive and wait, the
    host decides, the others read the decision."""
    store = CountingStore()
    hs = {r: handler(store, r, n, nodes=nodes, last_call=last_call) for r in (arrive or range(n))}
    first = {r: h.arrive() for r, h in hs.items()}
    decision = hs[0].decide_round(60.0)
    places = {0: hs[0].place(decision, first[0])}
    for r, h in hs.items():
        if r:
            places[r] = h.place(h.await_decision(60.0), first[r])
    return store, places


def test_the_launcher_takes_the_listed_round_only_when_every_launcher_is_known_and_takes_part():
    conf = dict(rdzv_conf(4), is_host=True)
    listed = choose(node_rank=2, expected=4, min_nodes=2, max_nodes=4, spares=0, configs=conf)
    assert listed.backend == BACKEND and listed.configs["node_rank"] == 2 and listed.configs["expected"] == 4
    assert listed.configs["is_host"] is True and listed.configs["join_timeout"] == conf["join_timeout"]
    assert choose(node_rank=0, expected=3, min_nodes=2, max_nodes=2, spares=1, configs=conf).backend == "c10d"
    assert choose(node_rank=0, expected=1, min_nodes=1, max_nodes=1, spares=0, configs=conf).backend == "c10d"
    assert choose(node_rank=0, expected=5, min_nodes=2, max_nodes=4, spares=0, configs=conf).backend == "c10d"
    assert choose(node_rank=4, expected=4, min_nodes=4, max_nodes=4, spares=0, configs=conf).backend == "c10d"


def test_the_host_decides_as_c10d_completes_a_round():
    kw = dict(last_call_s=2.0, deadline=100.0)
    assert decide(4, 4, 2, now=1.0, min_since=0.5, **kw) == "all"
    assert decide(3, 4, 2, now=1.0, min_since=0.5, **kw) is None          # last call still open
    assert decide(3, 4, 2, now=2.6, min_since=0.5, **kw) == "some"
    assert decide(3, 4, 4, now=50.0, min_since=None, **kw) is None        # MIN = MAX: waits for all
    assert decide(3, 4, 4, now=100.0, min_since=None, **kw) == "timeout"
    assert members_of({"expected": 5, "missing": [1, 3]}) == [0, 2, 4]


@pytest.mark.parametrize("n", [3, 64])
def test_every_node_gets_its_rank_from_the_node_order_and_the_host_is_rank_0(n: int):
    _, places = join_all(n)
    assert places == {r: (r, n) for r in range(n)}


def test_10000_nodes_join_with_o1_store_requests_and_bytes_per_node():
    small, _ = join_all(100)
    big, places = join_all(10_000)
    assert all(places[r] == (r, 10_000) for r in (0, 1, 5_000, 9_999))
    per_node_small, per_node_big = small.requests / 100, big.requests / 10_000
    # 5 requests a node (claim, count, wait, read; the host's few polls): no growth with N.
    assert per_node_big <= 6, per_node_big
    assert per_node_big <= per_node_small * 1.1, (per_node_small, per_node_big)
    assert big.bytes / 10_000 <= 400, big.bytes / 10_000            # c10d: O(N) bytes a request
    assert big.bytes / 10_000 <= 1.2 * small.bytes / 100


def test_with_min_below_max_the_round_forms_after_the_last_call_and_a_late_node_is_waited_for():
    _, places = join_all(4, arrive=range(3), nodes=(2, 4), last_call=0)
    assert places == {0: (0, 3), 1: (1, 3), 2: (2, 3)}
    store = CountingStore()
    hs = {r: handler(store, r, 4, nodes=(2, 4), last_call=0) for r in range(4)}
    for r in range(3):
        hs[r].arrive()
    decision = hs[0].decide_round(60.0)
    assert decision["missing"] == [3]
    assert hs[1].place(decision, True) == (1, 3)
    assert hs[1].num_nodes_waiting() == 0
    late = hs[3]
    assert late.place(late.await_decision(60.0), late.arrive()) is None   # to c10d's round
    hs[1]._waiting = (float("-inf"), 0)
    assert hs[1].num_nodes_waiting() == 1      # the members restart and meet it in c10d's round


def test_a_restarted_launcher_is_not_counted_twice_and_waits_in_c10d():
    store = CountingStore()
    a, b = handler(store, 1, 2), handler(store, 1, 2)
    assert a.arrive() is True and b.arrive() is False
    assert store.data["hpc.rendezvous.job-1.arrived"] == b"1"


def test_a_round_that_never_reaches_min_ends_in_a_rendezvous_timeout():
    store = CountingStore()
    host = handler(store, 0, 3)
    host.params.config["join_timeout"] = 0
    host.arrive()
    with pytest.raises(RendezvousTimeoutError, match="did not reach 3"):
        host.place(host.decide_round(0.0), True)
    other = handler(store, 1, 3)
    with pytest.raises(RendezvousTimeoutError):
        other.place(other.await_decision(1.0), other.arrive())


def test_the_handler_is_registered_under_its_name():
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous.register()
    rendezvous.register()     # idempotent: each agent run of a launcher registers it
    assert rendezvous_handler_registry._registry[BACKEND] is rendezvous.create


def test_a_lost_store_is_a_rendezvous_connection_error_as_in_c10d():
    # The launcher takes a RendezvousError for a lost rendezvous host (succession); a raw
    # store error would end the allocation as "the elastic agent failed".
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError

    class Gone(CountingStore):
        def add(self, key: str, n: int) -> int:
            raise RuntimeError("Connection reset by peer")

        def wait(self, keys: list[str], timeout: object) -> None:
            raise RuntimeError("Connection reset by peer")

    _, places = join_all(2)
    h = handler(Gone(), 1, 2)
    h.listed = True
    with pytest.raises(RendezvousConnectionError) as got:
        h.num_nodes_waiting()
    assert isinstance(got.value, RendezvousError)
    with pytest.raises(RendezvousConnectionError):
        h.await_decision(60.0)


def test_in_c10d_rounds_the_whole_state_is_read_once_per_keep_alive_interval_not_each_ask():
    # torch's agent asks num_nodes_waiting every 0.5 s; each c10d answer reads its O(N) state.
    class Inner:
        asks = 0

        def num_nodes_waiting(self) -> int:
            Inner.asks += 1
            return 0

        def next_rendezvous(self) -> str:
            return "c10d round"

    store = CountingStore()
    h = handler(store, 1, 1024)
    h.inner = Inner()
    assert h.c10d_every_s == rdzv_conf(1024)["keep_alive_interval"] == 5
    h.rounds = 1                      # the listed round is behind it
    assert h.next_rendezvous() == "c10d round"
    for _ in range(20):
        h.num_nodes_waiting()
    assert Inner.asks == 1
    small = handler(CountingStore(), 1, 3)
    assert small.c10d_every_s == 1.0   # up to 200 nodes as c10d's own 1-s cache
