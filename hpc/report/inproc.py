"""The in-process recoveries of a job in words, for ``hpc report`` and ``hpc status`` (pure).

With ``--recovery inprocess`` a lost peer does not restart the workers, so the ledger's
restarts do not show it. Three events tell it (:mod:`hpc.contract.events`): the launcher
that saw a worker die writes ``inproc_detect`` at once, the new rank 0 writes
``inproc_recovery`` with the end time of each stage (abort, re-form, new group, state
transfer), and a node whose every worker is gone writes ``inproc_fallback`` (torch's restart
path, with why). This module turns them into one line each, in time order, with how long
each stage took, the world before and after and the step the job went on from, and sums
them up in a short note for a running job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

STAGES = (("abort", "t_detect", "t_abort"), ("re-form", "t_abort", "t_reform"),
          ("group", "t_reform", "t_group"), ("transfer", "t_group", "t_transfer"))


@dataclass(frozen=True)
class Recovery:
    """One in-process recovery as the job's story tells it."""

    t: float
    allocation: int
    gen: int
    step: int | None
    world: int | None
    old_world: int | None
    reason: str
    stages: tuple[tuple[str, float], ...]
    detected_at: float | None    # the launcher's word (a worker died), if one came first
    end_s: float                 # first stage's start (or the launcher's word) to the state in place
    retries: tuple[str, ...] = ()   # generations whose recovery a second fault ended ("1 (transfer)")

    def line(self) -> str:
        stages = ", ".join(f"{name} {s:.3f}s" for name, s in self.stages)
        since = "the launcher's word" if self.detected_at is not None else "the fault seen"
        world = f"world {self.old_world} -> {self.world}" if self.old_world != self.world \
            else f"world {self.world}"
        return (f"allocation {self.allocation}, generation {self.gen}: {world}, going on from "
                f"step {self.step}, in {self.end_s:.2f}s from {since} ({stages}); "
                f"cause: {self.reason[:100]}"
                + (f"; re-formed again after a second fault in generation(s) {', '.join(self.retries)}"
                   if self.retries else ""))


def _f(e: Mapping[str, Any], key: str) -> float | None:
    v = e.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def recoveries(events: Iterable[Mapping[str, Any]]) -> list[Recovery]:
    """The ``inproc_recovery`` events, each with the launcher's earlier word about its
    generation (``inproc_detect`` for the generation before) when there is one."""
    evs = sorted((e for e in events if isinstance(e.get("t"), (int, float))), key=lambda e: e["t"])
    out = []
    for e in evs:
        if e.get("ev") != "inproc_recovery":
            continue
        gen = int(e.get("gen", 0))
        stages = tuple((name, b - a) for name, k0, k1 in STAGES
                       if (a := _f(e, k0)) is not None and (b := _f(e, k1)) is not None)
        start = _f(e, "t_detect")
        words = [float(d["t"]) for d in evs if d.get("ev") == "inproc_detect"
                 and d.get("alloc") == e.get("alloc") and int(d.get("gen", -1)) == gen - 1
                 and d["t"] <= e["t"]]
        detected = min(words) if words else None
        first = min(x for x in (start, detected, float(e["t"])) if x is not None)
        end = _f(e, "t_transfer") or float(e["t"])
        out.append(Recovery(t=float(e["t"]), allocation=int(e.get("alloc", 0)), gen=gen,
                            step=e.get("step"), world=e.get("world_size"),
                            old_world=e.get("old_world_size"), reason=str(e.get("reason", "")),
                            stages=stages, detected_at=detected, end_s=max(0.0, end - first),
                            retries=tuple(f"{r.get('gen')} ({r.get('stage')})" for r in e.get("retries") or ()
                                          if isinstance(r, Mapping))))
    return out


def story(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every in-process event of a job as a line, in time order (``hpc report``)."""
    evs = sorted((e for e in events if str(e.get("ev", "")).startswith("inproc_")
                  and isinstance(e.get("t"), (int, float))), key=lambda e: e["t"])
    recs = {r.t: r for r in recoveries(evs)}
    lines = []
    for e in evs:
        ev = e.get("ev")
        if ev == "inproc_detect" and "workers" in e:   # announced by a peer: lifeline or beacon
            how = ("its lifeline closed" + (" with its launcher's (node lost)" if e.get("launcher_gone") else "")
                   if e.get("by") == "lifeline" else
                   f"node {e.get('lost_node', '?')} lost (beacon still {e.get('silent_s', '?')}s)")
            lines.append(f"allocation {e.get('alloc', 0)}: worker(s) {', '.join(e.get('workers') or []) or 'none'} "
                         f"announced dead by {e.get('node', '?')}: {how}; generation {e.get('gen')}")
        elif ev == "inproc_detect":
            lines.append(f"allocation {e.get('alloc', 0)}: worker pid {e.get('pid')} (rank "
                         f"{e.get('rank')}) on {e.get('node', '?')} died ({e.get('exit', '?')}), "
                         f"announced to generation {e.get('gen')}")
        elif ev == "inproc_recovery" and float(e["t"]) in recs:
            lines.append(recs[float(e["t"])].line())
        elif ev == "inproc_adopt":
            lines.append(f"allocation {e.get('alloc', 0)}: {e.get('node', '?')} kept its workers "
                         f"{', '.join(map(str, e.get('pids') or []))} through the rendezvous host's "
                         f"loss: epoch {e.get('epoch')}, new store {e.get('store')}")
        elif ev == "inproc_fallback":
            lines.append(f"allocation {e.get('alloc', 0)}: {e.get('node', '?')} fell back to "
                         f"restarting its workers: {str(e.get('reason', ''))[:120]}")
    return lines


def note(events: Iterable[Mapping[str, Any]], *, allocation: int | None = None) -> str:
    """A short summary for a running job (``hpc status``): how many in-process recoveries (of
    ``allocation``, or all) and the last one; "" when none."""
    recs = [r for r in recoveries(events) if allocation is None or r.allocation == allocation]
    if not recs:
        return ""
    last = recs[-1]
    return (f"{len(recs)} in-process recover{'y' if len(recs) == 1 else 'ies'}, last: generation "
            f"{last.gen}, world {last.old_world} -> {last.world}, step {last.step}, "
            f"{last.end_s:.2f}s")
