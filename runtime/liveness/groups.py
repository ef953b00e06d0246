"""Liveness aggregated in groups: each node's store traffic stays O(1) whatever the job's size.

Reading every peer's counter each beat costs a node 2N store requests (N^2 for the job: two
million requests a second at 1,024 nodes, where one store core serves ~70 K). Instead the node
ranks are cut into groups of :data:`GROUP_NODES`; one member of each group, its *watcher*,
reads its members' counters and records in one ``multi_get`` and writes one group key; the
watcher of group 0, the *root*, folds the group keys into one summary key; every node reads the
summary (and its own group's key) in one ``multi_get``. A beat then costs about three requests
per node and the job ``O(N)``; a silent node is named within :data:`~.peers.LOST_AFTER_S`
whatever N (its watcher names it after :data:`WATCH_LOST_AFTER_S`, at most three beats carry
the name).

Who watches is decided from what every node reads anyway (pure, :func:`watches`): the lowest
member of the group not named lost or done, or any member whose group key stood still for
:data:`WATCH_LOST_AFTER_S` (its watcher is gone and not yet named; several may watch a moment,
which only repeats a key). The root is named lost by every reader when the summary stands still;
the next member of group 0 then takes over.

The keys, under ``hpc-liveness/<run id>/`` in the rendezvous store:

=================  =============================================  ==========================
key                value                                          written by
=================  =============================================  ==========================
``beat/<r>``       counter, +1 a beat; +:data:`DONE` at end       node r
``rec/<r>``        ``{"host", "progress", "busy", "working"}``    node r, on change
``group/<g>``      :func:`fold_group` (JSON)                      group g's watcher
``summary``        :func:`fold_summary` (JSON)                    the root
=================  =============================================  ==========================
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

GROUP_NODES = 32
DONE = 1 << 40            # added to a node's counter when it ends cleanly (not lost)
WATCH_LOST_AFTER_S = 7.0  # a member this long silent, as its watcher sees it: lost (<= 3 beats
                          # carry the name to every node: named everywhere within LOST_AFTER_S)
TOP = 2                   # progress / busy entries kept (a reader skips its own)
MAX_NAMED = 64            # lost nodes carried in one key (a job that loses more is ending)


def group_of(rank: int) -> int:
    return rank // GROUP_NODES


def members(group: int, max_nodes: int) -> range:
    return range(group * GROUP_NODES, min((group + 1) * GROUP_NODES, max_nodes))


def groups(max_nodes: int) -> range:
    return range(-(-max_nodes // GROUP_NODES))


def requests_per_beat(max_nodes: int) -> int:
    """Store requests of the whole job per beat, records aside (<= 0.5 a node a beat): each
    node adds and reads two keys; each watcher reads its members and writes its group; the
    root reads the groups and writes the summary."""
    return 2 * max_nodes + 2 * len(groups(max_nodes)) + 2


def parse(raw: bytes | str | None) -> dict:
    """A group or summary key's value (``{}`` when empty or unreadable)."""
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def watches(me: int, *, max_nodes: int, unavailable: Iterable[int], group_stale: bool) -> bool:
    """Whether node ``me`` watches its group: it is the lowest member not named lost or done,
    or its group key stood still (its watcher is gone and not named yet)."""
    out = set(unavailable)
    first = next((r for r in members(group_of(me), max_nodes) if r not in out), None)
    return first == me or group_stale


def _top(entries: Iterable[tuple[float, int, str]]) -> list[list]:
    """The latest :data:`TOP` entries of distinct nodes, latest first."""
    best: dict[int, tuple[float, int, str]] = {}
    for t, rank, text in entries:
        if rank not in best or t > best[rank][0]:
            best[rank] = (t, rank, text)
    return [list(e) for e in sorted(best.values(), reverse=True)[:TOP]]


def fold_group(*, seq: int, by: int, host: str, lost: Mapping[int, float], hosts: Mapping[int, str],
               done: Iterable[int], records: Mapping[int, dict]) -> dict:
    """The group key a watcher writes: its members lost (silent seconds), done, and the latest
    progress and busy ranks among them (pure)."""
    named = sorted(lost.items(), key=lambda kv: -kv[1])[:MAX_NAMED]
    return {"seq": seq, "by": by, "host": host,
            "lost": {str(r): [hosts.get(r, "?"), round(s, 1)] for r, s in named},
            "done": sorted(set(done)),
            "progress": _top((float(rec["progress"]), r, "") for r, rec in records.items()
                             if isinstance(rec.get("progress"), (int, float))),
            "busy": _top((float(rec.get("time", 0.0)), r, str(rec["busy"][0])) for r, rec in records.items()
                         if isinstance(rec.get("busy"), list) and rec["busy"]),
            "working": _top((float(rec["working"]), r, "") for r, rec in records.items()
                            if isinstance(rec.get("working"), (int, float)))}


def fold_summary(*, seq: int, by: int, host: str, group_keys: Sequence[dict],
                 stale: Mapping[int, float], sizes: Mapping[int, int]) -> dict:
    """The summary the root writes from the group keys (pure).

    ``stale``: groups (index -> seconds) whose key stood still: their watcher is named lost
    (with the host its last key gave), and their other members are out of sight, counted in
    ``unseen`` (the rendezvous host's majority rule weighs them) but not named.
    """
    lost: dict[str, list] = {}
    done: list[int] = []
    unseen = 0
    for g, key in enumerate(group_keys):
        if g in stale and "by" in key:
            lost[str(key["by"])] = [str(key.get("host", "?")), round(stale[g], 1)]
            unseen += max(0, sizes.get(g, 0) - 1 - len(key.get("done", [])))
            continue
        lost.update(key.get("lost", {}))
        done += key.get("done", [])
    named = dict(sorted(lost.items(), key=lambda kv: -kv[1][1])[:MAX_NAMED])
    return {"seq": seq, "by": by, "host": host, "lost": named, "done": sorted(set(done)),
            "unseen": unseen,
            "progress": _top(tuple(e) for k in group_keys for e in k.get("progress", [])),
            "busy": _top(tuple(e) for k in group_keys for e in k.get("busy", [])),
            "working": _top(tuple(e) for k in group_keys for e in k.get("working", []))}


def latest_other(entries: Sequence[Sequence], me: int) -> tuple[float, str] | None:
    """The latest ``(time, text)`` of a node other than ``me`` in a key's top entries."""
    for entry in entries:
        try:
            t, rank, text = float(entry[0]), int(entry[1]), str(entry[2])
        except (TypeError, ValueError, IndexError):
            continue
        if rank != me:
            return t, text
    return None
