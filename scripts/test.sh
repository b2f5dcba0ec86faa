#!/usr/bin/env bash
# The test suite: installs what it needs (idempotent, see scripts/install.sh), then runs the default suite
# (everything not marked slow or gpu). Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/install.sh"
venv=${RLHF_VENV:-$root/.venv}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions}  # per venv: never rebuild shared ops
cd "$root"
if [ $# -eq 0 ]; then set -- -m "not slow and not gpu"; fi
exec "$venv/bin/python" -m pytest "$@"
