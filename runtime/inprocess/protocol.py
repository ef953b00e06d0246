"""In-process recovery: the store-key protocol between workers and launchers (torch-free).

With ``--recovery inprocess`` a worker that loses a peer does not die: the survivors leave the
failed step, agree in the job's store on a new *generation* (members, ranks, world size, the
step to go on from and which member holds it), form a new process group under that
generation's prefix, receive the state from that member by broadcast and go on. Every key of
that agreement is declared here, once, with its writer and reader, because three kinds of
process speak it: the workers (``runtime.inprocess.worker``), the per-node launcher (it announces a
dead child at once) and a joining process (a restarted worker or a hot spare).

All keys live in one store that outlives any worker (the launcher's rendezvous store,
``HPC_INPROC_STORE=host:port``), under :func:`namespace` of the workers' rendezvous round
(``hpc/inproc/MASTER_ADDR:MASTER_PORT``: torch picks a new master port each round, so a group
that torch restarted starts a fresh protocol). ``G`` is a generation (0 is the group the
workers started in), ``UID`` a process's identity ``host/pid`` (:func:`uid`).

================================  =========================  ========================================
key                               writer                     reader
================================  =========================  ========================================
``g/G/who/RANK``                  each rank of G, at start   the leader of G+1 (G's members)
``g/G/arrive``                    ``add``: each arrival      its arrival index; the first one leads
``g/G/arrival/I``                 arrival I (:class:`Arrival`)  the leader of G
``g/G/members``                   the leader of G            every arrival (:class:`Members`)
``g/G/lead``                      ``add``: the leader of G,  its followers: the leader is alive and
                                  every ``LEAD_BEAT_S``      still deciding (:func:`leader_silent_s`)
``g/G/pg/...``                    torch (gloo's rendezvous)  torch: G's process group
``fault/G``                       anyone that saw G fail     workers at a step boundary, tools
``dead/UID``                      a launcher, its child died the leader: not waited for
``busy/UID``                      a rank in a long phase     the leader: waited for until the time
``join/N``, ``join/count``        a joiner (:class:`Arrival`)  rank 0's fault watch, the next leader
``join/admitted``                 the leader of G            rank 0, leaders: joiners before it are taken
``replace/UID``                   a launcher restarting UID  the leader: wait for a joiner until then
``generation``                    the leader of G (``G``)    joiners, tools: the newest generation
``node/N``                        node N's launcher: its     a peer's launcher that names node N
                                  workers' uids (JSON list)  lost: whom to announce dead
``current`` (at ``ROOT``)         rank 0 of a round          a spare's joiners: the round's namespace
``lifelines`` (at ``ROOT``)       the store host's launcher  workers, launchers: the port of its
                                  (its lifeline listener)    lifeline listener (a closed line: dead)
``done``                          rank 0, the job finished   waiting joiners: leave, not needed
``sharded``                       rank 0 of a sharded job    leaders: ranks are kept (joiners fill
                                  (FSDP2 under recovery)     the lost ranks), :func:`plan_members`
``fallback``                      a worker that found the    launchers: replace nobody, end the
                                  state not in memory (why)  joiners, torch's restart path
================================  =========================  ========================================

The leader of ``G`` (its first arrival) closes the membership by the pure rule
:func:`close_decision`: everyone of ``G-1`` that is not dead and not silent has arrived,
or the join window ran out (a member that announced a long phase in ``busy/UID`` is waited
for until its announced time). :func:`plan_members` then orders the arrivals by their old
rank (so ranks keep their order), picks the newest step any arrival holds and its first
holder as the source of the state. Every value is JSON (:func:`encode`).

While it decides, the leader counts ``g/G/lead`` up every :data:`LEAD_BEAT_S`; a follower
waits for ``g/G/members`` as long as that count moves, and goes to ``G+1`` only when it has
stood still for :func:`leader_silent_s` (the leader died while closing). The leader may wait
minutes (a member in an announced long phase), so a follower bounded by its own clock alone
would open ``G+1`` beside a live leader: two worlds training at once. The count is compared
with itself on the follower's own clock, never with another host's clock.

**A second fault during a recovery** (a member of the new generation dies while its group
forms, or during the state transfer): the survivors re-form again, each arriving with the
step it still holds whole after the failed try (:func:`held_after`: a rank that had begun to
load the received state holds none, :data:`HOLDS_NOTHING`, and is never the source); when no
arrival holds any step whole the leader closes the generation without a source
(:func:`unsourced`) and every member gives up in-process recovery (``fallback``).

**Joining** (a worker the launcher restarted, a hot spare's worker; issues 26, 27): the
joiner writes its :class:`Arrival` with ``step=-1`` under ``join/N`` (``N`` from
``add("join/count", 1)``) and waits on ``generation`` until a closed generation lists it. The
members take joiners in at the next generation they open, up to the job's largest world
(:func:`admit`): at a fault's re-form (a launcher that restarts a dead worker first promises
its replacement in ``replace/UID``, and the leader waits for it, so the world keeps its size),
or at a step boundary: rank 0's fault watch sees ``join/count`` pass ``join/admitted`` and
raises a flag in the preemption agreement that already runs every ~0.1 s, so every member
opens the next generation at the same step. The joiner then receives the state like any
member behind the agreed step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from hpc.contract import jobsecret


ROOT = "hpc/inproc/"   # + MASTER_ADDR:MASTER_PORT (namespace)
LIFELINES = "lifelines"   # under ROOT (no namespace): the port of the store host's lifeline listener
COMING_S = 60.0   # a member that said it is coming (alive, finishing a wait) is waited for this long
LEAD_BEAT_S = 1.0   # a deciding leader counts g/G/lead up this often


def uid(host: str, pid: int) -> str:
    """A worker's identity in the protocol: stable for its life, never reused in a job."""
    return f"{host}/{pid}"


