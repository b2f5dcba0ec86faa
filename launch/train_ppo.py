"""PPO training entry point.

    deepspeed --num_gpus N launch/train_ppo.py --actor_model_name_or_path ... --data_path prompts.jsonl
    torchrun --nproc_per_node N launch/train_ppo.py ...
    python launch/train_ppo.py ...          (one process; a one-rank environment is set up)

Exit codes (rlhf_engine/errors.py, EXIT_CODES): 0 = done; 2 = a configuration / data error (nothing trained); 3 =
max_consecutive_skips updates in a row were skipped (non-finite gradients / fp16 overflow); 4 = a non-finite score,
advantage or loss (every rank stops); 1 = anything else. The deepspeed launcher exits with the failing rank's code;
torchrun reports 1.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_engine.cli import exit_process, freeze_startup, run_main  # noqa: E402
from rlhf_engine.hooks import TestHooks  # noqa: E402
from rlhf_engine.config import TrainConfig  # noqa: E402
from rlhf_engine.trainer import run_ppo  # noqa: E402


def main(argv=None):
    # the test switches come from the environment here only (never set in a real run: all off)
    return run_main(argv, __doc__, TrainConfig, run_ppo, hooks=TestHooks.from_env())


if __name__ == "__main__":
    freeze_startup()
    exit_process(main())  # the process group torn down on every rank together: no gloo abort at exit
