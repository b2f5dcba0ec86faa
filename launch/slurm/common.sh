# Shared by the sbatch scripts in launch/slurm/ (sourced; sbatch runs a copy of the script from its spool folder,
# so the scripts find the repository through RLHF_REPO or the folder `sbatch` was called from).
#
#   REPO         the repository (RLHF_REPO, default: $SLURM_SUBMIT_DIR)
#   VENV         its virtual environment (RLHF_VENV, default: $REPO/.venv; RLHF_VENV=none: use the current python)
#   OUTPUT_DIR   the run folder (required): metrics, checkpoints; the SAME on every requeue, so --resume auto finds
#                the newest complete checkpoint there
#   GPUS_PER_NODE  from SLURM (SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE), else 1
#   MASTER_PORT  15000 + job id % 10000 (rlhf_engine.engine.distributed.slurm_port), unless set
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

# every launch continues the run: --resume auto picks the newest checkpoint with a COMPLETE marker (none: iteration 0)
TRAIN_ARGS=(--output_dir "$OUTPUT_DIR" --resume auto)

# Run a command; on SIGUSR1 (#SBATCH --signal=B:USR1@<seconds> before the time limit) requeue the job. Requeued, it
# starts again from the top and resumes from the newest complete checkpoint (progress since then is repeated:
# choose --save_interval accordingly). A node failure requeues the same way (#SBATCH --requeue).
run_requeueable() {
  if [ "${RLHF_DRY_RUN:-0}" = 1 ]; then
    printf 'DRY RUN: OMP_NUM_THREADS=%s' "$OMP_NUM_THREADS"; printf ' %q' "$@"; printf '\n'
    return 0
  fi
  requeue() {
    echo "[slurm] signal before the time limit: requeueing job $SLURM_JOB_ID (resumes from its newest checkpoint)"
    scontrol requeue "$SLURM_JOB_ID"
  }
  trap requeue USR1
  "$@" &
  local child=$! rc=0
  while true; do
    wait "$child" && rc=0 || rc=$?
    kill -0 "$child" 2>/dev/null || break   # wait was interrupted by the trap: the child still runs
  done
  return "$rc"
}