def who(gen: int, rank: int) -> str:
    return f"g/{gen}/who/{rank}"


def arrive(gen: int) -> str:
    return f"g/{gen}/arrive"


def arrival(gen: int, index: int) -> str:
    return f"g/{gen}/arrival/{index}"


def members(gen: int) -> str:
    return f"g/{gen}/members"


def lead(gen: int) -> str:
    return f"g/{gen}/lead"


def pg_prefix(gen: int) -> str:
    return f"g/{gen}/pg/"


def coming(gen: int, worker: str) -> str:
    return f"g/{gen}/coming/{worker}"


def fault(gen: int) -> str:
    return f"fault/{gen}"


def dead(worker: str) -> str:
    return f"dead/{worker}"


def busy(worker: str) -> str:
    return f"busy/{worker}"


def join(index: int) -> str:
    return f"join/{index}"


def replace(worker: str) -> str:
    return f"replace/{worker}"


def node_workers(node_rank: int) -> str:
    return f"node/{node_rank}"


JOIN_COUNT = "join/count"
JOIN_ADMITTED = "join/admitted"
JOINER_RANK = 1 << 20   # a joiner's old_rank is this + its join index (after every survivor)
GENERATION = "generation"
CURRENT = "current"     # under ROOT (no namespace): the namespace of the running round
DONE = "done"
SHARDED = "sharded"     # "1": rank r owns shard r; a re-form keeps every member's rank
FALLBACK = "fallback"   # why the workers gave up in-process recovery (launchers: restart path)


def namespace(master_addr: str, master_port: int | str) -> str:
    """The prefix of every key of one rendezvous round's workers (a ``PrefixStore``'s: it
    joins prefix and key with ``/``)."""
    return f"{ROOT}{master_addr}:{master_port}"


@dataclass(frozen=True)
class Rebind:
    """A new rendezvous epoch's store for the workers a launcher kept through its host's loss.

    The launcher writes it (JSON, atomically) to the node-local file named by
    :data:`CHANNEL_ENV` once the new epoch's agent has its round; the workers, whose store
    died with the old host, read it and re-form in that store (no history in it: they know
    the last generation's members from memory, and mark those on the lost nodes dead).

    Attributes:
        epoch: The new rendezvous epoch's index.
        store: ``host:port`` of its store.
        space: The new round's :func:`namespace` (its launchers announce deaths there).
        members: The epoch's nodes (host names); a worker on any other host is lost.
    """

    epoch: int
    store: str
    space: str
    members: tuple[str, ...]

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Rebind:
        d = json.loads(raw)
        return cls(epoch=int(d["epoch"]), store=str(d["store"]), space=str(d["space"]),
                   members=tuple(str(m) for m in d["members"]))


