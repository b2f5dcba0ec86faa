#!/usr/bin/env bash
# The test suite: installs what it needs (idempotent, see scripts/install.sh), then runs the default suite
# (everything not marked slow or gpu). `--slow` runs the slow tests instead; other arguments go to pytest, e.g.
# `bash scripts/test.sh tests/unit -q`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
slow=0
if [ "${1:-}" = "--slow" ]; then slow=1; shift; fi
if [ "$slow" = 1 ]; then bash "$root/scripts/install.sh" --demo; else bash "$root/scripts/install.sh"; fi
venv=${RLHF_VENV:-$root/.venv}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions}  # per venv: never rebuild shared ops
cd "$root"
if [ "$slow" = 1 ]; then set -- -m "slow and not gpu" "$@"  # the release checks (docs/testing.md), with the demo assets
elif [ $# -eq 0 ]; then set -- -m "not slow and not gpu"; fi
exec "$venv/bin/python" -m pytest "$@"
