#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages, the venv, then every tier
# (unit, distributed, slurm; the slurm tier brings up a real 3-node Slurm cluster itself).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m unit`. The slurm tier runs beside the
# others (two pytest-xdist lanes, see tests/conftest.py); HPC_TEST_WORKERS=0 runs all in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-system.sh
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n "${HPC_TEST_WORKERS:-2}" --dist loadgroup "$@"
