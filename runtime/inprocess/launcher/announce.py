"""The launchers' one way to say that workers are dead: the store keys the survivors act on.

Four launcher-side detectors see a worker die, each by its own evidence: its launcher sees its
child end (:mod:`~runtime.inprocess.launcher.agent`, a hot spare's launcher
:mod:`~runtime.inprocess.launcher.spare`), the store host sees its lifeline close
(:mod:`~runtime.inprocess.launcher.lifelines`), a peer sees its node's beacon stand still
(:mod:`~runtime.inprocess.launcher.silent`). Each then calls :func:`dead`, the only writer of
``dead/UID`` and ``fault/G`` on the launchers' side (:mod:`runtime.inprocess.protocol`):
``dead/UID`` first (a re-form that reads it does not wait for the worker), then ``fault/G``
(every survivor's fault watch leaves the step at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.inprocess import protocol as proto


def dead(store: Any, workers: Sequence[str], why: str, *, gen: int | None) -> None:
    """Marks ``workers`` (uids) dead in ``store`` (the round's namespace) and, with ``gen``,
    generation ``gen`` failed; ``gen`` None: only the deaths (the workers were not members of
    the running generation, or the survivors re-formed without them already)."""
    for uid in workers:
        store.set(proto.dead(uid), why)
    if workers and gen is not None:
        store.set(proto.fault(gen), why)
