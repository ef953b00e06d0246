"""The goodput ledger: where every allocated node-second of a job went (pure: events in).

Each allocation's wall time, from its start (Slurm's, when known, else the first launcher's)
to its end, is painted with categories from the event stream (:mod:`hpc.contract.events`);
where two claims overlap the more specific wins, in the order of :data:`PAINT_ORDER`:

- ``startup``: launcher, agent, worker processes, imports, model building, the first batch;
- ``teardown``: after the work ended (last step or the stop's save) until the allocation ends;
- ``rendezvous``: the agent's rendezvous rounds, the process group's set-up, and a re-form
  after a failure (from the crash until the next worker group starts);
- ``restore``: loading the checkpoint; ``productive``: the step loop;
- ``lost``: steps whose results were thrown away (computed again after a resume from an older
  checkpoint), the step in flight at a crash, and time after a group's last sign of life when
  it vanished (killed, node lost);
- ``hang``: a stall the watchdog acted on, from the last progress to its action;
- ``checkpoint``: the time saves blocked training; ``preemption``: from the agreed stop to the
  end of its save;
- ``spare``: a hot spare's node-time while it waited, holding no rank (``--spare-nodes``,
  :mod:`hpc.contract.spare_waits`), until it joined in a lost node's place or the allocation ended;
- ``unaccounted``: whatever no event explains; it is shown, never spread over the others.

A script without the Session records no events of its own: its allocation has only the
launchers' frame (the agent's rendezvous rounds, ``workers_started``, ``workers_ended``).
Its workers' running time then counts as ``productive``, since that is what they do unless we
know better, and the allocation carries a note that says what the ledger cannot see there
(the script's own start-up, checkpoints, restores, failures and lost work).

Node-seconds: every node of an allocation counts from the allocation's start to its own end
(its launcher's ``alloc_end``; else when Slurm dropped it from the job, when known; else the
allocation's end). A node that ended without its launcher's record died: from the first
failure after its last record until its end, its time is ``lost``. Categories are the job's timeline (rank 0's view) weighted by the nodes alive,
so they add up exactly to the allocated node-seconds. Queue wait comes from Slurm and is
reported beside the allocated time, not inside it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import reduce
from operator import add, itemgetter
from typing import Any

from hpc.contract import young_daly
from hpc.contract.spare_waits import in_wait, labels, spare_waits

CATEGORIES = ("productive", "startup", "rendezvous", "restore", "checkpoint", "lost",
              "preemption", "hang", "teardown", "spare", "unaccounted")
PAINT_ORDER = ("startup", "teardown", "rendezvous", "restore", "productive", "lost", "hang",
               "checkpoint", "preemption")
_START, _END = itemgetter(0), itemgetter(1)


@dataclass(frozen=True)
class Span:
    t0: float
    t1: float
    category: str


@dataclass(frozen=True)
class Marker:
    t: float
    kind: str          # checkpoint, signal, failure, hang, restart, stop
    label: str


@dataclass
class AllocationLedger:
    """One allocation: its frame, its categories (node-seconds) and its timeline."""

    allocation: int
    start: float
    end: float
    nodes: tuple[str, ...]
    node_s: float
    categories: dict[str, float]
    kind: str = ""
    queue_s: float | None = None
    start_step: int | None = None
    last_step: int | None = None
    lost_steps: int = 0
    restarts: int = 0
    spans: list[Span] = field(default_factory=list)
    node_ends: dict[str, float] = field(default_factory=dict)
    node_dead: dict[str, float] = field(default_factory=dict)   # node -> when it was found dead
    markers: list[Marker] = field(default_factory=list)
    steps: list[tuple[float, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)     # what the ledger cannot see here
    spares: dict[str, list[Any]] = field(default_factory=dict)   # node -> [wait from, until, joined]

    @property
    def wall_s(self) -> float:
        return self.end - self.start


@dataclass
class Ledger:
    allocations: list[AllocationLedger]
    categories: dict[str, float]
    allocated_node_s: float
    queue_s: float | None
    lost_steps: int
    interruptions: int
    interval: dict[str, Any] | None
    checkpoints: dict[str, Any]

    @property
    def notes(self) -> list[str]:
        return [n for a in self.allocations for n in a.notes]

    @property
    def goodput(self) -> float:
        return self.categories["productive"] / self.allocated_node_s if self.allocated_node_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``hpc report --json``)."""
        allocs = []
        for a in self.allocations:
            d = asdict(a)
            d["wall_s"] = a.wall_s
            d["spans"] = [[s.t0, s.t1, s.category] for s in a.spans]
            d["markers"] = [[m.t, m.kind, m.label] for m in a.markers]
            d["steps"] = [list(p) for p in a.steps]
            allocs.append(d)
        return {"goodput": self.goodput, "allocated_node_s": self.allocated_node_s,
                "categories": self.categories, "queue_s": self.queue_s,
                "lost_steps": self.lost_steps, "interruptions": self.interruptions,
                "checkpoints": self.checkpoints, "checkpoint_interval": self.interval,
                "notes": self.notes, "allocations": allocs}


