"""PPO training entry point.

    deepspeed --num_gpus N launch/train_ppo.py --actor_model_name_or_path ... --data_path prompts.jsonl
    torchrun --nproc_per_node N launch/train_ppo.py ...
    python launch/train_ppo.py ...          (one process; a one-rank environment is set up)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_engine.cli import parse_args  # noqa: E402
from rlhf_engine.errors import ConfigError  # noqa: E402
from rlhf_engine.trainer import run_ppo  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv, description=__doc__)
        run_ppo(cfg, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
