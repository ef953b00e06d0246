"""The Session's metric rows: names every rank reduces in one layout, whatever each rank logged.

A rank may log a metric the others do not (``if s.is_rank0: s.log(val_loss=...)``, a metric of
some steps only, a name with the rank in it). Reduced as each rank's own names, the ranks would
post all-reduces of other sizes and counts, and the job hung in the next one. Here the names are
**agreed**: every rank posts the same collectives, laid out by the names agreed so far
(:class:`Schema`), each value with the count of ranks that logged it at that row (absent: count
0, a neutral value), plus the count of names the schema lacks. That count is reduced too, so
every rank sees the same one: when it is not 0 every rank, at the same point of its sequence,
gathers the new names with their values (one ``all_gather_object``, once per new name), reduces
those from the gathered values and adds them to the schema. A row then holds each metric that
at least one rank logged, reduced over the ranks that logged it (``mean``: their mean).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from runtime.liveness import posted

OPS = ("mean", "sum", "max", "min")


class Schema:
    """The agreed metric names and their reduction (name -> op), the same on every rank."""

    def __init__(self, names: Mapping[str, str] | None = None) -> None:
        self.names: dict[str, str] = dict(names or {})

    def post(self, values: Mapping[str, float], ops: Mapping[str, str], group: Any) -> Row:
        """Posts this rank's part of a row (``async_op``): every rank calls it at the same point
        of its collectives, with its own names. ``ops``: name -> op (default ``mean``)."""
        bad = {k: v for k, v in ops.items() if v not in OPS}
        if bad:
            raise ValueError(f"unknown reduce op(s) {bad}; valid ops: {', '.join(OPS)}")
        import torch
        import torch.distributed as dist

        local = {k: float(v) for k, v in values.items()}
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return Row(self, local, {}, [], None, {})
        known = sorted(self.names)
        new = {k: (ops.get(k, "mean"), v) for k, v in local.items() if k not in self.names}
        additive = [k for k in known if self.names[k] in ("mean", "sum")]
        # [values of mean/sum names, the count of ranks that logged each known name, new names]
        head = [local.get(k, 0.0) for k in additive] + [1.0 if k in local else 0.0 for k in known] + [float(len(new))]
        tensors = [("sum", additive + known, torch.tensor(head, dtype=torch.float64), dist.ReduceOp.SUM)]
        for op, neutral, reduce_op in (("max", -math.inf, dist.ReduceOp.MAX), ("min", math.inf, dist.ReduceOp.MIN)):
            names = [k for k in known if self.names[k] == op]
            if names:   # the schema is agreed: every rank posts this one or none
                tensors.append((op, names, torch.tensor([local.get(k, neutral) for k in names],
                                                        dtype=torch.float64), reduce_op))
        works = [(op, names, t, dist.all_reduce(t, op=reduce_op, group=group, async_op=True))
                 for op, names, t, reduce_op in tensors]
        return Row(self, {}, new, works, group, {k: self.names[k] for k in known})


class Row:
    """A posted row; :meth:`result` waits for it (and agrees on new names, see the module)."""

    def __init__(self, schema: Schema, done: dict[str, float], new: dict[str, tuple[str, float]],
                 works: list[tuple[str, list[str], Any, Any]], group: Any, layout: dict[str, str]) -> None:
        self._schema, self._done, self._new, self._works, self._group = schema, done, new, works, group
        self._layout = layout   # the schema's names and ops when the row was posted
        self._result: dict[str, float] | None = None

    @property
    def works(self) -> list[Any]:
        """The posted collectives (in-process recovery waits for them in a way it can leave)."""
        return [work for _, _, _, work in self._works]

    def result(self, *, agree_new: bool = True) -> dict[str, float]:
        """The reduced row, identical on every rank. ``agree_new=False`` (a recovery: the group
        may be gone): the names no schema held yet are left out, and no collective runs."""
        if self._result is not None:
            return self._result
        out = dict(self._done)
        if self._works:
            for _, _, t, work in self._works:
                posted.wait(work)
            out.update(self._known())
            if agree_new:
                out.update(self._agree())
        self._result = out
        return out

    def _known(self) -> dict[str, float]:
        (_, names, head, _), *others = self._works
        known = sorted(self._layout)
        additive = names[:len(names) - len(known)]
        values = head.tolist()
        counts = dict(zip(known, values[len(additive):len(additive) + len(known)]))
        out = {}
        for k, v in zip(additive, values):
            if counts[k] > 0:
                out[k] = v / counts[k] if self._layout[k] == "mean" else v
        for _, names_, t, _ in others:
            out.update((k, v) for k, v in zip(names_, t.tolist()) if counts[k] > 0)
        return out

    def _agree(self) -> dict[str, float]:
        """New names, when a rank had any (the count every rank reduced): gathered from every
        rank, reduced here, added to the schema (the same on every rank)."""
        head = self._works[0][2]
        if head[-1].item() == 0:
            return {}
        import torch.distributed as dist

        theirs: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(theirs, self._new, group=self._group)
        merged: dict[str, tuple[str, list[float]]] = {}
        for rank_new in theirs:
            for name, (op, value) in sorted(rank_new.items()):
                first = merged.setdefault(name, (op, []))
                if first[0] != op:
                    raise ValueError(f"metric {name!r} is reduced with {first[0]!r} on one rank and {op!r} "
                                     "on another: give it the same op on every rank (s.log(ops=...))")
                first[1].append(value)
        out = {}
        for name, (op, vals) in sorted(merged.items()):
            self._schema.names[name] = op
            out[name] = {"mean": sum(vals) / len(vals), "sum": sum(vals), "max": max(vals), "min": min(vals)}[op]
        return out