class _Timeline:
    """Non-overlapping labelled segments over ``[t0, t1]``; a later paint wins.

    The segments tile ``[t0, t1]`` in order, and no two neighbours share a label (a paint
    merges them), so a paint changes only the segments it covers and their two neighbours:
    it finds them by bisection (a pass over every segment per paint made the N launchers'
    rendezvous rounds of an allocation O(N x segments)).
    """

    def __init__(self, t0: float, t1: float) -> None:
        self.segs: list[list[Any]] = [[t0, t1, "unaccounted"]]
        self.t0, self.t1 = t0, t1

    def paint(self, a: float | None, b: float | None, cat: str) -> None:
        if a is None or b is None:
            return
        a, b = max(a, self.t0), min(b, self.t1)
        if b <= a:
            return
        segs = self.segs
        i = bisect_right(segs, a, key=_END)     # the first segment that ends after a
        j = bisect_left(segs, b, key=_START)    # the first that starts at or after b
        first, last = segs[i], segs[j - 1]
        window: list[list[Any]] = [list(segs[i - 1])] if i else []
        if first[0] < a:
            window.append([first[0], a, first[2]])
        window.append([a, b, cat])
        if last[1] > b:
            window.append([b, last[1], last[2]])
        if j < len(segs):
            window.append(list(segs[j]))
        merged: list[list[Any]] = []
        for s in window:
            if merged and merged[-1][2] == s[2] and abs(merged[-1][1] - s[0]) < 1e-9:
                merged[-1][1] = s[1]
            else:
                merged.append(s)
        segs[max(i - 1, 0):j + 1] = merged

    def spans(self) -> list[Span]:
        return [Span(round(a, 4), round(b, 4), c) for a, b, c in self.segs if b > a]

    def seconds(self, lo: float, hi: float) -> dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for a, b, c in self.segs:
            out[c] += max(0.0, min(b, hi) - max(a, lo))
        return out


@dataclass(eq=False)
class _Incarnation:
    """One worker group (allocation, restart) as rank 0 saw it."""

    alloc: int
    restart: int
    events: list[Mapping[str, Any]] = field(default_factory=list)

    def first(self, ev: str) -> Mapping[str, Any] | None:
        return next((e for e in self.events if e["ev"] == ev), None)

    def all(self, ev: str) -> list[Mapping[str, Any]]:
        return [e for e in self.events if e["ev"] == ev]

    @property
    def start(self) -> float:
        s = self.first("session_start")
        if s is not None:
            return float(s.get("t_proc") or s["t"])
        return float(self.events[0]["t"])

    @property
    def last_t(self) -> float:
        return float(self.events[-1]["t"])

    @property
    def last_step(self) -> int | None:
        steps = [int(e["last"]) for e in self.all("steps")] + \
                [int(e["step"]) for e in self.all("restore_end") if e.get("step") is not None]
        return max(steps) if steps else None

    @property
    def resume_step(self) -> int | None:
        e = self.first("restore_end")
        return int(e["step"]) if e is not None and e.get("step") is not None else None

    @property
    def work_end(self) -> float | None:
        """When this group's training ended: its last step window, or the end of its stop."""
        ends = [float(e["t"]) for e in self.all("steps")] + [float(e["t"]) for e in self.all("stop_end")]
        return max(ends) if ends else None

    @property
    def ended_cleanly(self) -> bool:
        return self.first("session_end") is not None or self.first("crash") is not None


