#!/usr/bin/env bash
# Installs torchft 0.2.0 into the project's venv for the fault campaign's `torchft` contender
# (benchmarks/campaign.py --contenders torchft). Benchmark-only: no test and no CI lane needs it.
# --no-deps: torchft requires torch>=2.7 (the venv's pinned 2.13.0 CPU build satisfies it, and
# nothing may replace it with a CUDA build) and OpenTelemetry (api, sdk, otlp-proto-http >= 1.39,
# imported by `import torchft`), which the venv already has through the project's dependencies
# (1.45.2; `pip check` reports nothing missing). The check at the end fails if torch changed or
# torchft does not import.
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/pip install -q --disable-pip-version-check --no-deps torchft==0.2.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, torchft; assert torch.__version__.startswith('2.13'), torch.__version__; print('torchft', torchft.__file__, 'torch', torch.__version__)"
test -x .venv/bin/torchft_lighthouse
