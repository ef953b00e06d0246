"""In-process recovery: the store-key protocol between workers and launchers (torch-free).

With ``--recovery inprocess`` a worker that loses a peer does not die: the survivors leave the
failed step, agree in the job's store on a new *generation* (members, ranks, world size, the
step to go on from and which member holds it), form a new process group under that
generation's prefix, receive the state from that member by broadcast and go on. Every key of
that agreement is declared here, once, with its writer and reader, because three kinds of
process speak it: the workers (``runtime.worker.inprocess``), the per-node launcher (it announces a
dead child at once) and a joining process (a restarted worker or a hot spare, issue 27).

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
import math
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from hpc.contract import jobsecret
from hpc.contract.errors import SpecError

ROOT = "hpc/inproc/"   # + MASTER_ADDR:MASTER_PORT (namespace)
STORE_ENV = "HPC_INPROC_STORE"      # host:port of the store that outlives the workers
RECOVERY_ENV = "HPC_RECOVERY"       # "inprocess" or "restart" (the job's --recovery)
TIMEOUT_ENV = "HPC_INPROC_TIMEOUT_S"  # bound of one training collective (else the stall deadline)
WINDOW_ENV = "HPC_INPROC_WINDOW_S"  # how long a leader waits for silent members of the old group
FAULT_ENV = "HPC_TEST_INPROC_FAULT"  # tests: "RANK:STEP:kill|fail|save|repeat", "RANK:GEN:transfer|group|late", comma separated
JOIN_ENV = "HPC_INPROC_JOIN"        # "1": this worker joins a running generation (no rank of its own)
MAX_WORLD_ENV = "HPC_INPROC_MAX_WORLD"  # the largest world joiners may fill (else the starting one)
MAX_REFORMS_ENV = "HPC_INPROC_MAX_REFORMS"  # re-forms in a row at one step before the restart path
CHANNEL_ENV = "HPC_INPROC_CHANNEL"  # node-local file where the launcher names a new epoch's store (Rebind)
WARM_ENV = "HPC_INPROC_WARM"        # "0": a dead worker's joiner starts cold (no warm standby; the launcher reads it)
STANDBY_MODULE = "runtime.worker.standby"   # a warm standby's ``python -m`` module (its command line)
FORK_MODULE = "runtime.worker.forkserver"   # the node's fork server's (its forked workers show it too)
DEFAULT_MAX_REFORMS = 3

# NCCL's settings for in-process recovery: name -> (value, why, values of the user's that leave
# the recovery working). The launcher sets them before torch's elastic agent starts the workers
# (the agent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless its own environment
# has a value: seen on an H200, the recovery then took torch's 1 for the user's and warned);
# the worker (runtime.worker.inprocess.nccl) sets them again where it was started otherwise.
NCCL_ENV: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "0", "torch's watchdog must not end the process on a lost peer's error: the recovery aborts",
        ("0", "2")),   # 2 (CleanUpOnly) aborts the communicators without ending the process
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": (
        "0", "the watchdog must not rethrow an aborted communicator's CUDA error (ends the process)",
        ("0",)),
    "NCCL_NVLS_ENABLE": (
        "0", "NVLink SHARP communicators are not safely aborted (NVIDIA resiliency extension)",
        ("0",)),
}

RESTART = "restart"
INPROCESS = "inprocess"
RECOVERY_MODES = (RESTART, INPROCESS)
# --replacement: when a restarted worker takes a dead one's place (validated by JobSpec.replacement)
WAIT = "wait"        # the survivors' re-form waits for it: world kept, bit-equal numerics
SHRINK = "shrink"    # the survivors go on at world-1 at once; it joins at a later step boundary
REPLACEMENT_MODES = (WAIT, SHRINK)
LIFELINES = "lifelines"   # under ROOT (no namespace): the port of the store host's lifeline listener
DEFAULT_WINDOW_S = 3.0
COMING_S = 60.0   # a member that said it is coming (alive, finishing a wait) is waited for this long
LEAD_BEAT_S = 1.0   # a deciding leader counts g/G/lead up this often


def leader_silent_s(window_s: float) -> float:
    """How long a follower waits for a leader whose ``g/G/lead`` count stands still before it
    goes to the next generation: many beats, so a leader descheduled on a loaded node (or
    its store client in a short reconnect) is not left; a dead one is in under a minute."""
    return window_s * 4 + 30




def parse_recovery(value: object, flag: str = "--recovery") -> str:
    """Validates a recovery mode.

    Raises:
        SpecError: Anything but ``restart`` or ``inprocess``.
    """
    text = str(value).strip().lower() if isinstance(value, str) else value
    if text not in RECOVERY_MODES:
        raise SpecError(flag, value, " or ".join(RECOVERY_MODES), f"{flag} {INPROCESS}",
                        "inprocess keeps the surviving workers and takes the state from a peer; "
                        "restart restarts every worker from the last checkpoint")
    return str(text)


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
COPY_EVERY_ENV = "HPC_INPROC_COPY_EVERY"    # FSDP2: copy the shards to the peer every N steps
COPY_MAX_MB_ENV = "HPC_INPROC_COPY_MAX_MB"  # FSDP2: bound of the peer copies' host memory per rank
DEFAULT_COPY_EVERY = 1
DEFAULT_COPY_MAX_MB = 4096.0


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
class Order:
    """What makes a warm standby (:data:`STANDBY_MODULE`) the worker a cold start would be.

    A standby is a process the launcher started ahead of need, with python, torch and the
    Session already imported; when a worker dies, the launcher writes its joiner's order to
    the standby's stdin (one JSON line) instead of starting a process. The launcher also keeps
    it in the node-local file :func:`order_file`, because ``/proc`` shows the standby's own
    command line and environment: readers of a worker's launch there (the stall watch's
    worker list, a launcher adopting its workers after its host's loss) read the order instead.

    Attributes:
        argv: The worker's whole command line (``python -m runtime.worker SCRIPT ARGS...``).
        env: Its whole environment.
        cwd: Its working directory.
        stdout: The file its output goes to ("" keeps the standby's own).
        stderr: The file its errors go to ("" keeps the standby's own).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    stdout: str = ""
    stderr: str = ""

    def encode(self) -> str:
        return json.dumps({**asdict(self), "env": dict(self.env)}, sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Order:
        d = json.loads(raw)
        return cls(argv=tuple(str(a) for a in d["argv"]), env={str(k): str(v) for k, v in d["env"].items()},
                   cwd=str(d["cwd"]), stdout=str(d.get("stdout") or ""), stderr=str(d.get("stderr") or ""))


def order_file(pid: int) -> str:
    """Where standby ``pid``'s :class:`Order` is kept once it became a worker: node-local and
    memory-backed (``/dev/shm``, else the temporary directory), outside the launcher's heartbeat
    directory (removed when its agent ends, while a worker kept through a host's loss lives on).

    The order holds the worker's whole environment (a W&B key among it): it lies in the user's
    own directory there (:func:`private_dir`), written 0600 (:func:`hpc.contract.jobdir.write_atomic`)."""
    return os.path.join(private_dir(), f"standby-{pid}.json")


def private_dir() -> str:
    """``hpc-<uid>`` in ``/dev/shm`` (else the temporary directory): 0700, owned by this user.

    One that another user made first (to read or plant files), or that is open to others, is
    not used: then the temporary directory's, under the same rules.

    Raises:
        OSError: neither place gives such a directory.
    """
    shm = "/dev/shm"
    roots = ([shm] if os.path.isdir(shm) and os.access(shm, os.W_OK) else []) + [tempfile.gettempdir()]
    problems = []
    for root in roots:
        path = os.path.join(root, f"hpc-{os.getuid()}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            problems.append(f"{path}: {e.strerror or e}")
            continue
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return path
        problems.append(f"{path}: not a directory of this user's alone (mode {st.st_mode & 0o7777:o}, "
                        f"owner {st.st_uid})")
    raise OSError(f"no private directory for the job's node-local files: {'; '.join(problems)}")


def lost_uids(uids: Sequence[str], members: Sequence[str]) -> list[str]:
    """The workers of ``uids`` (``host/pid``) whose host is not among the new epoch's
    ``members``: lost with their node (a re-form in the new store does not wait for them)."""
    keep = set(members)
    return [u for u in uids if u.rpartition("/")[0] not in keep]


@dataclass(frozen=True)
class Hello:
    """The first line on a lifeline (:mod:`runtime.launch.inprocess_lifelines`): who holds it,
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


def lifeline_dead(closed: Mapping[str, str], launchers_closed: Sequence[str] | set[str], *,
                  replacement: str) -> list[str]:
    """The workers whose lifeline closed that are dead to the re-form now (pure).

    A worker's line closed without its last words: the process ended (its kernel closed the
    socket); a slow, stopped or cut-off process keeps its line open and is never named here.
    Under ``--replacement wait`` its launcher may still promise a joiner, so the worker is
    named only once its launcher's line closed too (the node crashed: nobody will); under
    ``shrink`` nobody waits for a replacement, so at once.

    Args:
        closed: Worker uid -> its launcher's uid, for the workers whose line closed.
        launchers_closed: Launchers whose line closed.
        replacement: The job's ``--replacement``.
    """
    gone = set(launchers_closed)
    return [w for w, parent in closed.items() if replacement == SHRINK or parent in gone]


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


def in_row(previous: Members | None, step: int) -> int:
    """How many generations in a row go on from ``step``, the new one included (pure): one
    more than the previous generation's count when it went on from the same step (no step
    completed since: the failure repeats), else 1 (a step completed resets the count)."""
    return previous.in_row + 1 if previous is not None and previous.step == step else 1


HOLDS_NOTHING = -1   # an arrival's step: it holds no training step whole (a joiner, a half-loaded rank)
UNTOUCHED = "untouched"   # a failed recovery had not begun to overwrite this rank's state
LOADING = "loading"       # it had begun to load the received state, and not finished
LOADED = "loaded"         # it had loaded the received state whole (the agreed step's)


def held_after(held: int, agreed: int, phase: str) -> int:
    """The step a rank holds whole after its recovery failed part way (pure): what it says
    at the next re-form, where the newest step held decides the source (:func:`plan_members`).

    A rank whose state was not touched (the source, a rank that failed before or during the
    transfer's receipt: it receives into buffers of its own) still holds ``held``; one that
    loaded the agreed step's state whole holds ``agreed``; one that had begun to load it holds
    a mix of two steps, so nothing (:data:`HOLDS_NOTHING`): it is never a source again.

    Raises:
        ValueError: An unknown ``phase`` (names the valid ones).
    """
    if phase == UNTOUCHED:
        return held
    if phase == LOADED:
        return agreed
    if phase == LOADING:
        return HOLDS_NOTHING
    raise ValueError(f"phase {phase!r}: expected {UNTOUCHED}, {LOADING} or {LOADED}")


def parse_max_reforms(raw: str) -> int:
    """``HPC_INPROC_MAX_REFORMS``: re-forms in a row at one step before in-process recovery
    gives up (the restart path takes over); empty: :data:`DEFAULT_MAX_REFORMS`.

    Raises:
        ValueError: Not an integer >= 1 (names the value).
    """
    if not raw.strip():
        return DEFAULT_MAX_REFORMS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{MAX_REFORMS_ENV}={raw!r}: expected an integer >= 1 (re-forms in a row at "
                         f"one step before the restart path; default {DEFAULT_MAX_REFORMS})")
    return n


def _number(name: str, raw: str, default: float, low: float, high: float, *, whole: bool = False,
            unit: str = "") -> float:
    """``raw`` as a finite number in [low, high] (the default when empty), else ValueError
    naming the variable, the value and the range (pure)."""
    if not raw.strip():
        return default
    try:
        x = float(int(raw)) if whole else float(raw)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and low <= x <= high):
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"{name}={raw!r}: expected {kind} from {low:g} to {high:g}{unit} "
                         f"(default {default:g})")
    return x


def parse_window_s(raw: str) -> float:
    """``HPC_INPROC_WINDOW_S``: how long a leader waits for silent members (0.1-600 s)."""
    return _number(WINDOW_ENV, raw, DEFAULT_WINDOW_S, 0.1, 600.0, unit=" seconds")


def parse_timeout_s(raw: str) -> float | None:
    """``HPC_INPROC_TIMEOUT_S``: a training collective's fixed bound (1 s to a day); None:
    the stall deadline's."""
    return _number(TIMEOUT_ENV, raw, math.nan, 1.0, 86400.0, unit=" seconds") if raw.strip() else None


WARM_VALUES = ("1", "0", "true", "false", "yes", "no", "on", "off")
LAUNCHER_SET_ENV = (STORE_ENV, JOIN_ENV, MAX_WORLD_ENV, CHANNEL_ENV, RECOVERY_ENV)


def check_env(name: str, value: str) -> None:
    """Refuses a job's own value of an in-process variable it may not set or set so (pure).

    The tunables (window, timeout, re-forms, the FSDP2 copy's interval and memory bound, the
    warm standby) are parsed as the workers parse them; the variables the launcher sets for
    each worker (its store, a joiner's mark, the largest world, the channel, the recovery mode)
    are not the job's to set: a stray ``HPC_INPROC_JOIN=1`` made every worker a joiner.

    Raises:
        ValueError: naming the variable, its value and what it takes.
    """
    if name in LAUNCHER_SET_ENV:
        raise ValueError(f"{name}={value!r}: set by the launcher for each worker, not by the job"
                         + (" (use --recovery)" if name == RECOVERY_ENV else ""))
    if name == WINDOW_ENV:
        parse_window_s(value)
    elif name == TIMEOUT_ENV:
        parse_timeout_s(value)
    elif name == MAX_REFORMS_ENV:
        parse_max_reforms(value)
    elif name == COPY_EVERY_ENV:
        _number(name, value, DEFAULT_COPY_EVERY, 1, 1e9, whole=True, unit=" steps")
    elif name == COPY_MAX_MB_ENV:
        _number(name, value, DEFAULT_COPY_MAX_MB, 1e-3, 1e9, unit=" MB")
    elif name == WARM_ENV and value.strip().lower() not in WARM_VALUES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(WARM_VALUES)}")


def repeats(members: Members, max_reforms: int) -> str | None:
    """Why in-process recovery gives up at ``members`` (pure): no member holds the state
    whole (:func:`unsourced`), or the generation is past ``max_reforms`` re-forms in a row at
    one step (a failure that repeats, e.g. a bad batch, would loop forever), or None to go on."""
    if members.source < 0:   # nobody holds any step whole (:func:`unsourced`)
        return members.reason
    if members.in_row <= max_reforms:
        return None
    return (f"{members.in_row} re-forms in a row at step {members.step} without a step completed "
            f"(at most {max_reforms}, {MAX_REFORMS_ENV}): the failure repeats: {members.reason}; "
            "torch's restart path from the last checkpoint (bounded by --max-restarts)")


@dataclass(frozen=True)
class CloseDecision:
    """Whether the leader closes the membership now, and whom it stops waiting for."""

    close: bool
    waiting_for: tuple[str, ...]


def close_decision(old: Sequence[str], arrived: Sequence[str], *, dead: Sequence[str] = (),
                   busy_until: Mapping[str, float] | None = None, coming: Sequence[str] = (),
                   now: float, opened: float, window_s: float,
                   coming_s: float = COMING_S, promised: Mapping[str, float] | None = None,
                   joiners: int = 0) -> CloseDecision:
    """The leader's rule for closing a generation (pure).

    Close when every old member has arrived or is known dead; else when the join window since
    the generation opened has run out, except for members that announced a long phase (they
    are waited for until the time they announced) and members that said they are coming
    (alive, they learnt of the fault while in a wait of their own; waited for ``coming_s``).

    Args:
        old: The previous generation's members.
        arrived: The members (and joiners) that arrived so far.
        dead: Members a launcher announced dead.
        busy_until: Member -> wall time its announced phase ends.
        now: The wall time now.
        opened: When this generation was opened (the leader's arrival).
        window_s: How long silent members are waited for.
        coming: Members that said they are coming.
        coming_s: How long those are waited for.
        promised: Dead member -> wall time until which its launcher's replacement is
            waited for (``replace/UID``): the world keeps its size when the joiner comes.
        joiners: Joiners waiting now.
    """
    gone = set(arrived) | set(dead)
    missing = tuple(u for u in old if u not in gone)
    owed = [u for u, until in (promised or {}).items() if u in dead and until > now]
    if not missing and joiners < len(owed):
        return CloseDecision(False, tuple(f"replacement of {u}" for u in owed[joiners:]))
    if not missing:
        return CloseDecision(True, ())
    busy = busy_until or {}
    late = set(coming)
    waiting = tuple(u for u in missing if now < opened + window_s or busy.get(u, 0.0) > now
                    or (u in late and now < opened + coming_s))
    return CloseDecision(not waiting, waiting)


def admit(joiners: Sequence[Arrival], *, members: int, max_world: int,
          dead: Sequence[str] = ()) -> tuple[Arrival, ...]:
    """The joiners a generation takes in (pure): in their join order, the live ones, as many
    as fit beside ``members`` in ``max_world`` (the others wait: a hot spare stays a spare)."""
    room = max(0, max_world - members)
    return tuple(j for j in joiners if j.uid not in set(dead))[:room]


def plan_members(gen: int, arrivals: Sequence[Arrival], *, old: Sequence[str],
                 reason: str, keep_ranks: bool = False) -> Members:
    """The closed generation for these arrivals (pure).

    Ranks follow the old ranks (joiners last, in their arrival order); the state comes from the
    lowest-ranked member holding the newest step. With ``keep_ranks`` (a sharded job: rank
    ``r`` owns shard ``r``) every member keeps its old rank where it fits the new world and
    joiners fill the ranks of the lost members, lowest first.

    Raises:
        ValueError: When nobody arrived, or nobody holds any step (only joiners).
    """
    seen: dict[str, Arrival] = {}
    for a in arrivals:
        seen.setdefault(a.uid, a)
    ordered = sorted(seen.values(), key=lambda a: (a.old_rank, list(seen).index(a.uid)))
    if keep_ranks:
        n = len(ordered)
        slots: list[Arrival | None] = [None] * n
        rest = []
        for a in ordered:
            if 0 <= a.old_rank < n and slots[a.old_rank] is None:
                slots[a.old_rank] = a
            else:
                rest.append(a)
        free = iter(i for i, a in enumerate(slots) if a is None)
        for a in rest:
            slots[next(free)] = a
        ordered = [a for a in slots if a is not None]
    if not ordered:
        raise ValueError(f"generation {gen}: nobody arrived")
    step = max(a.step for a in ordered)
    if step < 0:
        raise ValueError(f"generation {gen}: only joiners arrived ({len(ordered)}), no member "
                         "holds the training state")
    source = next(i for i, a in enumerate(ordered) if a.step == step)
    uids = tuple(a.uid for a in ordered)
    return Members(gen=gen, uids=uids, step=step, source=source, reason=reason,
                   left=tuple(u for u in old if u not in uids))


def unsourced(gen: int, arrivals: Sequence[Arrival], *, old: Sequence[str], reason: str) -> Members:
    """The closed generation when no arrival holds any step whole (pure): every survivor
    had begun to load a state a failed recovery sent (:func:`held_after`), or only joiners
    came. ``source`` is -1 and the reason says why; every member then gives up in-process
    recovery (:func:`repeats`): the disk checkpoint is the only whole state left."""
    uids = tuple(dict.fromkeys(a.uid for a in arrivals))
    why = (f"generation {gen}: no member holds the training state whole ({len(uids)} arrived: "
           f"a state transfer failed part way on every survivor, or only joiners came; after: "
           f"{reason}); the restart path from the last checkpoint")
    return Members(gen=gen, uids=uids, step=HOLDS_NOTHING, source=-1, reason=why,
                   left=tuple(u for u in old if u not in uids))