def _lost_tail(inc: _Incarnation, keep_upto: int) -> list[tuple[float, float]]:
    """The time the steps after ``keep_upto`` took in ``inc``'s windows (interpolated)."""
    out = []
    for w in inc.all("steps"):
        first, last, count = int(w["first"]), int(w["last"]), max(1, int(w["count"]))
        if last <= keep_upto:
            continue
        n = min(count, last - max(first - 1, keep_upto))
        t0, t1 = float(w["t0"]), float(w["t"])
        out.append((t1 - (t1 - t0) * n / count, t1))
    return out


def build(events: Iterable[Mapping[str, Any]], *, outcomes: Sequence[Mapping[str, Any]] = (),
          slurm_runs: Mapping[int, Mapping[str, Any]] | None = None,
          prior_mtbf_s: float = young_daly.DEFAULT_MTBF_S,
          current: tuple[int, int] | None = None) -> Ledger:
    """The ledger of a job (pure).

    Args:
        events: The job's events (``events.jsonl`` plus ``hang`` events from ``hangs.jsonl``).
        outcomes: ``outcomes.jsonl`` records (dicts): the kind and last step of each allocation.
        slurm_runs: Slurm's runs of the job (``submit``/``start``/``end`` in epoch seconds and
            ``node_ends``: node -> when it left), when known; each allocation takes the run
            whose time holds its events.
        prior_mtbf_s: The cluster's prior mean time between interruptions (for the interval).
        current: (allocation, restart) of a worker group still running (a ledger "so far"),
            whose missing end is no interruption.
    """
    evs = sorted((e for e in events if isinstance(e.get("t"), (int, float))), key=itemgetter("t"))
    slurm_runs = slurm_runs or {}
    by_alloc: dict[int, list[Mapping[str, Any]]] = {}
    for e in evs:
        by_alloc.setdefault(int(e.get("alloc", 0)), []).append(e)
    outcome_of = {int(o["allocation"]): o for o in outcomes}

    incs = [_Incarnation(int(key[0] or 0), int(key[1] or 0), group)
            for key, group in young_daly.worker_groups(evs)]
    # Lost steps: what an incarnation computed beyond the step the next one resumed at (each
    # one's next resume found in one pass back: O(groups), not O(groups^2)).
    resumed_by: dict[int, _Incarnation] = {}   # id(incarnation) -> the next one that resumed
    later = None
    for inc in reversed(incs):
        if later is not None:
            resumed_by[id(inc)] = later
        if inc.resume_step is not None:
            later = inc
    incs_of: dict[int, list[_Incarnation]] = {}
    for inc in incs:
        incs_of.setdefault(inc.alloc, []).append(inc)
    lost_by_inc: dict[int, int] = {}     # id(incarnation) -> steps
    for inc in incs:
        nxt = resumed_by.get(id(inc))
        last = inc.last_step
        o = outcome_of.get(inc.alloc)
        if o is not None and o.get("last_step") is not None and inc is incs_of[inc.alloc][-1]:
            last = max(last or 0, int(o["last_step"]))   # progress.json may be ahead of the events
        if nxt is not None and last is not None:
            lost_by_inc[id(inc)] = max(0, last - nxt.resume_step)

    allocations = []
    run_of = _runs_of(by_alloc, slurm_runs)
    for alloc, aevs in sorted(by_alloc.items()):
        allocations.append(_allocation(alloc, aevs, incs_of.get(alloc, []), resumed_by,
                                       lost_by_inc, outcome_of.get(alloc), run_of[alloc]))
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for a in allocations:
        for c, v in a.categories.items():
            totals[c] += v
    queues = [a.queue_s for a in allocations if a.queue_s is not None]
    hist = young_daly.history(evs, current=current)
    interval = None
    if hist.save_cost_s is not None:
        interval = young_daly.choose(
            save_cost_s=hist.save_cost_s, save_total_s=hist.save_total_s or hist.save_cost_s,
            prior_mtbf_s=prior_mtbf_s, observed_s=hist.observed_s,
            interruptions=hist.interruptions).to_dict()
    chosen = [e for e in evs if e["ev"] == "ckpt_interval"]
    if interval is not None and chosen:
        interval["in_use_s"] = chosen[-1].get("every_s")
    checkpoints = {"saves": len(hist.block_s), "commits": len(hist.save_s),
                   "median_block_s": hist.save_cost_s, "median_save_s": hist.save_total_s}
    return Ledger(allocations, totals, sum(a.node_s for a in allocations),
                  sum(queues) if queues else None, sum(lost_by_inc.values()),
                  hist.interruptions, interval, checkpoints)


