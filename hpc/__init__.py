"""hpc-elastic: the login-node side.

Everything under ``hpc`` runs on a login node, where start-up time matters and GPUs do not
exist, so nothing here imports torch, wandb or torchx at module load. Backends that need
those libraries import them inside the function that uses them.
"""

__version__ = "0.1.0"
