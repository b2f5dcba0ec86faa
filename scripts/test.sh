#!/usr/bin/env bash
# The test suite: installs what it needs (idempotent, see scripts/install.sh), then runs the default suite
# (everything not marked slow or gpu; the vllm tests skip, saying why, in this environment). Other modes:
#   --learning  the learning job (.ci/run runs it beside the default suite and the vLLM job): the tests marked
#               `learning`, real runs of what users run: the GRPO example learns (shortened), the three steps of
#               docs/three-steps.md as scripts under the deepspeed launcher (2 ranks);
#   --release   the other slow tests (release checks: the full learning examples with their learning-rate-0
#               controls, elastic and launcher-signal runs, both launchers' equal metrics, bench/gpu.sh --tiny),
#               then the slow vllm tests in the vLLM environment (bench/gpu.sh --tiny --suite vllm);
#   --slow      both of the above;
#   --vllm      installs the vLLM environment (.venv-vllm) and runs the vllm tests in it (the vLLM job).
# Other arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -q`; the selection below applies unless they
# give their own -m. Without a path, the default suite (or the vLLM job) runs in one pytest call on two processes
# (pytest-xdist).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# Bytecode is written as the test processes import (as Python does by default), not compiled for every installed file
# at install (scripts/install.sh): where PYTHONDONTWRITEBYTECODE is set, it is unset here, for these processes only.
export RLHF_INSTALL_BYTECODE=${RLHF_INSTALL_BYTECODE:-lazy}
unset PYTHONDONTWRITEBYTECODE
mode=default
case "${1:-}" in --slow|--release|--learning|--vllm) mode=${1#--}; shift ;; esac
case $mode in
  slow) bash "$root/scripts/install.sh" --demo; venv=${RLHF_VENV:-$root/.venv}; select="slow and not gpu and not vllm"
        then_vllm="slow and vllm and not gpu" ;;
  release) bash "$root/scripts/install.sh" --demo; venv=${RLHF_VENV:-$root/.venv}
           select="slow and not learning and not gpu and not vllm"
           then_vllm="slow and vllm and not learning and not gpu" ;;
  learning) bash "$root/scripts/install.sh" --demo; venv=${RLHF_VENV:-$root/.venv}; select="learning and not gpu" ;;
  vllm) bash "$root/scripts/install.sh" --vllm; venv=${RLHF_VLLM_VENV:-$root/.venv-vllm}
        select="vllm and not slow and not gpu"
        export RLHF_ENGINE_TEST_REQUIRE_VLLM=1 ;;  # a vllm test that skips fails the job (tests/conftest.py)
  *) bash "$root/scripts/install.sh"; venv=${RLHF_VENV:-$root/.venv}; select="not slow and not gpu" ;;
esac
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions}  # per venv: never rebuild shared ops
cd "$root"
then_vllm=${then_vllm:-}
given_m=0 given_path=0
for a in "$@"; do
  [ "$a" = "-m" ] && given_m=1
  case $a in -*) ;; *) [ -e "${a%%::*}" ] && given_path=1 ;; esac
done
if [ -n "$then_vllm" ] && [ "$given_m" = 0 ]; then
  # --release / --slow: the slow tests of the main environment, then those that need vLLM, in its environment
  rc=0
  "$venv/bin/python" -m pytest -m "$select" "$@" || rc=$?
  bash "$root/scripts/install.sh" --vllm
  vrc=0
  "${RLHF_VLLM_VENV:-$root/.venv-vllm}/bin/python" -m pytest -m "$then_vllm" "$@" || vrc=$?
  # 5: none selected in that environment (a path given that holds none of its tests); both 5: nothing ran
  if [ "$rc" = 5 ] && [ "$vrc" = 5 ]; then exit 5; fi
  [ "$rc" = 5 ] && rc=0
  [ "$vrc" = 5 ] && vrc=0
  exit $(( rc != 0 ? rc : vrc ))
fi
if [ "$given_m" = 0 ]; then set -- -m "$select" "$@"; fi
if { [ "$mode" = default ] || [ "$mode" = vllm ]; } && [ "$given_path" = 0 ] && "$venv/bin/python" -c "import xdist" 2>/dev/null; then
  # The whole default suite (or the vLLM job) in two processes (pytest-xdist), whole files per process
  # (tests/conftest.py keeps the files of the shared PPO launches in one process): a multi-rank launch spends much of
  # its time with a core idle (process start-up, one rank saving, a worker waiting for its trainer, a timeout waited
  # out), which the other process fills. The multi-rank files first (tests/conftest.py: long launches start early,
  # the many short unit files even out the end).
  exec "$venv/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests/distributed tests/e2e \
    tests/unit "$@"
fi
if [ "$mode" = learning ] && [ "$given_path" = 0 ]; then
  # The GRPO example (one process, the longest) before the three steps' launches: .ci/run starts this job at a
  # lower priority beside the default suite, which seldom leaves a core idle; one process there only goes slower,
  # while a launch's ranks waiting on each other under its timeout are better run after it.
  exec "$venv/bin/python" -m pytest tests/e2e tests/distributed tests/unit "$@"
fi
exec "$venv/bin/python" -m pytest "$@"
