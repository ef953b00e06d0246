#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages, the venv, then every tier
# (unit, distributed, slurm; the slurm tier brings up a real 3-node Slurm cluster itself).
# Extra arguments go to one pytest run, e.g. `bash scripts/test.sh -m unit`. Without any, three
# lanes run at once: the slurm tier (which mostly waits on the test cluster), the local tests
# that mostly wait on a clock (marker `waits`: pauses, grace periods, stall deadlines) with the
# in-process recovery tests (marker `inprocess`) and the unit tier (CPU-light: they fill the
# clock lane's idle time instead of lengthening the longest lane), and the rest (distributed,
# gpu, unmarked tests under tests/unit); the first two prefix their lines with [slurm] and
# [waits]. CI of ee064ef: distributed 33:49, waits+unit 19:12, slurm 32:09; the `inprocess`
# tests (~7 min there) moved from the first lane to the second.
# HPC_TEST_LANES=1 runs everything in one pytest instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-system.sh
bash scripts/setup.sh
export HPC_TEST_COSTS="$PWD/.test-costs"   # one record per test (tests/costs.py)
rm -rf "$HPC_TEST_COSTS"
if [ $# -gt 0 ] || [ "${HPC_TEST_LANES:-2}" = 1 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
lanes="$PWD/.test-lanes"   # each lane's whole output, for the summary at the end
rm -rf "$lanes" && mkdir -p "$lanes"
( set -o pipefail
  HPC_TEST_LANE=slurm PYTHONUNBUFFERED=1 .venv/bin/python -m pytest -m slurm -p no:cacheprovider 2>&1 | tee "$lanes/slurm.log" | sed -u 's/^/[slurm] /' ) &
slurm=$!
( set -o pipefail
  HPC_TEST_LANE=waits PYTHONUNBUFFERED=1 .venv/bin/python -m pytest -m "(waits or unit or inprocess) and not slurm" -p no:cacheprovider 2>&1 | tee "$lanes/waits.log" | sed -u 's/^/[waits] /' ) &
waits=$!
set +e
HPC_TEST_LANE=distributed .venv/bin/python -m pytest -m "not slurm and not waits and not unit and not inprocess" 2>&1 | tee "$lanes/distributed.log"
local_rc=$?
wait "$waits"
waits_rc=$?
wait "$slurm"
slurm_rc=$?
.venv/bin/python -m tests.costs "$HPC_TEST_COSTS" || true
# The lanes' outputs interleave: each failing lane's verdict again, whole, where the end of the log shows it.
for lane in distributed:$local_rc waits:$waits_rc slurm:$slurm_rc; do
  name=${lane%%:*} rc=${lane##*:}
  [ "$rc" -eq 0 ] && continue
  echo "== lane $name exit $rc: its failures =="
  if grep -qE '^(FAILED|ERROR) ' "$lanes/$name.log"; then
    grep -E '^(FAILED|ERROR) |^=+ .*(failed|error).* in ' "$lanes/$name.log"
  else
    tail -n 40 "$lanes/$name.log"   # no test failed: the lane itself did (collection, the cluster, a crash)
  fi
done
echo "test lanes: distributed+gpu exit $local_rc, waits+inprocess+unit exit $waits_rc, slurm exit $slurm_rc"
[ "$local_rc" -eq 0 ] && [ "$waits_rc" -eq 0 ] && [ "$slurm_rc" -eq 0 ]
