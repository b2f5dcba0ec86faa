"""Step 2: pairwise reward model (chosen / rejected); the model goes to <output_dir>/model (*ForSequenceClassification).

    deepspeed --num_gpus N launch/train_reward.py --model_name_or_path runs/sft/model --data_path preferences.jsonl \\
        --output_dir runs/reward
    torchrun --nproc_per_node N launch/train_reward.py ...
    python launch/train_reward.py ...       (one process; a one-rank environment is set up)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_engine.cli import exit_process, freeze_startup, run_main  # noqa: E402
from rlhf_engine.hooks import TestHooks  # noqa: E402
from rlhf_engine.config import RewardTrainConfig  # noqa: E402
from rlhf_engine.trainer import run_reward_model  # noqa: E402


def main(argv=None):
    # the test switches come from the environment here only (never set in a real run: all off)
    return run_main(argv, __doc__, RewardTrainConfig, run_reward_model, hooks=TestHooks.from_env())


if __name__ == "__main__":
    freeze_startup()
    exit_process(main())  # the process group torn down on every rank together: no gloo abort at exit
