#!/usr/bin/env bash
# Quick start: set up, then train the example GPT on 2 local processes (no Slurm needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hpc run examples/train_gpt.py --nproc-per-node 2 "$@" -- --preset tiny
