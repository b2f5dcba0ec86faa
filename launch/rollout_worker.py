"""A rollout worker: generates for a trainer started with --rollout_workers N --rollout_address HOST:PORT.

    python launch/rollout_worker.py --rollout_address HOST:PORT [--generation_backend NAME] [--device cpu]

It needs nothing else: the model's config, the sampling settings and the weights come from the trainer
(docs/async-rollouts.md). Exit codes: 0 = the trainer finished; 2 = more workers than the trainer asked for; 1 = an
error (named in the last line).
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_engine.cli import freeze_startup  # noqa: E402
from rlhf_engine.workers.rollout_worker import serve  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollout_address", required=True, help="HOST:PORT of the trainer's rank 0 (its --rollout_address)")
    p.add_argument("--generation_backend", default="", help="'' (default) = the trainer's (lean or vllm); a name "
                   "here must be the trainer's, or the worker refuses at setup (the trainer plans the rollout "
                   "correction for its own backend)")
    p.add_argument("--rollout_timeout_s", type=float, default=300.0, help="seconds to wait for the trainer to "
                   "answer (joining, a weight broadcast)")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(args.rollout_address, args.generation_backend, args.rollout_timeout_s, device=args.device)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    freeze_startup()
    sys.exit(main())
