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
# DeepSpeed on CPU JIT-compiles its shared-memory op (deepspeed_shm_comm) at its first
# init_distributed (232-330 s on 2 loaded cores). torch's default cache, ~/.cache/torch_extensions,
# is shared by every checkout on the machine and a build from another venv's path is rebuilt, so
# the tests use this venv's own (tests/conftest.py sets TORCH_EXTENSIONS_DIR) and it is built
# here, once, rather than inside a test's deadline.
if [ ! -e .venv/torch_extensions/deepspeed_shm_comm/deepspeed_shm_comm.so ]; then
  TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions" .venv/bin/python -c "from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder('ShareMemCommBuilder')
b is None or b.load()" >/dev/null 2>&1 || echo "setup: DeepSpeed's CPU op did not build (the first test using DeepSpeed will build it)"
fi
# The test suite's process count (tests/costs.py): each interpreter started with HPC_TEST_PROCS
# set appends a line to that file; without it, one environment lookup.
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$site/hpc_test_procs.pth.new" <<'PTH'
import os; exec("try:\n p = os.environ.get('HPC_TEST_PROCS')\n p and open(p, 'a').write(f'{os.getpid()}\\n')\nexcept OSError:\n pass")
PTH
mv "$site/hpc_test_procs.pth.new" "$site/hpc_test_procs.pth"
# The project's own modules, compiled once: where PYTHONDONTWRITEBYTECODE is set (this sandbox's
# image sets it) nothing else writes them, and every process of a job or a test (thousands in
# the suite) recompiled runtime/ and hpc/ at each start (~0.3-0.5 s of CPU each; pip already
# compiles site-packages). Stale ones are recompiled here after a pull (timestamps are checked).
.venv/bin/python -m compileall -q -j 0 hpc runtime examples benchmarks tests hydra_plugins >/dev/null || true
