#!/usr/bin/env bash
# The embedded default: installs what it needs (idempotent), then runs PPO on SmolLM2-135M-Instruct with a
# sentiment reward, offline, in one process (on a GPU machine the same command runs on the GPU).
# Extra arguments override the config, e.g. `bash scripts/demo.sh --seed 7 --output_dir runs/seed7`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/install.sh" --demo
venv=${RLHF_VENV:-$root/.venv}
export HF_HUB_OFFLINE=1 WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}  # one process: let torch use every core
cd "$root"
overwrite=()
case " $* " in *" --resume "*|*" --overwrite_output_dir "*) ;; *) overwrite=(--overwrite_output_dir) ;; esac
exec "$venv/bin/python" launch/train_ppo.py --config examples/ppo_sentiment.yaml "${overwrite[@]}" "$@"
