"""A non-editable install works away from the checkout: the wheel carries the DeepSpeed templates (ds_configs/) and
the embedded prompts, and the installed package builds a DeepSpeed config from its own copy."""
import os
import shutil
import subprocess
import sys
import zipfile

from _support import ROOT, clean_env


def test_the_wheel_carries_the_templates_and_an_installed_copy_uses_them(tmp_path):
    wheels, target, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
    # a copy of what the build reads: pip builds a local folder in place, and a build/ left by an earlier build would
    # hide a missing copy step
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(ROOT, "rlhf_engine"), src / "rlhf_engine", ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "ds_configs"), src / "ds_configs")
    shutil.copy(os.path.join(ROOT, "setup.py"), src / "setup.py")
    # no build isolation: setuptools from this venv, nothing fetched
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels)], check=True, cwd=str(tmp_path), capture_output=True, timeout=300)
    (wheel,) = wheels.glob("rlhf_engine-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"rlhf_engine/ds_configs/train.json", "rlhf_engine/ds_configs/eval.json",
            "rlhf_engine/data/builtin/review_openings.jsonl"} <= names
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = ("import rlhf_engine.engine.ds_config as d, rlhf_engine\n"
             "from rlhf_engine.config import BatchConfig, RoleConfig\n"
             "cfg = d.build_ds_config(RoleConfig(), stage=2, dtype='fp32', train=True, batch=BatchConfig(), "
             "world_size=1, eval_micro_batch_size=1)\n"
             "print(rlhf_engine.__file__); print(d.TEMPLATE_DIR); print(cfg['zero_optimization']['stage'])\n")
    # run from an empty folder, the installed copy first on the path (this venv's editable checkout comes later)
    env = clean_env(PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", probe], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    package, templates, stage = out.stdout.split()[-3:]
    assert package.startswith(str(target)) and templates == os.path.join(str(target), "rlhf_engine", "ds_configs")
    assert stage == "2"
