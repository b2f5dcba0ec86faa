"""GRPO with a verifiable reward learns on the 2-core CPU (slow: two SmolLM2 runs of about 10 minutes each; not in
the default suite).

`launch/train_ppo.py --config examples/grpo_arithmetic.yaml` (seed 1234, 12 iterations): the accuracy of the
training rollouts (objective/score: exact_answer is 1 or 0) over the last 4 iterations must exceed the first 4 by
GRPO_MARGIN; the same run with actor learning rate 0 must not. Needs the demo packages (scripts/install.sh --demo).
"""
import json
import os
import subprocess
import sys

import pytest

from _support import ROOT

GRPO_MARGIN = 0.12  # measured (seed 1234, README table): +0.42 learning, -0.04 at actor learning rate 0


def _gain(run_dir: str, k: int = 4) -> float:
    scores = [json.loads(line)["objective/score"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return sum(scores[-k:]) / k - sum(scores[:k]) / k


@pytest.mark.slow
@pytest.mark.timeout(3000)  # two runs of about 13 minutes each on the 2-core CPU
def test_grpo_arithmetic_learns_and_not_at_lr0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(os.cpu_count() or 1))
    gains = {}
    for name, extra in (("learn", []), ("lr0", ["--actor_learning_rate", "0"])):
        out = str(tmp_path / name)
        proc = subprocess.run([sys.executable, "launch/train_ppo.py", "--config", "examples/grpo_arithmetic.yaml",
                               "--output_dir", out, *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1500)
        assert proc.returncode == 0, proc.stderr[-4000:]
        gains[name] = _gain(out)
    print("gains", gains)
    assert gains["learn"] > GRPO_MARGIN, gains
    assert gains["lr0"] < GRPO_MARGIN, gains
