"""Multi-turn GRPO with a calculator tool learns on the 2-core CPU (slow: two SmolLM2 runs of about 15 minutes each;
not in the default suite).

`launch/train_ppo.py --config examples/grpo_calculator.yaml` (seed 1234, 14 iterations): the accuracy of the training
episodes (objective/score: 1 or 0) over the last 4 iterations must exceed the first 4 by MARGIN, and the share of
episodes that called the tool (env/turns_mean - 1 bounds it from below: an episode with a call plays 2 or more turns)
must rise too; the same run with actor learning rate 0 must not gain. Needs the demo packages
(scripts/install.sh --demo).
"""
import json
import os
import subprocess
import sys

import pytest

from _support import ROOT

MARGIN = 0.15  # see the README table for what was measured


def _gain(run_dir: str, key: str, k: int = 4) -> float:
    values = [json.loads(line)[key] for line in open(os.path.join(run_dir, "metrics.jsonl"))]
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
        gains[name] = (_gain(out, "objective/score"), _gain(out, "env/turns_mean"))
    print("gains (accuracy, turns)", gains)
    assert gains["learn"][0] > MARGIN and gains["learn"][1] > 0, gains
    assert gains["lr0"][0] < MARGIN, gains
