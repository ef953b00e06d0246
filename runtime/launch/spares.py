"""Hot spares in the launcher: torch's own redundancy list holds them, this notes their release.

``--spare-nodes K`` starts a launcher on ``MAX + K`` nodes, each running torch's elastic agent
with ``--nnodes MIN:MAX``. torch 2.13's c10d rendezvous
(``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``, ``_RendezvousJoinOp``) puts a
node that arrives when the round already has ``MAX`` participants on its *redundancy list*:
unlike the wait list, it does not make the members restart their workers; the node keeps a
heartbeat and holds no rank. When a participant is lost (its heartbeat expires, or its agent
leaves the round after its workers failed) the round has room again, the spare moves to the
wait list, and the next round takes it in: the group re-forms at the same world size and
resumes from the last checkpoint (verified on torch 2.13: ``MIN:MAX = 2:2`` with three agents,
the third waits without a worker; SIGKILL of a member's agent and worker, and the third
starts as rank 1 of world 2). Every launcher runs the same code; which nodes wait is torch's
choice, read back from the events (:mod:`hpc.contract.spare_waits`).

What is left here: when the job ends while a spare still waits, the members close the
rendezvous and torch ends the spare's agent with ``RendezvousGracefulExitError``, which its
``agent.run`` logs at INFO and swallows, returning None, which ``launch_agent`` then fails on
(``AttributeError: 'NoneType' object has no attribute 'is_failed'``). :class:`SpareRelease`
notes torch's log line so that the launcher takes that end for what it is: a spare that was
not needed. (A spare that finds the store already gone ends with a rendezvous error and
follows node 0's recorded outcome, as any node does: :func:`runtime.ending.outcome.finish`.)
"""

from __future__ import annotations

import logging

AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
RELEASED = "Rendezvous gracefully exited"


class SpareRelease(logging.Filter):
    """Notes torch's line that this node's pending rendezvous was closed (the job ended).

    Installed on the agent's logger, which it lets log INFO so that the line is seen at all;
    every other INFO line is dropped here as before (the launcher keeps torch at WARNING).
    """

    def __init__(self) -> None:
        super().__init__()
        self.released: str | None = None
        self._logger = logging.getLogger(AGENT_LOGGER)
        self._level = self._logger.level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            message = record.getMessage()
            if message.startswith(RELEASED):
                self.released = message
            return False
        return True

    def __enter__(self) -> SpareRelease:
        self._logger.addFilter(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeFilter(self)
        self._logger.setLevel(self._level)


def was_released(release: SpareRelease, error: BaseException) -> bool:
    """Whether ``error`` from the agent is torch failing on a spare's graceful release."""
    return release.released is not None and isinstance(error, AttributeError)