def _runs_of(by_alloc: Mapping[int, list[Mapping[str, Any]]],
             runs: Mapping[int, Mapping[str, Any]]) -> dict[int, Mapping[str, Any] | None]:
    """Each allocation's Slurm run, no two the same, each ending before the next allocation (pure).

    A job holds one allocation at a time, so no allocation's frame reaches into the next one's:
    a run's end (and its nodes' ends) is capped at the next allocation's first event, or at its
    run's submit time (a requeue's submit is when the allocation before it was let go). sacct
    breaks this for a job requeued after a resize: the resized record's end is written when a
    later allocation ends, and the next record may have no end; taken as they were, two
    allocations claimed the same node-time (a campaign run, the spare's seed 1: 833
    allocated node-s where its 3 nodes could hold 483).
    """
    order = sorted(by_alloc)
    used: set[int] = set()
    matched: dict[int, Mapping[str, Any] | None] = {}
    for alloc in order:
        run = _match_run(runs, by_alloc[alloc], exclude=used)
        if run is not None:
            used.add(id(run))
        matched[alloc] = run
    out: dict[int, Mapping[str, Any] | None] = {}
    for k, alloc in enumerate(order):
        run = matched[alloc]
        if run is None or k + 1 == len(order):
            out[alloc] = run
            continue
        last = float(by_alloc[alloc][-1]["t"])
        cap = float(by_alloc[order[k + 1]][0]["t"])
        nxt = matched[order[k + 1]]
        if nxt is not None and nxt.get("submit") is not None and last <= float(nxt["submit"]) < cap:
            cap = float(nxt["submit"])
        clip = lambda t: None if t is None else min(float(t), cap)  # noqa: E731
        out[alloc] = {**run, "end": clip(run.get("end")),
                      "node_ends": {n: clip(t) for n, t in (run.get("node_ends") or {}).items()}}
    return out


def _match_run(runs: Mapping[int, Mapping[str, Any]], aevs: list[Mapping[str, Any]],
               exclude: Collection[int] = ()) -> Mapping[str, Any] | None:
    """Slurm's run of this allocation: the one whose start..end holds the allocation's events.

    Matched by time, not by order: sacct may list runs of an older job with the same id (ids
    wrap, a test cluster starts again at 1), or miss one. Runs in ``exclude`` (by ``id``) are
    another allocation's.
    """
    t0, t1 = float(aevs[0]["t"]), float(aevs[-1]["t"])
    best, overlap = None, 0.0
    for run in runs.values():
        start, end = run.get("start"), run.get("end")
        if start is None or id(run) in exclude:
            continue
        lo, hi = max(t0, float(start) - 5.0), min(t1, (float(end) if end is not None else t1) + 5.0)
        if hi - lo > overlap or (hi >= lo and best is None and t0 == t1):
            best, overlap = run, hi - lo
    return best


