"""Prepare the Python environment of the benchmark machine from carried wheels, without touching torch.

    python bench/gpu_env.py --wheels bench/wheels --target bench/.pydeps --report env.json

For each package DeepSpeed and rlhf_engine need beyond torch and transformers (deepspeed and its pure-Python
dependencies, accelerate for ZeRO-3 model construction), the installed version is compared with the carried wheel:
a package that is missing, or older than its wheel, is installed from the wheel into `--target` (which the caller
puts first on PYTHONPATH); nothing else is installed, nothing is downloaded (`pip --no-index --no-deps`), and torch,
transformers and numpy already present are never replaced. Without pip, wheels are unpacked directly (a wheel is a
zip of its files). Then `import deepspeed, accelerate, transformers` is checked in a fresh interpreter with the new
PYTHONPATH. Prints one JSON report (also written to `--report`); exit code 1 when the imports fail.
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

# distribution name -> import name; the order is the install order (dependencies first)
PACKAGES = [
    ("typing_extensions", "typing_extensions"), ("packaging", "packaging"), ("annotated_types", "annotated_types"),
    ("typing_inspection", "typing_inspection"), ("pydantic_core", "pydantic_core"), ("pydantic", "pydantic"),
    ("hjson", "hjson"), ("ninja", "ninja"), ("py_cpuinfo", "cpuinfo"), ("msgpack", "msgpack"), ("einops", "einops"),
    ("psutil", "psutil"), ("numpy", "numpy"), ("accelerate", "accelerate"), ("deepspeed", "deepspeed"),
]
NEVER_REPLACE = {"numpy", "torch", "transformers"}  # present = good enough (torch is built against its numpy)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def version_tuple(v: str) -> tuple:
    parts = []
    for p in re.split(r"[.+-]", v):
        parts.append(int(p) if p.isdigit() else -1)
        if not p.isdigit():
            break
    return tuple(parts)


def installed_version(dist: str, target: str) -> str | None:
    """Version visible to the benchmark: in `target` first (PYTHONPATH order), then the interpreter's."""
    for path in glob.glob(os.path.join(target, "*.dist-info")):
        name, _, ver = os.path.basename(path)[: -len(".dist-info")].partition("-")
        if norm(name) == norm(dist):
            return ver
    try:
        return metadata.version(dist.replace("_", "-"))
    except metadata.PackageNotFoundError:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None


def find_wheel(wheels: str, dist: str) -> str | None:
    hits = [w for w in glob.glob(os.path.join(wheels, "*.whl"))
            if norm(os.path.basename(w).split("-")[0]) == norm(dist)]
    return sorted(hits)[-1] if hits else None


def wheel_version(path: str) -> str:
    return os.path.basename(path).split("-")[1]


def install(wheel: str, target: str) -> str:
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if pip.returncode == 0 and not os.environ.get("BENCH_NO_PIP"):  # BENCH_NO_PIP=1 tests the fallback
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                            "--disable-pip-version-check", "--upgrade", "--target", target, wheel],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return "pip"
        raise RuntimeError(f"pip install {os.path.basename(wheel)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    with zipfile.ZipFile(wheel) as z:  # no pip: a wheel is its files plus a .dist-info folder
        z.extractall(target)
    for script_dir in glob.glob(os.path.join(target, "*.data")):
        shutil.rmtree(script_dir, ignore_errors=True)
    return "unzip"


def ensure_ninja_binary(target: str, wheels: str) -> str | None:
    """torch's JIT builds call `ninja` from PATH; the ninja wheel ships it as a script. Put it in <target>/bin
    (gpu.sh adds that to PATH) unless one is already on PATH."""
    found = shutil.which("ninja")
    if found:
        return found
    dest = os.path.join(target, "bin", "ninja")
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
              "packages": {}}
    for base in ("torch", "transformers", "tokenizers", "safetensors"):
        report["packages"][base] = {"installed": installed_version(base, args.target), "action": "kept (machine's)"}
    ok = True
    for dist, _module in PACKAGES:
        have = installed_version(dist, args.target)
        wheel = find_wheel(args.wheels, dist)
        entry = {"installed": have, "wheel": os.path.basename(wheel) if wheel else None}
        if have is not None and (dist in NEVER_REPLACE or wheel is None
                                 or version_tuple(have) >= version_tuple(wheel_version(wheel))):
            entry["action"] = "kept"
        elif wheel is None:
            entry["action"] = "MISSING: no carried wheel"
            ok = False
        else:
            try:
                entry["action"] = f"installed {wheel_version(wheel)} ({install(wheel, args.target)})"
            except Exception as e:  # noqa: BLE001
                entry["action"] = f"FAILED: {e}"
                ok = False
        report["packages"][dist] = entry
    report["ninja"] = ensure_ninja_binary(args.target, args.wheels)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [args.target, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    probe = ("import json, torch, transformers, accelerate, deepspeed, pydantic\n"
             "print(json.dumps({m.__name__: m.__version__ for m in (torch, transformers, accelerate, deepspeed,"
             " pydantic)}))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    if r.returncode == 0:
        report["import_check"] = json.loads(r.stdout.strip().splitlines()[-1])
    else:
        report["import_check"] = {"error": (r.stdout + r.stderr)[-3000:]}
        ok = False
    report["nvcc"] = shutil.which("nvcc") or (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
                                              if os.path.isfile(os.path.join(os.environ.get("CUDA_HOME",
                                                                                            "/usr/local/cuda"),
                                                                             "bin", "nvcc")) else None)
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
