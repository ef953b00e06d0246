#!/usr/bin/env bash
# Creates ./.venv with hpc-elastic and its dependencies (idempotent).
# torch is pinned to the CPU wheel first, so the `torch>=2.4` requirement never pulls CUDA
# (nor lightning's or accelerate's: the check below fails if anything replaced it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.hpc-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 -e ".[dev,frameworks]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, hpc, runtime; assert torch.__version__.startswith('2.13'), torch.__version__"
  touch "$stamp"
fi
