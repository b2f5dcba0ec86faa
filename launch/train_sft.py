"""Step 1: supervised fine-tuning (loss on response tokens only); the model goes to <output_dir>/model.

    deepspeed --num_gpus N launch/train_sft.py --model_name_or_path base --data_path sft.jsonl --output_dir runs/sft
    torchrun --nproc_per_node N launch/train_sft.py ...
    python launch/train_sft.py ...          (one process; a one-rank environment is set up)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_engine.cli import exit_process, freeze_startup, run_main  # noqa: E402
from rlhf_engine.hooks import TestHooks  # noqa: E402
from rlhf_engine.config import SFTConfig  # noqa: E402
from rlhf_engine.trainer import run_sft  # noqa: E402


def main(argv=None):
    # the test switches come from the environment here only (never set in a real run: all off)
    return run_main(argv, __doc__, SFTConfig, run_sft, hooks=TestHooks.from_env())


if __name__ == "__main__":
    freeze_startup()
    exit_process(main())  # the process group torn down on every rank together: no gloo abort at exit
