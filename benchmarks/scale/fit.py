"""Growth exponents: the slope of a least-squares line through (log N, log figure)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def exponent(ns: Sequence[float], values: Sequence[float | None]) -> float | None:
    """k in figure ~ N^k over the points with a positive figure; None with fewer than two."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v is not None and v > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 2)
