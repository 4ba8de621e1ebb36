#!/bin/bash
# A SLURM batch job that survives time limits and preemption: train, stop cleanly before the end, requeue, resume.
#
#   sbatch scripts/slurm_job.sh --params parameters.yml --set dist.strategy=ddp [--set section.key=value ...]
#
# Submit from the project directory; the arguments go to main.py. How it works (docs/slurm.md):
# 120 s before the time limit SLURM sends SIGUSR1 to this batch shell (--signal=B:USR1@120). The shell forwards
# it to the training step; every rank stops at the next step boundary, a checkpoint is saved, and main.py exits
# with code 3. The shell then requeues the job (same job id, same output file), and the next start resumes from
# that checkpoint (train.resume: auto, the default). Exit code 0 from main.py: finished; anything else: the job
# fails and is not requeued (a crash would only crash again).
#
# Edit the resources below. One task per GPU (or per CPU process, gloo); the ranks meet on the first node.
#SBATCH --job-name=trainer
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# GPUs: add e.g. `#SBATCH --gpus-per-node=2`, with as many tasks per node as GPUs.

case "${1:-}" in  # the usage is the comment above (sbatch --help would run main.py --help on every task)
    -h|--help) sed -n '2,/^# Edit/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
if [ -z "${SLURM_JOB_ID:-}" ]; then  # outside a job srun fails in lines of its own, then read as a crash here
    echo "error: scripts/slurm_job.sh is a SLURM batch job: submit it with sbatch scripts/slurm_job.sh --params ..." \
         "(no SLURM_JOB_ID here; without SLURM run python main.py, docs/running.md)" >&2
    exit 2
fi

MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${TRAINER_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}  # per job: jobs sharing a node do not collide
echo "$(date '+%F %T') job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1)), nodes $SLURM_JOB_NODELIST"

# Our --set go first: yours win. (No --kill-on-bad-exit: it would count the stopped ranks' exit code 3 as a failure
# and kill the others while they finish; a crashed or frozen rank ends the others by itself, see docs/slurm.md.)
# A requeued start resumes: a train.start_over=true among yours would move each stop's checkpoint aside again.
AGAIN=()
[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && AGAIN=(--set train.start_over=false)
srun python main.py --set dist.master_addr="$MASTER" --set dist.master_port="$PORT" "$@" "${AGAIN[@]}" &
STEP=$!
trap 'echo "$(date +%T) SIGUSR1: asking the ranks to save and stop"; kill -USR1 $STEP' USR1
while kill -0 "$STEP" 2>/dev/null; do
    wait "$STEP"  # returns early when a trapped signal arrives; then wait again
done
wait "$STEP"; CODE=$?  # the step's exit code (bash keeps it once the step has ended)

case $CODE in
    0) echo "$(date +%T) finished" ;;
    3) echo "$(date +%T) stopped with a checkpoint saved: requeueing job $SLURM_JOB_ID to resume"
       scontrol requeue "$SLURM_JOB_ID" && exit 0
       echo "scontrol requeue failed: resubmit this job to resume" ;;
    *) echo "$(date +%T) main.py exited with code $CODE (1 crash, 2 user error, 4 diverged): not requeued" ;;
esac
exit $CODE
