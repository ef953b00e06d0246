"""Hydra launcher plugin: ``python train.py -m hydra/launcher=hpc lr=1e-3,3e-4``.

A Hydra multirun becomes ONE hpc-elastic job array (:mod:`hpc.sweeps`), a task per
combination of overrides, each a full hpc job (elastic, requeued on its own, its own job
directory and W&B run in the sweep's group); the launcher waits for the array and hands Hydra
each task's return value, as hydra-submitit-launcher does for submitit.
``hydra/launcher=hpc_local`` runs the same tasks one after another with ``hpc run``.

Layout as Hydra requires: ``hydra_plugins`` is a namespace package that Hydra scans, and
importing :mod:`.config` registers the two launcher configs. Modules named ``_*`` are not
imported by the scan (:mod:`._task` runs inside the job only).
"""

__version__ = "0.1.0"