def _allocation(alloc: int, aevs: list[Mapping[str, Any]], incs: list[_Incarnation],
                resumed_by: Mapping[int, _Incarnation], lost_by_inc: Mapping[int, int],
                outcome: Mapping[str, Any] | None, slurm: Mapping[str, Any] | None
                ) -> AllocationLedger:
    starts = [e for e in aevs if e["ev"] == "alloc_start"]
    ends = [e for e in aevs if e["ev"] == "alloc_end"]
    t_start = min(float(e["t"]) for e in (starts or aevs[:1]))
    t_end = max(float(e["t"]) for e in (ends or aevs[-1:]))
    if incs:
        t_start = min(t_start, min(i.start for i in incs))
    queue = None
    if slurm:
        if slurm.get("start") is not None:
            t_start = min(t_start, float(slurm["start"]))
            if slurm.get("submit") is not None:
                queue = max(0.0, float(slurm["start"]) - float(slurm["submit"]))
        if slurm.get("end") is not None and ends:
            t_end = max(t_end, float(slurm["end"]))
    tl = _Timeline(t_start, t_end)
    times = [e["t"] for e in aevs]
    layers: dict[str, list[tuple[float | None, float | None]]] = {c: [] for c in PAINT_ORDER}
    markers: list[Marker] = []
    curve: list[tuple[float, int]] = []

    node_names = tuple(dict.fromkeys(str(e.get("node", "")) for e in starts)) or \
        tuple(dict.fromkeys(str(e.get("node", "")) for e in aevs[:1]))
    ended: dict[str, float] = {}   # each node's last alloc_end (one pass: O(N), not O(N^2))
    for e in ends:
        n = str(e.get("node"))
        ended[n] = max(ended.get(n, float("-inf")), float(e["t"]))
    node_ends = {n: ended.get(n, t_end) for n in node_names}
    if slurm and slurm.get("end") is not None and ends:
        node_ends = {n: max(v, float(slurm["end"])) for n, v in node_ends.items()}
    left = (slurm or {}).get("node_ends") or {}
    for n in node_ends:   # a node that died without a word: allocated until Slurm dropped it
        if left.get(n) is not None and n not in ended:
            node_ends[n] = min(t_end, max(t_start, float(left[n])))
    waits = spare_waits(aevs, node_ends)   # hot spares: their wait is theirs, not the job's
    names = labels(aevs) if waits else {}
    for w in waits.values():
        if w.joined:
            markers.append(Marker(w.t1, "spare", f"spare {w.node} joins"))
    groups = _plain_groups(aevs, t_end) if not incs else []
    first_start = min([i.start for i in incs] + [g[0] for g in groups], default=t_end)
    layers["startup"].append((t_start, first_start))
    notes = []
    for k, (g0, g1) in enumerate(groups):   # a script without the Session: running is working
        layers["productive"].append((g0, g1))
        nxt_g = groups[k + 1][0] if k + 1 < len(groups) else None
        layers["rendezvous" if nxt_g else "teardown"].append((g1, nxt_g or t_end))   # re-form
        if k > 0:
            markers.append(Marker(g0, "restart", f"workers start again ({k})"))
    if groups:
        notes.append(f"allocation {alloc}: the script records no Session events; its workers' "
                     "running time counts as productive steps (its own start-up, checkpoints, "
                     "restores, failures and lost work are not seen)")
    for e in aevs:
        if e["ev"] == "agent_rendezvous":
            layers["rendezvous"].append(in_wait(waits, names, e))
        elif e["ev"] == "signal":
            markers.append(Marker(float(e["t"]), "signal", f"{e.get('signal', '')} on {e.get('node', '')}"))
        elif e["ev"] == "hang":
            markers.append(Marker(float(e["t"]), "hang", str(e.get("reason", "stall"))[:80]))
    for k, inc in enumerate(incs):
        ev = inc.first
        ss, rdv = ev("session_start"), ev("rendezvous")
        rb, re_, ls = ev("restore_begin"), ev("restore_end"), ev("loop_start")
        t = lambda x: float(x["t"]) if x is not None else None  # noqa: E731
        layers["startup"] += [(inc.start, t(ss)), (t(rdv), t(rb)), (t(re_), t(ls))]
        layers["rendezvous"].append((t(ss), t(rdv)))
        layers["restore"].append((t(rb), t(re_)))
        if k > 0:
            markers.append(Marker(inc.start, "restart", f"workers start again ({k})"))
        windows = inc.all("steps")
        work_end = inc.work_end
        if ls is not None and windows:
            layers["productive"].append((t(ls), max(float(w["t"]) for w in windows)))
        for w in windows:
            curve += [(float(w["t0"]), int(w["first"]) - 1), (float(w["t"]), int(w["last"]))]
        for s in inc.all("ckpt_save"):
            layers["checkpoint"].append((float(s["t"]) - float(s.get("block_s") or 0), float(s["t"])))
        for c in inc.all("ckpt_save"):
            markers.append(Marker(float(c["t"]), "checkpoint", f"save step {c.get('step')}"))
        for sb in inc.all("stop_begin"):
            se = next((x for x in inc.all("stop_end") if x["t"] >= sb["t"]), None)
            layers["preemption"].append((float(sb["t"]), t(se) if se else inc.last_t))
            markers.append(Marker(float(sb["t"]), "stop", f"{sb.get('kind', '')} ({sb.get('signal', '')})"))
        crash, end = ev("crash"), ev("session_end")
        nxt = incs[k + 1] if k + 1 < len(incs) else None
        if crash is not None:
            markers.append(Marker(float(crash["t"]), "failure", str(crash.get("error", ""))[:80]))
            layers["lost"].append((work_end, float(crash["t"])))   # the step in flight
            layers["rendezvous" if nxt else "teardown"].append(
                (float(crash["t"]), nxt.start if nxt else t_end))
        elif not inc.ended_cleanly:
            # Vanished (killed, node lost): its last sign of life to the next sign of anyone.
            i = bisect_right(times, inc.last_t)   # the events are in time order
            gone = float(aevs[i]["t"]) if i < len(aevs) else t_end
            markers.append(Marker(inc.last_t, "failure", "worker group lost (no end recorded)"))
            layers["lost"].append((inc.last_t, gone))
            layers["rendezvous" if nxt else "teardown"].append((gone, nxt.start if nxt else t_end))
        else:
            layers["teardown"].append((work_end or t(end), t(end)))
            layers["rendezvous" if nxt else "teardown"].append((t(end), nxt.start if nxt else t_end))
        lost = lost_by_inc.get(id(inc), 0)
        if lost:
            layers["lost"] += _lost_tail(inc, resumed_by[id(inc)].resume_step or 0)
    windows_t = [w["t"] for w in aevs if w["ev"] == "steps"]
    for e in aevs:
        if e["ev"] == "hang":   # from the last step window before it
            i = bisect_right(windows_t, e["t"])
            layers["hang"].append((float(windows_t[i - 1]) if i else None, float(e["t"])))
    for cat in PAINT_ORDER:
        for a, b in layers[cat]:
            tl.paint(a, b, cat)

    # A node that ended without its launcher's record died: from the first failure after its
    # last own record until Slurm dropped it, its time is lost whatever the others did.
    dead: dict[str, float] = {}
    silent = [n for n in node_names if n not in ended]
    last_own: dict[str, float] = {}
    for e in aevs if silent else ():   # every node's last record (a pass over all events)
        if e.get("t") is not None:
            n = str(e.get("node"))
            last_own[n] = max(last_own.get(n, float("-inf")), float(e["t"]))
    failures = sorted(m.t for m in markers if m.kind == "failure")
    for n in silent:   # its first failure after its last own record
        i = bisect_left(failures, last_own.get(n, t_start))
        if i < len(failures) and failures[i] < node_ends[n]:
            dead[n] = failures[i]
    # Each node's time by category: the timeline's share of its pieces, summed over the nodes
    # in their order (the same additions as one node at a time, in C: N x 11 of them).
    shares: dict[tuple[float, float], dict[str, float]] = {}   # most nodes share their ends
    pieces_of: list[dict[str, float]] = []
    spare: list[float] = []   # "spare" and "lost" also add each node's own time after its pieces
    lost: list[float] = []
    for n, n_end in node_ends.items():
        until = dead.get(n, n_end)
        w = waits.get(n)
        pieces = [(t_start, until)] if w is None else [(t_start, min(w.t0, until)), (w.t1, until)]
        for lo, hi in pieces:
            share = shares.get((lo, hi))
            if share is None:
                share = shares[(lo, hi)] = tl.seconds(lo, hi)
            pieces_of.append(share)
            spare.append(share["spare"])
            lost.append(share["lost"])
        if w is not None:
            spare.append(max(0.0, min(w.t1, until) - w.t0))
        lost.append(n_end - until)
    cats = {c: reduce(add, map(itemgetter(c), pieces_of), 0.0) for c in CATEGORIES}
    cats["spare"], cats["lost"] = reduce(add, spare, 0.0), reduce(add, lost, 0.0)
    kind = str(outcome["kind"]) if outcome else next((str(e.get("kind")) for e in reversed(ends)), "")
    if outcome and outcome.get("kind") not in (None, "finished"):
        planned = outcome["kind"] in ("preempted", "time_limit", "cancelled")
        markers.append(Marker(t_end, "stop" if planned else "failure",
                              f"allocation ended: {outcome['kind']}"))
    restores = [i.resume_step for i in incs if i.resume_step is not None]
    lasts = [i.last_step for i in incs if i.last_step is not None]
    if outcome and outcome.get("last_step") is not None:
        lasts.append(int(outcome["last_step"]))
    markers.sort(key=lambda m: m.t)
    return AllocationLedger(
        allocation=alloc, start=t_start, end=t_end, nodes=node_names,
        node_s=sum(e - t_start for e in node_ends.values()), categories=cats, kind=kind,
        queue_s=queue, start_step=restores[0] if restores else None,
        last_step=max(lasts) if lasts else None,
        lost_steps=sum(lost_by_inc.get(id(i), 0) for i in incs),
        restarts=max(0, len(incs) - 1, len(groups) - 1), spans=tl.spans(),
        node_ends=node_ends, node_dead=dead, markers=markers, steps=sorted(curve), notes=notes,
        spares={n: [w.t0, w.t1, w.joined] for n, w in waits.items()})


def _plain_groups(aevs: list[Mapping[str, Any]], t_end: float) -> list[tuple[float, float]]:
    """The worker groups of an allocation seen only by its launchers: ``(start, end)`` each.

    One node's view (the lowest node rank that started workers: the rendezvous host, in every
    group). A group runs from its ``workers_started`` until the next rendezvous round begins
    (a restart), its workers end, or the allocation ends.
    """
    starts = [e for e in aevs if e["ev"] == "workers_started"]
    if not starts:
        return []
    node = min(int(e.get("node_rank") or 0) for e in starts)
    mine = [e for e in aevs if int(e.get("node_rank") or 0) == node]
    times = [float(e["t"]) for e in mine if e["ev"] == "workers_started"]
    stops = [float(e.get("t0") or e["t"]) for e in mine if e["ev"] == "agent_rendezvous"] + \
        [float(e["t"]) for e in mine if e["ev"] == "workers_ended"]
    out = []
    for t0 in times:
        t1 = min([s for s in stops if s > t0] + [t_end])
        out.append((t0, t1))
    return out
