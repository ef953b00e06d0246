"""The Session's one seam to how a job recovers from a lost worker (``--recovery``).

The Session (:mod:`runtime.session`) runs the user's loop the same way whatever the recovery;
what differs is asked, at fixed points of the loop, of one object made once at its start by
:func:`for_session` (the one place the worker compares the mode):

- :class:`Restart`, the restart path: a lost peer fails a collective, the worker ends, and
  torch's agent starts every worker again from the last checkpoint; every point does nothing;
- :class:`runtime.inprocess.worker.session_part.InProcessSession` (``--recovery inprocess``):
  the survivors leave the failed generation and go on in a new one, a joiner is taken in with
  the state from its peers' memory.

The points, in the order of a run: :meth:`~Restart.init_group` and :meth:`~Restart.cpu_group`
(``start``), :meth:`~Restart.joiner_flag` (the preemption agreement), :meth:`~Restart.busy`
(``phase``), :meth:`~Restart.sharded` and :meth:`~Restart.ddp_options` (``wrap``),
:meth:`~Restart.attach`, :meth:`~Restart.bind` and :meth:`~Restart.receive` (``restore``), :meth:`~Restart.at_save`,
:meth:`~Restart.begin`, :meth:`~Restart.after_body`, :meth:`~Restart.after_step`,
:meth:`~Restart.settle` and :meth:`~Restart.survives` (each step), :meth:`~Restart.keep_row`
(metrics), :meth:`~Restart.close`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist

from hpc.contract import recovery_settings
from runtime.worker import group_store

Session = Any   # runtime.session.Session (not imported: it imports this module)


class Restart:
    """The restart path's part of a Session: nothing beyond torch's own process group.

    Its methods are the seam: the in-process part has the same ones (duck-typed; it lives in
    its wing and does not import this module)."""

    joining = False         # a joiner (a restarted worker, a hot spare's) is taken in by its peers
    fixes_buckets = False   # DDP's bucket layout must be fixed whatever the script asks

    def init_group(self, session: Session, backend: str) -> None:
        """Forms the job's process group; on one machine its store listens on loopback only."""
        dist.init_process_group(backend, timeout=session.timeout,
                                device_id=session.device if backend == "nccl" else None,
                                **group_store.loopback_store(os.environ, session.timeout))

    def cpu_group(self, backend: str, timeout: Any) -> Any:
        """The group for CPU tensors (control traffic, metrics)."""
        return dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD

    def joiner_flag(self) -> Any:
        """What the preemption agreement also agrees on (a joiner waits), or None."""
        return None

    def busy(self, until: float | None) -> None:
        """This rank is in a phase of the user's until ``until`` (None: out of it)."""

    def sharded(self, *, mesh: bool) -> Restart:
        """The recovery that carries a sharded model (FSDP2; ``mesh``: on a device mesh)."""
        return self

    def ddp_options(self) -> dict[str, Any]:
        """DDP's constructor options this recovery needs."""
        return {}

    def attach(self, app_state: Mapping[str, Any]) -> None:
        """The training state ``restore`` registered (before its checkpointer is made)."""

    def bind(self, checkpointer: Any) -> None:
        """The checkpointer ``restore`` made."""

    def receive(self) -> int | None:
        """A joiner's step, with its state from the members' memory; None: read the checkpoint."""
        return None

    def at_save(self, step: int) -> None:
        """A save of ``step`` begins."""

    def begin(self, step: int) -> None:
        """The body of ``step`` begins."""

    def after_body(self, step: int, step_s: float) -> int | None:
        """The body of ``step`` returned after ``step_s`` s: the step to go on from when a peer
        was lost in it (the recovery ran), else None."""
        return None

    def after_step(self, step: int) -> None:
        """``step`` steps are done (before the boundary's agreements)."""

    def settle(self, works: Iterable[Any]) -> None:
        """Posted waits this rank must be able to leave when a peer is lost."""

    def survives(self, error: BaseException) -> bool:
        """Whether a failed collective at a step boundary is a peer lost that this recovery
        goes on from (then :meth:`recover_at_boundary`)."""
        return False

    def recover_at_boundary(self, error: BaseException) -> int:
        raise RuntimeError("the restart path recovers by restarting the workers") from error

    def grow(self) -> int:
        raise RuntimeError("the restart path takes no joiner in")

    def keep_row(self, step: int, row: Mapping[str, float]) -> None:
        """A reduced metric row, logged by rank 0 (in-process: every rank keeps it)."""

    def close(self, *, finished: bool) -> None:
        """The Session closes (``finished``: without an error)."""


def for_session(session: Session, backend: str) -> Any:
    """The recovery of this worker, chosen from the job's ``--recovery`` (the environment the
    launcher gave it): :class:`Restart`, or the in-process part when that path is on."""
    if not recovery_settings.InProcessEnvironment.from_env(os.environ).inprocess:
        return Restart()
    from runtime.inprocess.worker.session_part import InProcessSession

    return InProcessSession.start(session, backend, fallback=Restart) or Restart()
