#!/usr/bin/env bash
# Download the wheels bench/gpu.sh installs on an offline GPU machine (Python 3.12, Linux x86_64, no deepspeed):
# deepspeed (built here into a pure-Python wheel from its sdist) and the pure-Python / small binary packages it and
# rlhf_engine need besides torch and transformers. Versions are those of this checkout's venv (the tested ones).
#
#   bash bench/fetch_wheels.sh [DEST]        (default: bench/wheels, ignored by git; override with $WHEELS)
#   PYVER=3.11 bash bench/fetch_wheels.sh    (another target Python)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-${WHEELS:-$root/bench/wheels}}
pyver=${PYVER:-3.12}
venv=${RLHF_VENV:-$root/.venv}
py=$venv/bin/python
mkdir -p "$dest"

# the venv's versions of everything gpu_env.py may install (deepspeed separately: it is an sdist)
mapfile -t pins < <("$py" - <<'EOF'
from importlib import metadata
for d in ["typing_extensions", "packaging", "annotated_types", "typing_inspection", "pydantic_core", "pydantic",
          "hjson", "ninja", "py-cpuinfo", "msgpack", "einops", "psutil", "numpy", "accelerate"]:
    print(f"{d}=={metadata.version(d)}")
EOF
)
ds_version=$("$py" -c 'from importlib import metadata; print(metadata.version("deepspeed"))')
abi="cp${pyver/./}"
echo "fetch_wheels: Python $pyver ($abi), deepspeed $ds_version, ${pins[*]}"

# binary packages for the target interpreter; pure-Python ones ("none-any") match any of these tags
"$py" -m pip download --no-deps --only-binary=:all: --dest "$dest" --python-version "$pyver" --implementation cp \
    --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    "${pins[@]}"

# deepspeed has no wheel on PyPI: build one from the sdist. No op is compiled (DS_BUILD_OPS=0): a pure-Python wheel
# whose ops are JIT-built on first use (gpu.sh avoids them unless the CUDA toolkit is there).
if ! ls "$dest"/deepspeed-"$ds_version"-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 "$py" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$dest" "deepspeed==$ds_version"
fi
ls -la "$dest"
du -sh "$dest"
