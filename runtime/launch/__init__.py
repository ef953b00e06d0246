"""The per-node launcher: one process per node of the allocation (``python -m runtime.launch``).

Slurm starts one task per node; each runs this launcher, which prepares the node (network
interfaces, CPU binding, health check), plans torch's elastic agent (:mod:`.plan`, a frozen
:class:`~runtime.launch.plan.LaunchPlan`), runs it and forwards the stop signals to its workers
(:mod:`.main`, :mod:`.forwarding`, :mod:`.parent_watch`), with hot spares waiting in the
rendezvous (:mod:`.spares`). torch's agent is one class per run (:mod:`.agent`); how the job
recovers from a lost worker is asked of one object (:mod:`.recovery`: in-process recovery's
launcher side is :mod:`runtime.inprocess.launcher`). What happens when the agent returns, the
end of an allocation, is :mod:`runtime.ending`. ``hpc doctor`` runs the launcher's checks ahead
of a job (:mod:`.doctor`).

Nothing here runs inside a training process: the worker side is :mod:`runtime.worker` (with the
user-facing :mod:`runtime.session` and :mod:`runtime.sampler`); modules both sides use sit at
the top of :mod:`runtime` (tests/unit/test_rooms.py keeps it so).
"""
