#!/usr/bin/env bash
# The TRL yardstick's own environment (.venv-trl at the repository root): TRL's GRPOTrainer and what it needs, at the
# versions bench/trl_grpo/run.py was measured with; torch pinned in the same pip command (a later resolve would
# otherwise take a CUDA build). Nothing of the project is installed here: run.py loads the two project files it uses
# (the reward and the freezing) from the checkout.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${RLHF_TRL_VENV:-$root/.venv-trl}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -r "$root/bench/trl_grpo/requirements.txt"
echo "[trl] $venv: $("$venv/bin/python" -c 'import trl, transformers, torch; print("trl", trl.__version__, "transformers", transformers.__version__, "torch", torch.__version__)')"
