"""Prepare the benchmark machine's Python from the carried wheels (bench/fetch_wheels.sh), never touching torch.

    python bench/gpu_env.py --wheels bench/wheels --target bench/.pydeps --report env.json

Each of PACKAGES that is missing or older than its wheel is installed into `--target` (the caller puts it first on
PYTHONPATH) by `pip --no-index --no-deps`, or unpacked (a wheel is a zip) without pip; torch, transformers and numpy
already present are kept. Then the imports are checked in a fresh interpreter. Prints one JSON report (also written to
`--report`); exit code 1 when the imports fail.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata

# distribution names, in install order (dependencies first)
PACKAGES = ["typing_extensions", "packaging", "annotated_types", "typing_inspection", "pydantic_core", "pydantic",
            "hjson", "ninja", "py_cpuinfo", "msgpack", "einops", "psutil", "numpy", "accelerate", "deepspeed"]
NEVER_REPLACE = {"numpy", "torch", "transformers"}  # present = good enough (torch is built against its numpy)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def version_tuple(v: str) -> tuple:
    """Numeric release parts, up to the first non-numeric one (-1 for it): 1.2.3rc1 -> (1, 2, -1)."""
    out = []
    for p in re.split(r"[.+-]", v):
        out.append(int(p) if p.isdigit() else -1)
        if not p.isdigit():
            break
    return tuple(out)


def installed_version(dist: str, target: str) -> str | None:
    """The version the benchmark will import: `target` first (PYTHONPATH order), then the interpreter's."""
    local = next(iter(metadata.distributions(name=dist, path=[target])), None)
    if local is not None:
        return local.version
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def find_wheel(wheels: str, dist: str) -> str | None:
    hits = sorted(w for w in glob.glob(os.path.join(wheels, "*.whl"))
                  if norm(os.path.basename(w).split("-")[0]) == norm(dist))
    return hits[-1] if hits else None


def install(wheel: str, target: str) -> str:
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if pip.returncode == 0 and not os.environ.get("BENCH_NO_PIP"):  # BENCH_NO_PIP=1 tests the fallback
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                            "--disable-pip-version-check", "--upgrade", "--target", target, wheel],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"pip install {os.path.basename(wheel)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        return "pip"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    for script_dir in glob.glob(os.path.join(target, "*.data")):
        shutil.rmtree(script_dir, ignore_errors=True)
    return "unzip"


def ensure_ninja_binary(target: str, wheels: str) -> str | None:
    """torch's JIT builds call `ninja` from PATH and the ninja wheel ships it as a script: put it in <target>/bin
    (gpu.sh adds that to PATH) unless one is on PATH already."""
    dest = os.path.join(target, "bin", "ninja")
    if shutil.which("ninja"):
        return shutil.which("ninja")
    if not os.path.isfile(dest):
        wheel = find_wheel(wheels, "ninja")
        if wheel is None:
            return None
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith(".data/scripts/ninja")), None)
            if member is None:
                return None
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(member) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
    os.chmod(dest, 0o755)
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--report")
    args = p.parse_args(argv)
    os.makedirs(args.target, exist_ok=True)
    report = {"python": sys.version.split()[0], "executable": sys.executable, "wheels_dir": args.wheels,
              "wheels_found": sorted(os.path.basename(w) for w in glob.glob(os.path.join(args.wheels, "*.whl"))),
              "packages": {b: {"installed": installed_version(b, args.target), "action": "kept (machine's)"}
                           for b in ("torch", "transformers", "tokenizers", "safetensors")}}
    ok = True
    for dist in PACKAGES:
        have, wheel = installed_version(dist, args.target), find_wheel(args.wheels, dist)
        entry = report["packages"][dist] = {"installed": have, "wheel": os.path.basename(wheel) if wheel else None}
        wheel_version = os.path.basename(wheel).split("-")[1] if wheel else None
        if have is not None and (dist in NEVER_REPLACE or wheel is None
                                 or version_tuple(have) >= version_tuple(wheel_version)):
            entry["action"] = "kept"
        elif wheel is None:
            entry["action"], ok = "MISSING: no carried wheel", False
        else:
            try:
                entry["action"] = f"installed {wheel_version} ({install(wheel, args.target)})"
            except Exception as e:  # noqa: BLE001
                entry["action"], ok = f"FAILED: {e}", False
    report["ninja"] = ensure_ninja_binary(args.target, args.wheels)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.target, os.environ.get("PYTHONPATH")])))
    probe = ("import json, torch, transformers, accelerate, deepspeed, pydantic\nprint(json.dumps({m.__name__: "
             "m.__version__ for m in (torch, transformers, accelerate, deepspeed, pydantic)}))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    ok = ok and r.returncode == 0
    report["import_check"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {
        "error": (r.stdout + r.stderr)[-3000:]}
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    report["nvcc"] = shutil.which("nvcc") or (nvcc if os.path.isfile(nvcc) else None)
    report["ok"] = ok
    text = json.dumps(report, indent=1)
    if args.report:
        os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        with open(args.report, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
