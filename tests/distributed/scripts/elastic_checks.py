"""Harness for the elastic-resume tests (tests/distributed/test_elastic_resume.py): builds a PPO trainer exactly as
launch/train_ppo.py does, then dumps every trained role's full fp32 weights and Adam moments (gathered over the
ranks, ZeRO 0-3) to <out>, on rank 0, and trains.

    deepspeed --num_gpus N tests/distributed/scripts/elastic_checks.py --out state.pt [--after] -- <train_ppo flags>

Without --after the dump is taken after build (with --resume: right after the checkpoint was loaded, before any new
step). With --after it is taken after training (the state the final checkpoint holds). Either way the trainer runs
to max_steps.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402


def full_state(trainer) -> dict:
    """role -> {"param": {name: fp32}, "exp_avg": {...}, "exp_avg_sq": {...}} of the trainable parameters."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for role in trainer.engine.trained_roles:
        ds = trainer.engine.engines[role]
        opt = getattr(ds.optimizer, "optimizer", ds.optimizer)
        # ZeRO 0 with bf16 / fp16: DeepSpeed's unfused optimizer keeps whole fp32 master weights beside each param
        groups = getattr(ds.optimizer, "fp16_groups", None), getattr(ds.optimizer, "fp32_groups", None)
        master = {id(lp): hp for lg, hg in zip(*groups) for lp, hp in zip(lg, hg)} if all(groups) else {}
        parts = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for name, p in ds.module.named_parameters():
            if not p.requires_grad:
                continue
            w = safe_get_full_fp32_param(p)
            if w is None:  # ZeRO 0: the (master) parameter and torch's optimizer state are whole on every rank
                p = master.get(id(p), p)
                state = opt.state.get(p, {})
                parts["param"][name] = p.detach().float().clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    parts[key][name] = state[key].detach().float().clone()
                continue
            parts["param"][name] = w.detach().float().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                parts[key][name] = safe_get_full_optimizer_state(p, key).detach().float().cpu().clone()
        out[role] = parts
    return out


def slow_down_conversion(seconds: float) -> None:
    import time

    import deepspeed.checkpoint.ds_to_universal as module

    real = module.main

    def slow(*a, **kw):
        print(f"[elastic_checks] conversion sleeps {seconds:g}s first", file=sys.stderr, flush=True)
        time.sleep(seconds)
        return real(*a, **kw)

    module.main = slow


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--after", action="store_true")
    ap.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    ap.add_argument("--slow_conversion", type=float, default=0.0,
                    help="seconds rank 0's universal-checkpoint conversion sleeps first (longer than the collective "
                         "timeout: the other ranks must not wait on the default group)")
    args, rest = ap.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.slow_conversion:
        slow_down_conversion(args.slow_conversion)
    from rlhf_engine.cli import parse_args
    from rlhf_engine.trainer import build_trainer

    trainer = build_trainer(parse_args(rest), rest)
    ptx = trainer.ptx.cursor if trainer.ptx is not None else None
    if not args.after:
        state, ptx_state = full_state(trainer), ptx and ptx.state_dict()
    trainer.train()
    if args.after:
        state, ptx_state = full_state(trainer), ptx and ptx.state_dict()
    if trainer.engine.dist.is_main:
        torch.save({"state": state, "iteration": trainer.iteration, "ptx": ptx_state,
                    "world_size": trainer.engine.dist.world_size}, args.out)
    from rlhf_engine.cli import exit_process

    exit_process(0)


if __name__ == "__main__":
    main()
