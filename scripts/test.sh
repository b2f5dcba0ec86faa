#!/usr/bin/env bash
# The test suite: installs what it needs (idempotent, see scripts/install.sh), then runs the default suite
# (everything not marked slow or gpu; the vllm tests skip, saying why, in this environment). `--slow` runs the slow
# tests instead; `--vllm` installs the vLLM environment (.venv-vllm) and runs the vllm tests in it. Other arguments
# go to pytest, e.g. `bash scripts/test.sh tests/unit -q`; the selection below applies unless they give their own -m.
# Without a path, the default suite runs in two pytest calls: tests/unit and tests/e2e on two processes
# (pytest-xdist), then tests/distributed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=default
if [ "${1:-}" = "--slow" ] || [ "${1:-}" = "--vllm" ]; then mode=${1#--}; shift; fi
case $mode in
  slow) bash "$root/scripts/install.sh" --demo; venv=${RLHF_VENV:-$root/.venv}; select="slow and not gpu" ;;
  vllm) bash "$root/scripts/install.sh" --vllm; venv=${RLHF_VLLM_VENV:-$root/.venv-vllm}
        select="vllm and not slow and not gpu" ;;
  *) bash "$root/scripts/install.sh"; venv=${RLHF_VENV:-$root/.venv}; select="not slow and not gpu" ;;
esac
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions}  # per venv: never rebuild shared ops
cd "$root"
given_m=0 given_path=0
for a in "$@"; do
  [ "$a" = "-m" ] && given_m=1
  case $a in -*) ;; *) [ -e "${a%%::*}" ] && given_path=1 ;; esac
done
if [ "$given_m" = 0 ]; then set -- -m "$select" "$@"; fi
if [ "$mode" = default ] && [ "$given_path" = 0 ] && "$venv/bin/python" -c "import xdist" 2>/dev/null; then
  # The whole default suite: the unit tests and the single-process e2e ones in two processes (such a test keeps one
  # core busy; the second would sit idle), whole files per process; then the multi-rank tests one at a time (each
  # launch already has its ranks on both cores). tests/e2e first: its one long file starts while the other process
  # takes the unit files, not alone at the end.
  rc1=0 rc2=0
  "$venv/bin/python" -m pytest -n 2 --dist loadfile tests/e2e tests/unit "$@" || rc1=$?
  "$venv/bin/python" -m pytest tests/distributed "$@" || rc2=$?
  # 5 = no test selected: fine in one half (a -k that matches only unit tests), not in both
  if [ "$rc1" = 5 ] && [ "$rc2" = 5 ]; then exit 5; fi
  [ "$rc1" = 5 ] && rc1=0; [ "$rc2" = 5 ] && rc2=0
  exit $(( rc1 != 0 ? rc1 : rc2 ))
fi
exec "$venv/bin/python" -m pytest "$@"
