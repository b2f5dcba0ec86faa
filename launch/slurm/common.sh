# Shared by the sbatch scripts in launch/slurm/ (sourced; sbatch runs a copy of the script from its spool folder,
# so the scripts find the repository through RLHF_REPO or the folder `sbatch` was called from).
#
#   REPO         the repository (RLHF_REPO, default: $SLURM_SUBMIT_DIR)
#   VENV         its virtual environment (RLHF_VENV, default: $REPO/.venv; RLHF_VENV=none: use the current python)
#   OUTPUT_DIR   the run folder (required): metrics, checkpoints; the SAME on every requeue, so --resume auto finds
#                the newest complete checkpoint there
#   GPUS_PER_NODE  from SLURM (SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE), else 1
#   MASTER_PORT  15000 + job id % 10000 (rlhf_engine.engine.distributed.slurm_port), unless set
#   SAVE_MINUTES  --save_interval_minutes of every launch (default 30)
#   RLHF_SIGNAL_STEPS=1  on preemption also signal the job's srun steps (scancel --signal=USR1; the srun script)
#   RLHF_DRY_RUN=1  print the training command instead of running it (how tests check these scripts)
set -euo pipefail

REPO=${RLHF_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO"
if [ "${RLHF_VENV:-}" != "none" ] && [ -f "${RLHF_VENV:-$REPO/.venv}/bin/activate" ]; then
  # shellcheck disable=SC1090,SC1091
  . "${RLHF_VENV:-$REPO/.venv}/bin/activate"
fi
: "${OUTPUT_DIR:?set OUTPUT_DIR to the run folder (checkpoints and metrics; the same on every requeue)}"
PYTHON=${PYTHON:-python}

gpus_per_node() {
  local g=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-1}}
  g=${g##*:}          # "h100:8" -> 8
  echo "${g%%(*}"     # "8(x2)" -> 8
}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(gpus_per_node)}
NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}
MASTER_PORT=${MASTER_PORT:-$((15000 + ${SLURM_JOB_ID:-0} % 10000))}

# OMP_NUM_THREADS (unless set): the task's CPUs shared by the ranks this task starts, at least 1
set_omp_threads() {
  local ranks=${1:-1} cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
  [ "$ranks" -ge 1 ] || ranks=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / ranks > 0 ? cpus / ranks : 1 ))}
}

# every launch continues the run: --resume auto picks the newest checkpoint with a COMPLETE marker (none: iteration
# 0); a checkpoint at least every SAVE_MINUTES (default 30) bounds what a kill without a signal loses. Flags after the
# script come later and win (e.g. --save_interval_minutes 10).
TRAIN_ARGS=(--output_dir "$OUTPUT_DIR" --resume auto --save_interval_minutes "${SAVE_MINUTES:-30}")

# The rank processes below process $1 (their environment holds LOCAL_RANK, which launchers set for ranks only) get
# signal $2; the launchers between are left alone (SIGUSR1 would kill a launcher, and it would kill its ranks).
signal_ranks() {
  local pid
  for pid in $(pgrep -P "$1" 2>/dev/null || true); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -q '^LOCAL_RANK='; then
      kill -s "$2" "$pid" 2>/dev/null || true
    else
      signal_ranks "$pid" "$2"
    fi
  done
}

# Run a command and requeue the job if it stopped preempted. On SIGUSR1 (#SBATCH --signal=B:USR1@<seconds> before
# the time limit) or SIGTERM the batch shell asks the ranks to stop: SIGUSR1 to the rank processes it started on this
# node, `scancel --signal=USR1` to the job's srun steps when RLHF_SIGNAL_STEPS=1 (tasks on every node), and the
# request file $OUTPUT_DIR/PREEMPT_REQUESTED for ranks no signal reaches (pdsh-started nodes). At their next
# iteration boundary the ranks write a complete checkpoint, rank 0 writes $OUTPUT_DIR/PREEMPTED, and they exit with
# 75. The job is requeued when that marker is there, and only then (srun --kill-on-bad-exit and torchrun do not pass
# 75 through; the deepspeed launcher does). Requeued, it resumes from that checkpoint (--resume auto). A kill without
# a signal (node failure) requeues through #SBATCH --requeue and resumes from the newest complete checkpoint: set
# --save_interval_minutes to bound what is repeated.
run_requeueable() {
  if [ "${RLHF_DRY_RUN:-0}" = 1 ]; then
    printf 'DRY RUN: OMP_NUM_THREADS=%s' "$OMP_NUM_THREADS"; printf ' %q' "$@"; printf '\n'
    return 0
  fi
  mkdir -p "$OUTPUT_DIR"
  rm -f "$OUTPUT_DIR/PREEMPTED" "$OUTPUT_DIR/PREEMPT_REQUESTED"  # a new attempt: the last one's are answered
  local child rc=0
  preempt() {
    echo "[slurm] $1 received: asking the ranks to checkpoint and stop (exit 75, then requeue)"
    : > "$OUTPUT_DIR/PREEMPT_REQUESTED"
    signal_ranks "$child" USR1
    if [ "${RLHF_SIGNAL_STEPS:-0}" = 1 ]; then
      scancel --signal=USR1 "$SLURM_JOB_ID" || true
    fi
  }
  trap 'preempt USR1' USR1
  trap 'preempt TERM' TERM
  "$@" &
  child=$!
  while true; do
    wait "$child" && rc=0 || rc=$?
    kill -0 "$child" 2>/dev/null || break   # wait was interrupted by the trap: the child still runs
  done
  trap - USR1 TERM
  if [ -f "$OUTPUT_DIR/PREEMPTED" ]; then
    echo "[slurm] preempted with a complete checkpoint (exit $rc): requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$rc"
}
