"""The launcher's one seam to how a job recovers from a lost worker (``--recovery``).

The launcher (:mod:`runtime.launch.main`) runs torch's agent the same way whatever the
recovery; what differs is asked, at fixed points of each agent run, of one object made once
from the spec by :func:`for_run` (the one place the launcher compares the mode):

- :class:`Restart`, the restart path: torch's agent stops every worker at a failure and starts
  them all again from the last checkpoint; there is nothing to add, so every step does nothing;
- :class:`runtime.inprocess.launcher.run.InProcessRun` (``--recovery inprocess``): the
  survivors keep their processes; the launcher announces deaths, starts joiners, keeps its
  workers through the rendezvous host's loss, runs a hot spare's joiners.

The points, in the order of an agent run: :meth:`~Restart.prepare` (the workers'
environment), :meth:`~Restart.instead_of_agent` (a node that runs no agent of its own),
:meth:`~Restart.start`, :meth:`~Restart.watch` (the stall watch's lost nodes),
:meth:`~Restart.arm` (the fence), :meth:`~Restart.agent_part` (its part of torch's agent),
:meth:`~Restart.stop` and :meth:`~Restart.settle` (the run's result). Across runs, the workers
kept through the rendezvous host's loss are handed on by the functions in ``__all__``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hpc.contract import recovery_settings
from runtime.inprocess.launcher.run import InProcessRun, abandon, adopt_args, begin, carried, parse_adopt

# The workers kept from one epoch's run to the next (begin, carried, abandon, adopt_args,
# parse_adopt): only in-process recovery keeps any (the restart path's runs never yield one to
# keep, and its launchers get no --adopt); the launcher hands them on through these.
__all__ = ["Restart", "abandon", "adopt_args", "begin", "carried", "for_run", "parse_adopt"]

if TYPE_CHECKING:
    from runtime.ending.outcome import AgentEnd
    from runtime.launch.plan import LaunchPlan
    from runtime.succession import Board


class Restart:
    """The restart path's part of an agent run: nothing beyond torch's own agent.

    Its methods are the seam: another recovery's run object has the same ones (duck-typed;
    the in-process one lives in its wing and does not import this module)."""

    events: Any = None   # where the recovery records its events (``runtime.events.EventLog``)

    def prepare(self) -> None:
        """Sets what the workers of this run need in the launcher's environment."""

    def instead_of_agent(self, relaunch: Callable[[], None]) -> AgentEnd | None:
        """How this node's run ended when it runs no agent of its own, or None: run torch's."""
        return None

    def start(self) -> None:
        """Starts what runs beside the agent (before the rendezvous)."""

    def watch(self, watchdog: Any, *, board: Board | None, members: int,
              reachable: Callable[[], bool]) -> None:
        """Tells the stall watch what to do with a lost node (before it starts)."""

    def arm(self, fence: Any, board: Board | None) -> None:
        """Tells the fence what to do when the rendezvous host is lost (before it starts)."""

    def agent_part(self) -> tuple[type, Mapping[str, Any]] | None:
        """The recovery's part of torch's agent, composed before it
        (:func:`runtime.launch.agent.installed`): its class and the class attributes that
        carry its settings; None: torch's agent as it is."""
        return None

    def stop(self) -> None:
        """Stops what :meth:`start` started (the agent has returned)."""

    def settle(self, result: str, reason: str, extra: dict[str, Any], *, fence: Any,
               received: Sequence[Any]) -> tuple[str, str]:
        """The run's result and reason after the recovery's own ending (``extra`` may gain
        what the next epoch's run takes over)."""
        return result, reason


def for_run(plan: LaunchPlan, *, epoch: int, board: Board | None, names: Sequence[str],
            adopt: Mapping[int, int] | None, stopping: Callable[[], bool],
            keep_allowed: Callable[[], bool]) -> Restart | InProcessRun:
    """The recovery's part of one agent run, chosen from the job's ``--recovery``.

    Args:
        plan: This launcher's plan.
        epoch: The rendezvous epoch.
        board: The succession board (None: no succession, hpc run).
        names: The epoch's nodes by node rank (host names; none under hpc run).
        adopt: Workers kept through the old host's loss, taken by the first round.
        stopping: True once the launcher is stopping (a forwarded signal, its fence).
        keep_allowed: True while the workers may be kept through the host's loss (no stop
            signal came).
    """
    if plan.spec.recovery != recovery_settings.INPROCESS:
        return Restart()
    return InProcessRun(plan, epoch=epoch, board=board, names=names, adopt=adopt,
                        stopping=stopping, keep_allowed=keep_allowed)
