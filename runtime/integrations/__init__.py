"""Worker-side glue for training frameworks that own their loop (Hugging Face ``Trainer``).

Each module imports its framework at module load, so import it only from a training script:
nothing on the login side (``hpc``) or in the launcher imports this package.
"""
