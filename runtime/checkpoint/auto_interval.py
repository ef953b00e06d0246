"""``--checkpoint-interval auto[:MTBF]``: the job's checkpoint interval, decided in the job.

The rule itself is pure and lives in the contract (:mod:`hpc.contract.young_daly`: the
Young/Daly optimum within its bounds; :mod:`hpc.contract.interval`: the prior MTBF of the
mode and the probe's distance). This module is the in-job decision around it: after the
restore it reads the job's history (``events.jsonl``, rank 0 only), chooses the interval and
sets the checkpointer's schedule; with no save measured yet it asks for a first save
:data:`~hpc.contract.interval.PROBE_AFTER_STEPS` steps on, and once that save commits it
decides again from its measured cost.

Every rank runs it (each sets a minute interval, so the checkpointer's collective decision
runs everywhere; rank 0's value decides). The choice is handed to ``emit`` as one
``ckpt_interval`` event; recording it is the caller's business.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

from hpc.contract import young_daly
from hpc.contract.events import read_events
from hpc.contract.interval import PROBE_AFTER_STEPS, prior_mtbf_s

log = logging.getLogger(__name__)


class AutoInterval:
    """One worker's auto interval: decided after the restore, again after the first measured save.

    Args:
        job_dir: the job folder (its ``events.jsonl`` is the history).
        rank: this worker's rank; only rank 0 reads the history and logs the choice.
        key: ``(allocation, restart)`` of this worker's life, the history's current one.
        emit: where the ``ckpt_interval`` event goes (``emit(ev, **fields)``).
    """

    def __init__(self, job_dir: Path, *, rank: int, key: tuple[int, int],
                 emit: Callable[..., None]) -> None:
        self.job_dir, self.rank, self.key, self._emit = Path(job_dir), rank, key, emit
        self._estimated_prior: float | None = None

    def restored(self, ckpt: Any, step: int, mode: str) -> None:
        """After the restore: decides when ``mode`` is ``auto[:MTBF]`` (else does nothing)."""
        prior = prior_mtbf_s(mode)
        if prior is not None and ckpt is not None:
            self._tune(ckpt, prior, probe_from=step)

    def committed(self, ckpt: Any) -> None:
        """After a save committed: the first measured one decides again."""
        if self._estimated_prior is not None:
            prior, self._estimated_prior = self._estimated_prior, None
            self._tune(ckpt, prior)

    def _tune(self, ckpt: Any, prior: float, probe_from: int | None = None) -> None:
        """Sets the interval; with no measured save yet and ``probe_from`` given, also a first
        save :data:`~hpc.contract.interval.PROBE_AFTER_STEPS` steps after it."""
        hist = young_daly.history(read_events(self.job_dir) if self.rank == 0 else [], current=self.key)
        cost, total, source = hist.save_cost_s, hist.save_total_s, "measured"
        probe = None
        if cost is None:
            cost = total = float(ckpt.estimated_save_s())
            source, self._estimated_prior = "estimated", prior
            probe = probe_from + PROBE_AFTER_STEPS if probe_from is not None else None
        choice = young_daly.choose(save_cost_s=cost, save_total_s=total or cost, prior_mtbf_s=prior,
                                   observed_s=hist.observed_s, interruptions=hist.interruptions,
                                   source=source)
        ckpt.schedule = dataclasses.replace(ckpt.schedule, every_min=choice.every_s / 60.0,
                                            probe_step=probe or ckpt.schedule.probe_step)
        self._emit("ckpt_interval", **choice.to_dict(), probe_step=probe)
        if self.rank == 0:
            log.info("checkpoint interval auto: every %.0fs (sqrt(2 x save %.3fs (%s) x MTBF %.0fs) = "
                     "%.0fs, kept within %.0f-%.0fs; %d interruption(s) in %.0fs + prior %.0fs)%s",
                     choice.every_s, cost, source, choice.mtbf_s, choice.optimum_s,
                     young_daly.MIN_INTERVAL_S, young_daly.MAX_INTERVAL_S, hist.interruptions,
                     hist.observed_s, prior, f"; a first save at step {probe} measures its cost"
                     if probe is not None else "")
