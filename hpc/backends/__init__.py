"""Backends: ways to start the same JobSpec.

Each backend turns a validated :class:`~hpc.contract.jobspec.JobSpec` into running per-node launchers
(``python -m runtime.launch``). ``local`` runs them as processes on this machine; ``sbatch``
renders ``slurm_templates/``; ``submitit`` and ``torchx`` hand the same launcher to those
libraries. Backends are imported lazily so optional heavy libraries stay optional.
"""
