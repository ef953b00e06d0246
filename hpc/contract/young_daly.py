"""The checkpoint interval that wastes the least: Young/Daly, from the job's own history (pure).

Saving every ``T`` seconds costs ``C / T`` of the time in stalls, and an interruption loses on
average ``T / 2`` of work; the sum is smallest at Young's ``T* = sqrt(2 C M)`` (Daly 2006 refines
it by terms that matter only when ``C`` approaches ``M``). ``C`` is what a save blocks training
(the measured ``block_s``; small with async saves), ``M`` the mean time between interruptions.

``M`` comes from the job's own interruptions, tempered by a prior for the cluster
(``--checkpoint-interval auto:6h``): the prior counts as one interruption seen over ``prior``
seconds, so ``M = (prior + observed run time) / (1 + interruptions)``. A new job gets the prior;
a job interrupted every ten minutes soon gets ``M`` near ten minutes and saves more often.

Bounds keep the answer sane, whatever the inputs: never more often than a save takes in total
(at most one save is in flight) nor than every :data:`MIN_INTERVAL_S` (5 minutes), and never
less often than every :data:`MAX_INTERVAL_S` (30 minutes).

Why those bounds. With async saves a save blocks training for milliseconds, so the optimum
alone would save a large model's whole state every half minute: a continuous stream of
writes to a shared filesystem for a gain of well under 1 % (at the 6-hour prior, saving every
5 minutes instead loses at most 2.5 minutes per interruption on average, 0.7 % of the time
between interruptions; a preemption or a time limit loses nothing, the job saves on the
warning). The ceiling bounds the work a crash can cost at 30 minutes even when the save cost
is overestimated (the first allocation of a job only has a guess) or the prior is long.
A job that wants another interval says so (``--checkpoint-every-min``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from operator import itemgetter
from typing import Any

DEFAULT_MTBF_S = 6 * 3600.0
MIN_INTERVAL_S = 5 * 60.0        # never save more often (write load on shared storage)
MAX_INTERVAL_S = 30 * 60.0       # never less often: a crash loses at most this much work
# Outcome kinds that interrupt a run unplanned; a time limit is planned (the job saves first).
INTERRUPTING_KINDS = ("preempted", "node_failure", "app_error", "hang")


def young_daly_s(save_cost_s: float, mtbf_s: float) -> float:
    """``sqrt(2 * C * M)`` in seconds.

    Raises:
        ValueError: a negative cost or a non-positive MTBF.
    """
    if save_cost_s < 0 or not mtbf_s > 0:
        raise ValueError(f"need save cost >= 0 and MTBF > 0, got {save_cost_s}, {mtbf_s}")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def mtbf_s(prior_s: float, observed_s: float, interruptions: int) -> float:
    """The mean time between interruptions: the prior as one pseudo-interruption plus the job's."""
    return (prior_s + max(0.0, observed_s)) / (1 + max(0, interruptions))


@dataclass(frozen=True)
class Interval:
    """The chosen interval and every input, for the event log and the report."""

    every_s: float
    optimum_s: float          # sqrt(2 C M) before the bounds
    save_cost_s: float        # C: what one save blocks training
    save_total_s: float       # a save's whole duration (the floor)
    mtbf_s: float
    prior_mtbf_s: float
    observed_s: float         # run time the history covers
    interruptions: int
    source: str               # "measured" or "estimated" save cost

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def choose(*, save_cost_s: float, save_total_s: float, prior_mtbf_s: float, observed_s: float,
           interruptions: int, source: str = "measured") -> Interval:
    """The Young/Daly interval within its bounds (see the module docstring).

    The ceiling wins over the floors: a save that takes longer than :data:`MAX_INTERVAL_S`
    still starts every :data:`MAX_INTERVAL_S` (the next one waits for it).
    """
    m = mtbf_s(prior_mtbf_s, observed_s, interruptions)
    optimum = young_daly_s(save_cost_s, m)
    every = min(MAX_INTERVAL_S, max(optimum, save_total_s, MIN_INTERVAL_S))
    return Interval(every, optimum, save_cost_s, save_total_s, m, prior_mtbf_s, observed_s, interruptions,
                    source)


@dataclass(frozen=True)
class History:
    """What the events say about a job so far: run time, interruptions, save costs."""

    observed_s: float
    interruptions: int
    block_s: tuple[float, ...]
    save_s: tuple[float, ...]

    @property
    def save_cost_s(self) -> float | None:
        return statistics.median(self.block_s) if self.block_s else None

    @property
    def save_total_s(self) -> float | None:
        return statistics.median(self.save_s) if self.save_s else None


def worker_groups(events: Iterable[Mapping[str, Any]]) -> list[tuple[tuple[Any, Any], list[Mapping[str, Any]]]]:
    """Rank 0's events split by worker group, in time order: ``((allocation, restart), events)``.

    A group starts at each ``session_start``. The restart count alone does not tell groups
    apart: after a peer node is lost, the agents of the survivors may re-form without counting
    a restart, so two groups of one allocation can share ``(allocation, restart)``.
    """
    groups: list[tuple[tuple[Any, Any], list[Mapping[str, Any]]]] = []
    open_group: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for e in sorted((e for e in events if e.get("rank") == 0), key=itemgetter("t")):
        key = (e.get("alloc"), e.get("restart"))
        if e.get("ev") == "session_start" or key not in open_group:
            open_group[key] = []
            groups.append((key, open_group[key]))
        open_group[key].append(e)
    return groups


def history(events: Iterable[Mapping[str, Any]], current: tuple[Any, Any] | None = None) -> History:
    """Run time, interruptions and save costs from an event stream (pure).

    Run time: from each worker group's start to its last event. Interruptions: a crash, a
    hang, an agreed stop other than a time limit, and a worker group that vanished without an
    end (killed, its node lost). ``current`` (allocation, restart) is the group asking, alive:
    the last group with that key is not counted as vanished.
    """
    events = list(events)
    interruptions = sum(1 for e in events if e.get("ev") == "hang")
    groups = worker_groups(events)
    last_current = max((i for i, (key, _) in enumerate(groups) if key == current), default=None)
    block, total, observed = [], [], 0.0
    for i, (key, evs) in enumerate(groups):
        observed += evs[-1]["t"] - evs[0]["t"]
        ended = False
        for e in evs:
            ev = e.get("ev")
            if ev == "crash":
                interruptions += 1
                ended = True
            elif ev == "stop_begin":
                ended = True
                interruptions += e.get("kind") != "time_limit"
            elif ev in ("session_end", "stop_end"):
                ended = True
            elif ev == "ckpt_save" and e.get("block_s") is not None:
                block.append(float(e["block_s"]))
            elif ev == "ckpt_commit" and e.get("save_s") is not None:
                total.append(float(e["save_s"]))
        interruptions += not ended and i != last_current
    return History(observed, interruptions, tuple(block), tuple(total))
