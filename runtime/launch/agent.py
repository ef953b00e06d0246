"""torch's elastic agent as the launcher runs it: one class per run, composed in one place.

torch's ``launch_agent`` builds a ``LocalElasticAgent`` by its module-global name in
``torch.distributed.launcher.api`` and takes no agent of ours. So for each agent run the
launcher composes one class, ``HpcAgent``, whose order is explicit: the recovery's part
(none for the restart path; in-process recovery's
:class:`~runtime.inprocess.launcher.agent.InProcessAgent`), then :class:`StopAware`, then
:class:`~runtime.launch.quorum.MarksFinished` (the quorum watch's evidence that the workers
finished), then torch's agent. :func:`installed` is the one place that puts it where ``launch_agent`` looks,
and puts torch's back. torch makes the instance, so each part reads its run's settings from a
class attribute that the composition sets (:class:`StopAware`: ``stop_rules``; the recovery's
part: the attributes its :meth:`~runtime.launch.recovery.Restart.agent_part` names).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.launch.quorum import MarksFinished

log = logging.getLogger("hpc.launch")


@dataclass(frozen=True)
class StopRules:
    """When torch's agent must not start failed workers again.

    Attributes:
        stopping: True once the allocation is stopping (a warning, a SIGTERM, the fence).
        futile: A reason why failed workers would fail again (the job's disk is full, the
            checkpoint directory is a file), or None, given the agent's ``RunResult`` (its
            ``failures``): the restarts are for faults that go away; these would spend them
            all redoing work from the last checkpoint.
        on_restart: Told of each restart the agent is about to make after failed workers:
            ``(failures, restart, max_restarts)`` (``failures``: global rank -> torch's
            ``ProcessFailure``).
    """

    stopping: Callable[[], bool]
    futile: Callable[[Any], str | None] = lambda result: None
    on_restart: Callable[[Any, int, int], None] | None = None


class StopAware:
    """The part of every run's agent that restarts no workers once a stop began (torch does the
    same for a wedged worker: the remaining restarts set to 0), nor after a failure that would
    repeat, and says why each restart happens. Without it (another torch), the worker-side
    guard (:func:`runtime.stopping.exit_if_stopping`) still keeps the user's script from
    running again."""

    stop_rules: StopRules

    def _monitor_workers(self, worker_group: Any) -> Any:
        result = super()._monitor_workers(worker_group)   # type: ignore[misc]
        rules = self.stop_rules
        left = getattr(self, "_remaining_restarts", 0)
        failed = getattr(getattr(result, "state", None), "name", "") == "FAILED"
        if left and rules.stopping():
            log.warning("the allocation is stopping: no restart of the workers "
                        "(%d left unused)", left)
            self._remaining_restarts = 0
        elif left and failed and (why := rules.futile(result)):
            log.error("the workers failed and %s: no restart (%d left unused), it would "
                      "only fail the same way", why, left)
            self._remaining_restarts = 0
        elif left and failed and rules.on_restart is not None:
            total = getattr(getattr(worker_group, "spec", None), "max_restarts", left)
            try:
                rules.on_restart(getattr(result, "failures", {}), total - left + 1, total)
            except Exception:  # noqa: BLE001 - a message must not break the agent
                log.exception("cannot describe the failed workers")
        return result


@contextlib.contextmanager
def installed(rules: StopRules, part: tuple[type, Mapping[str, Any]] | None = None) -> Iterator[type | None]:
    """While inside, torch's ``launch_agent`` builds this run's ``HpcAgent``: ``part`` (the
    recovery's class and its settings' class attributes, or None), :class:`StopAware` with
    ``rules``, :class:`~runtime.launch.quorum.MarksFinished`, torch's ``LocalElasticAgent``. Yields the class (None: torch has no agent to
    extend, the guard of the workers' side only)."""
    from torch.distributed.launcher import api as launcher_api

    base = getattr(launcher_api, "LocalElasticAgent", None)
    if base is None or not hasattr(base, "_monitor_workers"):
        log.warning("torch's launcher has no LocalElasticAgent to guard: restarted workers "
                    "of a stopping allocation exit at once instead")
        yield None
        return
    extra, settings = ((part[0],), dict(part[1])) if part is not None else ((), {})
    agent = type("HpcAgent", (*extra, StopAware, MarksFinished, base), {"stop_rules": rules, **settings})
    launcher_api.LocalElasticAgent = agent
    try:
        yield agent
    finally:
        launcher_api.LocalElasticAgent = base
