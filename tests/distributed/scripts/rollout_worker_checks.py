"""Harness for tests/distributed/test_rollout_workers.py: the weight broadcast to a rollout worker, bitwise. Rank 0
writes what it saw (nothing asserted here). The test runs it inside its ppo_checks.py launch (a spec entry of kind
"broadcast_checks" calls `broadcast_checks`); alone:

    deepspeed --num_gpus 2 rollout_worker_checks.py --actor DIR --prompts FILE --workdir DIR --addresses A2,A3 --out F

Per ZeRO stage (2, then 3; one worker each, at its address): the actor as a DeepSpeed engine, a `RemoteBackend` on
it; after a broadcast the worker's weights' sha256 against the trainer's stream's; after an optimizer step without a
broadcast (the negative control), and after the broadcast that follows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402

from rlhf_engine import comm  # noqa: E402
from rlhf_engine.cli import parse_args  # noqa: E402
from rlhf_engine.engine import init_distributed  # noqa: E402
from rlhf_engine.engine.generation import GenerationContext  # noqa: E402
from rlhf_engine.engine.generation.remote import RemoteBackend  # noqa: E402
from rlhf_engine.engine.policy_weights import stream_weights, weights_sha256  # noqa: E402
from rlhf_engine.engine.role_engine import build_role_engine  # noqa: E402


def step(engine, seed: int) -> None:
    x = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()


def broadcast_checks(actor_path: str, prompts: str, workdir: str, addresses: list) -> dict:
    """The checks of the module docstring, one worker per address; rank 0's findings (the other ranks: {})."""
    dist = init_distributed()
    out = {}
    for stage, address in zip((2, 3), addresses):
        cfg = parse_args(["--actor_model_name_or_path", actor_path, "--reward_model_name_or_path", actor_path,
                          "--data_path", prompts, "--output_dir", os.path.join(workdir, "unused"),
                          "--rollout_workers", "1", "--rollout_address", address, "--rollout_timeout_s", "120"])
        cfg.actor.learning_rate = 1e-2
        actor, _ = build_role_engine(cfg.actor, actor_path, kind="causal_lm", stage=stage, dtype="fp32", train=True,
                                     batch=cfg.batch, world_size=dist.world_size, eval_micro_batch_size=2,
                                     num_training_steps=4, pad_token_id=0)
        step(actor, 1)  # away from the folder's weights
        backend = RemoteBackend(GenerationContext(actor, dist, stage, cfg, dtype="fp32"), "lean")

        def compare():
            mine = weights_sha256(stream_weights(actor.module))  # collective under ZeRO-3
            theirs = backend.worker_checksums() if dist.is_main else None
            return {"equal": theirs == [mine] if dist.is_main else None, "version": backend.actor_version}

        backend.sync_weights()
        res = {"after_broadcast": compare()}
        step(actor, 2)
        res["stepped_without_broadcast"] = compare()  # negative control
        backend.sync_weights()
        res["after_next_broadcast"] = compare()
        res["broadcast_again_is_a_no_op"] = not backend.sync_weights()
        backend.close()  # this check's worker is done
        out[f"z{stage}"] = res
    return out if dist.is_main else {}


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("actor", "prompts", "workdir", "addresses", "out"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--local_rank", type=int, default=None)
    args = p.parse_args()
    out = broadcast_checks(args.actor, args.prompts, args.workdir, args.addresses.split(","))
    if comm.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    comm.shutdown(ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
