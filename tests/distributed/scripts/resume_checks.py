"""Harness for tests/distributed/test_resume.py: runs PPO trainers (built exactly as launch/train_ppo.py builds them)
and writes what they did to a JSON file.

    deepspeed --num_gpus 2 tests/distributed/scripts/resume_checks.py --spec spec.json --out result.json
    (or one process per rank with a SLURM environment: srun-style, rendezvous from SLURM's variables)

spec.json: {"runs": [{"name": str, "args": [train_ppo.py flags...], "hooks": {...}, "checks": [...]}, ...]}

Hooks: "stop_after": N -> the run stops (an exception, as a preemption would) right after the checkpoint logic of
iteration N ran, so its last checkpoint is iter_N; "skip_on_resume": ["rng"] -> those state providers are not
restored on resume (the negative control).

Checks, after training: "reference" -> sha256 of the reference engine's weights and of the initial actor loaded
with plain from_pretrained (and of the trained actor); "export" -> the exported final actor / critic reloaded with
plain from_pretrained (+ tokenizer) on rank 0 reproduce the engine's log-probs and values on this rank's last
rollout (and the EMA's log-probs, when the run keeps one).

The EMA (--enable_ema) is updated after every actor optimizer step (engine.update_ema(), hooked here on
engine.step: a no-op when the trainer already called it for that step).

Recorded on rank 0 per run: records (trainer.train()), start_iteration, resumed_from, dist (rank / world size /
local rank / MASTER_ADDR / MASTER_PORT of every rank), files <output_dir>/final_<role>.pt (full parameters), and the
checks' results.
"""
from __future__ import annotations

import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
from spec_runner import run_specs, settled  # noqa: E402


class Preempted(Exception):
    pass


def state_hash(sd: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def gather(obj):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def export_check(engine, out_dir: str, rollout) -> dict | None:
    """Collective: engine log-probs / values on `rollout` (every rank), compared on rank 0 with the HF reloads."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_engine.engine.models import ScalarHeadModel
    from rlhf_engine.ppo_math import logprobs_from_logits
    from rlhf_engine.rollout import Rollout  # noqa: F401  (the layout the engine and the check share)

    lp = engine.actor_logprobs(rollout)
    values = engine.critic_values(rollout)
    ema_lp = None
    if "ema" in engine.engines:  # the EMA engine's log-probs, through the engine's own forward
        ema_lp = torch.cat(engine._eval_chunks("ema", rollout, lambda e, mb: engine._lm_forward(e, mb, False)[0]))
    if not engine.dist.is_main:
        return None
    inputs = dict(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                  position_ids=rollout.position_ids)
    actor = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "actor"), dtype=torch.float32).eval()
    critic = ScalarHeadModel(AutoModelForSequenceClassification.from_pretrained(
        os.path.join(out_dir, "critic"), dtype=torch.float32)).eval()
    with torch.no_grad():
        logits = rollout.action_slice(actor(**inputs, use_cache=False).logits)
        lp_hf = logprobs_from_logits(logits, rollout.responses, temperature=engine.temperature) * rollout.action_mask
        v_hf = rollout.action_slice(critic(**inputs)) * rollout.action_mask
    tok = AutoTokenizer.from_pretrained(os.path.join(out_dir, "actor"))
    text = "the quick review of a film"
    out = {}
    if ema_lp is not None:
        ema = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "ema"), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = rollout.action_slice(ema(**inputs, use_cache=False).logits)
            ema_hf = logprobs_from_logits(logits, rollout.responses, temperature=engine.temperature) * rollout.action_mask
        out["ema_max_diff"] = float((ema_lp - ema_hf).abs().max())
        out["ema_vs_actor"] = float((ema_lp - lp).abs().max())
    return {**out, "actor_max_diff": float((lp - lp_hf).abs().max()),
            "critic_max_diff": float((values - v_hf).abs().max()), "tokens": int(rollout.action_mask.sum()),
            "tokenizer_same": tok(text)["input_ids"] == engine.tokenizer(text)["input_ids"],
            "files": sorted(os.listdir(out_dir))}


@settled  # spec_runner.py: settle() once the run has returned (nothing of it held any more)
def run_one(spec: dict) -> dict | None:
    from rlhf_engine.cli import parse_args
    from rlhf_engine.hooks import TestHooks
    from rlhf_engine.trainer import build_trainer

    hooks, checks = spec.get("hooks", {}), spec.get("checks", [])
    cfg = parse_args(spec["args"])
    # as launch/train_ppo.py: the fault points come from the environment (fault_checks.py sets them per run)
    trainer = build_trainer(cfg, hooks=TestHooks.from_env(skip_on_resume=hooks.get("skip_on_resume", ())))
    engine = trainer.engine
    start = trainer.iteration
    if "ema" in engine.engines:  # the EMA follows every actor optimizer step (update_ema is a no-op without a new
        orig_step = engine.step  # step, so this is harmless where the trainer calls it too)

        def step(role):
            orig_step(role)
            if role == "actor":
                engine.update_ema()

        engine.step = step
    if "stop_after" in hooks:
        n, orig = int(hooks["stop_after"]), trainer.checkpointer.after_iteration

        def after_iteration(it, last=False):
            out = orig(it, last=last)
            if it == n:
                raise Preempted(f"stopped after iteration {n}")
            return out

        trainer.checkpointer.after_iteration = after_iteration
    stopped = False
    try:
        records = trainer.train()
    except Preempted:
        stopped, records = True, None
    mine = {"rank": engine.dist.rank, "world_size": engine.dist.world_size, "local_rank": engine.dist.local_rank,
            "MASTER_ADDR": os.environ.get("MASTER_ADDR"), "MASTER_PORT": os.environ.get("MASTER_PORT")}
    per_rank = gather(mine)
    result = {"name": spec["name"], "output_dir": cfg.run.output_dir, "start_iteration": start, "stopped": stopped,
              "resumed_from": trainer.checkpointer.resumed_from, "records": records, "dist": per_rank}
    final = {role: engine.full_state_dict(role) for role in ("actor", "critic", "ema") if role in engine.engines}
    if "reference" in checks:
        ref = engine.full_state_dict("reference")
        if engine.dist.is_main:
            from transformers import AutoModelForCausalLM

            init = AutoModelForCausalLM.from_pretrained(cfg.actor.model_name_or_path, dtype=torch.float32)
            result["hash"] = {"reference": state_hash(ref), "initial_actor": state_hash(init.state_dict()),
                              "actor": state_hash(final["actor"])}
    if "export" in checks:
        out_dir = cfg.export_dir or os.path.join(cfg.run.output_dir, "final")
        result["export"] = export_check(engine, out_dir, trainer.last_experience.rollout)
    if engine.dist.is_main:
        for role, sd in final.items():
            torch.save(sd, os.path.join(cfg.run.output_dir, f"final_{role}.pt"))
    return result if torch.distributed.get_rank() == 0 else None


def main() -> int:
    return run_specs(run_one, "resume_checks")


if __name__ == "__main__":
    sys.exit(main())
