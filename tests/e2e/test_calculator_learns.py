"""Multi-turn GRPO with a calculator tool learns on the 2-core CPU (slow: two SmolLM2 runs of about 15 minutes each;
not in the default suite).

`launch/train_ppo.py --config examples/grpo_calculator.yaml` (seed 1234, 14 iterations): the accuracy of the training
episodes (objective/score: 1 or 0) over the last 4 iterations must exceed the first 4 by MARGIN while the episodes
use the tool (more than 1.5 model turns per episode over the last 4: a turn after the first follows a tool call);
the same run with actor learning rate 0 must not gain. Needs the demo packages (scripts/install.sh --demo).
"""
import json
import os
import subprocess
import sys

import pytest

from _support import ROOT

MARGIN = 0.15  # measured (seed 1234, docs/environments.md): +0.45 learning, -0.03 at actor learning rate 0


def _values(run_dir: str, key: str) -> list:
    return [json.loads(line)[key] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _gain(values: list, k: int = 4) -> float:
    return sum(values[-k:]) / k - sum(values[:k]) / k


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_calculator_episodes_learn_and_not_at_lr0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(os.cpu_count() or 1))
    gains = {}
    for name, extra in (("learn", []), ("lr0", ["--actor_learning_rate", "0"])):
        out = str(tmp_path / name)
        proc = subprocess.run([sys.executable, "launch/train_ppo.py", "--config", "examples/grpo_calculator.yaml",
                               "--output_dir", out, *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1700)
        assert proc.returncode == 0, proc.stderr[-4000:]
        turns = _values(out, "env/turns_mean")
        gains[name] = (_gain(_values(out, "objective/score")), sum(turns[-4:]) / 4)
    print("(accuracy gain, turns per episode at the end)", gains)
    assert gains["learn"][0] > MARGIN and gains["learn"][1] > 1.5, gains
    assert gains["lr0"][0] < MARGIN, gains
