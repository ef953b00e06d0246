"""The training processes: every worker the elastic agent starts (``python -m runtime.worker``).

:mod:`.start` binds each worker to its agent and runs the user's script; the script's
:class:`runtime.session.Session` (the user's import path stays at the top of :mod:`runtime`,
with :mod:`runtime.sampler`) uses the rest of this folder: the metric sinks (:mod:`.metrics`,
:mod:`.wandb_sink`), the progress record (:mod:`.progress`), per-rank RNG state (:mod:`.rng`)
the DDP wrapper (:mod:`.ddp`), the fork server and what makes a warm process a worker
(:mod:`.forkserver`, :mod:`.warm`). Checkpoints (:mod:`runtime.checkpoint`) run here too, and
in-process recovery's worker side (:mod:`runtime.inprocess.worker`, ``--recovery inprocess``).

Nothing here runs in the per-node launcher (:mod:`runtime.launch`); modules both sides use sit
at the top of :mod:`runtime` (tests/unit/test_rooms.py keeps it so).
"""
