"""The job contract: what the login node writes and the job reads (torch-free, both sides).

Code here runs on the login node (``hpc submit`` writes it) *and* inside the job (the
per-node launcher and the workers read it), so it stays small and imports nothing heavy:

* :mod:`~hpc.contract.jobspec`: the typed, validated ``JobSpec`` (``jobspec.json``);
* :mod:`~hpc.contract.jobdir`: the job directory's layout, every file name in one place,
  and its records (outcomes, progress);
* :mod:`~hpc.contract.environment`: the launcher-to-worker environment (``HPC_*``), one
  writer and one reader;
* :mod:`~hpc.contract.values`, :mod:`~hpc.contract.errors`: value parsers and user errors;
* :mod:`~hpc.contract.slurm`, :mod:`~hpc.contract.slurm_parse`: the one Slurm client (sbatch,
  squeue, sacct, scontrol, scancel with retries) and the pure parsers of its output.
"""
