#!/bin/bash
# Rendered by hpc-elastic (slurm_templates/sbatch_elastic.sh.j2). Re-render instead of editing.
# No --ntasks-per-node here: with it, Slurm 22.05 grants the *minimum* of a MIN-MAX node range
# even when more nodes are idle (measured); srun below starts one task per node itself.
# One Slurm task per node runs the per-node launcher (runtime.launch), which runs torch's
# elastic agent with a c10d rendezvous on the allocation's first node.
#
# #SBATCH values are escaped for sbatch's own option parser (double quotes, and a backslash
# before every character that is not plainly safe); values in the shell body are shell-quoted.
#SBATCH --job-name=gpt
#SBATCH --nodes=2
#SBATCH --gres=gpu:8
#SBATCH --output=/scratch/me/jobs/gpt-1/logs/slurm-%j.out
#SBATCH --open-mode=append
#SBATCH --export=ALL
#SBATCH --no-kill
#SBATCH --signal=USR2@120
#SBATCH --requeue

set -u
JOB_DIR=/scratch/me/jobs/gpt-1
PYTHON=/opt/venv/bin/python
ALLOCATION="${SLURM_RESTART_COUNT:-0}"

# The c10d rendezvous runs on the allocation's first node. HPC_RDZV_HOST is its one source:
# srun's tasks inherit it and the launchers read it (runtime.env.rendezvous_host).
HPC_RDZV_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
export HPC_RDZV_HOST
export HPC_JOB_DIR="$JOB_DIR"
echo "hpc: job ${SLURM_JOB_ID} allocation ${ALLOCATION} on ${SLURM_JOB_NODELIST}" \
     "(${SLURM_JOB_NUM_NODES} nodes); rendezvous on ${HPC_RDZV_HOST}; $(date -Is)"

# Slurm signals the batch shell too (SIGTERM on preemption or scancel). bash would die at
# once and take the job with it before the workers have saved, so the shell only notes the
# signal and keeps waiting; the launchers forward it to the workers, which agree and save.
STOP_SEEN=0
trap 'STOP_SEEN=1; echo "hpc: batch shell got SIGTERM; waiting for the workers to save" >&2' TERM
trap 'echo "hpc: batch shell got SIGUSR2; waiting for the workers" >&2' USR2

# --setup, here in the batch shell before srun, so that what it sets (module load, a venv's
# PATH) reaches srun and the job; then again on each node in the step, before the launcher
# (HPC_NODE_SETUP below). A failing line ends the job.
set +u
{
module load apptainer
} || { echo "hpc: --setup line 1 failed in the batch shell on $(hostname): "'module load apptainer' >&2; exit 1; }
set -u
IFS= read -r -d '' HPC_NODE_SETUP <<'HPC_SETUP_EOF' || true
{
module load apptainer
} || { echo "hpc: --setup line 1 failed on $(hostname): "'module load apptainer' >&2; exit 1; }
exec "$@"
HPC_SETUP_EOF

# The job runs in a container (apptainer), where Slurm's commands are not available: the
# batch shell (outside it) asks Slurm for the job's end time and the partition's GraceTime,
# which the launchers would otherwise ask for themselves, and does the requeue (below).
HPC_JOB_END_TIME="${SLURM_JOB_END_TIME:-}"
if [ -z "$HPC_JOB_END_TIME" ]; then
    HPC_JOB_END_TIME="$(date -d "$(squeue -h -j "$SLURM_JOB_ID" -o %e)" +%s 2>/dev/null || true)"
fi
HPC_GRACE_S="$(scontrol show partition "${SLURM_JOB_PARTITION:-}" -o 2>/dev/null \
    | sed -n 's/.*GraceTime=\([0-9]*\).*/\1/p')"
export HPC_JOB_END_TIME HPC_GRACE_S

srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 --nodes="$SLURM_JOB_NUM_NODES" \
    bash -c "$HPC_NODE_SETUP" hpc-setup \
    apptainer exec --nv --bind /scratch/me/jobs/gpt-1:/scratch/me/jobs/gpt-1,/home/me:/home/me,/datasets:/data:ro /images/pytorch.sif \
    "$PYTHON" -m runtime.launch --job-dir "$JOB_DIR" &
SRUN_PID=$!
# A trapped signal interrupts `wait`; keep waiting until srun itself is gone, then collect
# its status (bash remembers it even when the interrupted wait already reaped it).
while kill -0 "$SRUN_PID" 2>/dev/null; do
    wait "$SRUN_PID"
done
wait "$SRUN_PID"
STATUS=$?
echo "hpc: srun exited with status ${STATUS}; $(date -Is)"

# A stop's SIGTERM that reached the launchers while they started (before their handlers) ends
# them undecided: no outcome for this allocation, no requeue. Exiting now, inside the grace
# time, would end the job for good (Slurm requeues a preempted job only when it has to kill
# it), so the shell waits for Slurm to end the stop itself: a preempted job is killed at the
# end of its grace time and requeued, a cancelled one ends.
if [ "$STOP_SEEN" = 1 ] && ! grep -Eqs "\"allocation\": ?${ALLOCATION}[,}]" "$JOB_DIR/outcomes.jsonl"; then
    echo "hpc: allocation ${ALLOCATION} was stopped before its launchers recorded anything;" \
         "waiting for Slurm to end the stop (a preemption requeues the job); $(date -Is)" >&2
    STOP_WAIT_END=$(( $(date +%s) + 900 ))
    while [ "$(date +%s)" -lt "$STOP_WAIT_END" ]; do
        sleep 1 &
        wait $!
    done
    echo "hpc: Slurm did not end the stop within 900 s; $(date -Is)" >&2
fi

# Exit 75: the workers saved and stopped (time limit near, or preemption). The requeue is
# decided by node 0's launcher (runtime.ending.requeue: exactly once per allocation); in the container
# it cannot run scontrol, so it leaves a request file and the batch shell requeues here.
REQUEUE_REQUEST="$JOB_DIR/requeue-request-alloc-${ALLOCATION}"
if [ -e "$REQUEUE_REQUEST" ]; then
    for attempt in 1 2 3 4 5; do
        if scontrol requeue "$SLURM_JOB_ID"; then
            echo "hpc: requeued job ${SLURM_JOB_ID}: $(cat "$REQUEUE_REQUEST")"
            break
        fi
        echo "hpc: scontrol requeue ${SLURM_JOB_ID} failed (attempt ${attempt}); retrying" >&2
        sleep 5
    done
fi
exit "$STATUS"