@dataclass(frozen=True)
class Hello:
    """The first line on a lifeline (:mod:`runtime.inprocess.launcher.lifelines`): who holds it,
    signed with the job's key (:mod:`hpc.contract.jobsecret`): a line whose hello is not
    signed so is not one of the job's and is dropped unread.

    Args:
        kind: ``worker`` or ``launcher``.
        uid: The process (:func:`uid`).
        parent: A worker's launcher (its parent process's :func:`uid`).
        space: A worker's namespace (:func:`namespace`): where its death is announced.
    """

    kind: str
    uid: str
    parent: str = ""
    space: str = ""

    def _body(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    def line(self, key: bytes) -> bytes:
        """The hello as sent: its fields and their signature under ``key``, one line."""
        d = {**asdict(self), "sig": jobsecret.sign(key, self._body())}
        return (json.dumps(d, sort_keys=True) + "\n").encode()

    @staticmethod
    def parse(raw: bytes | str, key: bytes) -> Hello:
        """The hello of a line; ``ValueError`` when it is malformed or not signed with ``key``."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("a hello is a JSON object")
        hello = Hello(kind=str(d["kind"]), uid=str(d["uid"]), parent=str(d.get("parent", "")),
                      space=str(d.get("space", "")))
        if not jobsecret.valid(key, hello._body(), str(d.get("sig", ""))):
            raise ValueError(f"a hello from {hello.uid!r} not signed with the job's key")
        return hello


LIFELINE_BYE = b"bye\n"   # a line's last words when its process ends on purpose


@dataclass(frozen=True)
class Arrival:
    """One process arriving at a generation (a survivor, or a joiner with ``step=-1``).

    Args:
        uid: The process (:func:`uid`).
        old_rank: Its rank in the previous generation (a joiner: a large number, so it
            comes after the survivors).
        step: The newest step whose state it holds whole (``-1``: none, a joiner).
        host: Its host name (for logs and events).
    """

    uid: str
    old_rank: int
    step: int
    host: str = ""


@dataclass(frozen=True)
class Members:
    """A closed generation: who is in it, in rank order, and where the state comes from.

    Args:
        gen: The generation.
        uids: The members; a member's rank is its index.
        step: The step every member goes on from (the newest any member holds whole).
        source: The rank that holds ``step`` and broadcasts the state.
        reason: Why the generation was opened (a fault, a join).
        left: Members of the previous generation not in this one.
        in_row: How many generations in a row went on from this same ``step`` (this one
            included): no step completed between their faults (:func:`in_row`).
    """

    gen: int
    uids: tuple[str, ...]
    step: int
    source: int
    reason: str = ""
    left: tuple[str, ...] = ()
    in_row: int = 1

    @property
    def world_size(self) -> int:
        return len(self.uids)

    def rank_of(self, worker: str) -> int | None:
        return self.uids.index(worker) if worker in self.uids else None


def encode(record: Arrival | Members) -> str:
    return json.dumps(asdict(record), sort_keys=True)


def decode_arrival(raw: bytes | str) -> Arrival:
    d = json.loads(raw)
    return Arrival(uid=str(d["uid"]), old_rank=int(d["old_rank"]), step=int(d["step"]),
                   host=str(d.get("host", "")))


def decode_members(raw: bytes | str) -> Members:
    d = json.loads(raw)
    return Members(gen=int(d["gen"]), uids=tuple(d["uids"]), step=int(d["step"]),
                   source=int(d["source"]), reason=str(d.get("reason", "")),
                   left=tuple(d.get("left", ())), in_row=int(d.get("in_row", 1)))


HOLDS_NOTHING = -1   # an arrival's step: it holds no training step whole (a joiner, a half-loaded rank)
UNTOUCHED = "untouched"   # a failed recovery had not begun to overwrite this rank's state
LOADING = "loading"       # it had begun to load the received state, and not finished
LOADED = "loaded"         # it had loaded the received state whole (the agreed step's)
