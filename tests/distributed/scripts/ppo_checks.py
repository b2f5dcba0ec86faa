"""Harness for tests/distributed/test_ppo_trainer.py: runs several PPO trainers in one launch and writes what they did.

    deepspeed --num_gpus 2 tests/distributed/scripts/ppo_checks.py --spec spec.json --out result.json
    python tests/distributed/scripts/ppo_checks.py --spec spec.json --out result.json        (one rank)

spec.json: {"runs": [{"name": str, "args": [train_ppo.py flags...], "hooks": {...}}, ...]} (spec_runner.py: each
run's result is recorded as the run ends, a failed or hung run is named; the test-only "fault" runs). Each run builds
its trainer with `rlhf_engine.trainer.build_trainer(parse_args(args))` (the path of launch/train_ppo.py), applies the
test hooks, trains `max_steps` iterations and records, on rank 0:

  records         the metrics records trainer.train() returned (also in <output_dir>/metrics.jsonl)
  ratio_trace     max |log-ratio| of every mini-batch, in order (epoch-major), over all ranks
  optimizer_steps {role: engine step counter before and after}
  max_param_change {role: max |after - before| over every parameter}, and
  state dict files <output_dir>/final_<role>.pt of the final parameters (for cross-run comparisons)
  ranks           per rank (gathered): "rollouts" (per iteration: prompt_length of each generation batch, their
                  response lengths, and the sequences/attention masks of the first generation batch, so tests can
                  compare rollouts), "minibatch_tokens" (per iteration: real tokens of each of this rank's
                  mini-batches) and "experience" (the last iteration's response lengths, prompt length, scores, and
                  the model turns of each row)

Hooks (all default off): "use_position_ids": false  -> TestHooks(use_position_ids=False) (trlx's left-padding bug);
"loss_token_mean": "local" -> TestHooks(loss_token_mean="local"): the per-rank token mean (negative control of the global token mean);
"left_pad_training": k -> every actor TRAINING forward gets k extra left-padding columns (harness-only: wraps
engine.actor_forward), so it sees another left padding than the experience forward of the same rows;
"reward_fn": "fraction:<lo>:<hi>" -> score = fraction of response tokens with lo <= id < hi (a programmatic reward);
"group_spread": true -> member k of each prompt's group keeps all but the last k tokens of its greedy response
(`spread_groups`: samples that differ within a group, the same on any number of ranks).
"""
from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
from rlhf_engine.trainer.reward_sources import RewardFnSource  # noqa: E402
from spec_runner import run_specs, settled  # noqa: E402


def fraction_reward(lo: int, hi: int):
    """reward_fn: the share of real response tokens whose id lies in [lo, hi) (0 for an empty response)."""

    def fn(prompt_ids: torch.Tensor, rollout) -> torch.Tensor:
        r = rollout.responses
        hit = ((r >= lo) & (r < hi)).float() * rollout.action_mask
        return hit.sum(-1) / rollout.action_mask.sum(-1).clamp(min=1)

    return fn


def left_padded(rollout, k: int, pad_token_id: int):
    """The same rows with `k` more padding columns on the left (real tokens, masks and mask-derived position ids of
    the real tokens unchanged; prompt_length grows by k, so the [B, R] per-action outputs stay aligned)."""
    from rlhf_engine.rollout import position_ids_from_mask

    F = torch.nn.functional
    mask = F.pad(rollout.attention_mask, (k, 0), value=0)
    return dataclasses.replace(rollout, sequences=F.pad(rollout.sequences, (k, 0), value=pad_token_id),
                               attention_mask=mask, position_ids=position_ids_from_mask(mask),
                               prompt_length=rollout.prompt_length + k)


def spread_groups(gen, n: int, pad_token_id: int):
    """Greedy decoding gives the n samples of a prompt the same response (no advantage to learn from); a
    deterministic stand-in for sampling that every world size reproduces: member k keeps all but its last k tokens
    (at least one). The generation log-probs are cut alike."""
    from rlhf_engine.engine.generation import Generated
    from rlhf_engine.rollout import Rollout

    r = gen.rollout
    P = r.prompt_length
    keep = [max(1, int(length) - (i % n)) for i, length in enumerate(r.response_lengths)]
    responses = [row[:k].tolist() for row, k in zip(r.responses, keep)]
    cut = Rollout.from_responses(r.prompts, r.attention_mask[:, :P], responses, pad_token_id,
                                 ended_with_eos=[bool(e) and k == int(length) for e, k, length in
                                                 zip(r.ended_with_eos, keep, r.response_lengths)])
    logprobs = None if gen.logprobs is None else gen.logprobs[:, :cut.response_width] * cut.action_mask
    return Generated(cut, logprobs)


def model_turns(action_mask: torch.Tensor) -> list[int]:
    """Per row, the runs of model-written tokens (a single-turn response has 1; an episode one per turn)."""
    m = action_mask.long()
    starts = m[:, :1] + (m[:, 1:] > m[:, :-1]).long().sum(-1, keepdim=True)
    return starts.flatten().tolist()


def episodes(r) -> list:
    """Per row: (its prompt's real ids, its response's real ids, their action flags)."""
    out = []
    for i in range(r.batch_size):
        prompt = r.prompts[i][r.attention_mask[i, :r.prompt_length].bool()].tolist()
        real = r.response_attention[i].bool()
        out.append([prompt, r.responses[i][real].tolist(), r.action_mask[i][real].tolist()])
    return out


def gather(obj):
    """Every rank's `obj`, in rank order (on every rank)."""
    world = torch.distributed.get_world_size()
    out = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


@settled  # spec_runner.py: settle() once the run has returned (nothing of it held any more)
def run_one(spec: dict) -> dict | None:
    from rlhf_engine.cli import parse_args
    from rlhf_engine.hooks import TestHooks
    from rlhf_engine.trainer import build_trainer

    cfg = parse_args(spec["args"])
    hooks = spec.get("hooks", {})
    trainer = build_trainer(cfg, hooks=TestHooks(use_position_ids=bool(hooks.get("use_position_ids", True)),
                                                 loss_token_mean=hooks.get("loss_token_mean", "global")))
    engine = trainer.engine
    is_main = engine.dist.is_main
    if "left_pad_training" in hooks:  # the actor's TRAINING forward sees k more left padding than its experience
        k, orig_actor_forward = int(hooks["left_pad_training"]), engine.actor_forward
        engine.actor_forward = lambda r, **kw: orig_actor_forward(left_padded(r, k, engine.pad_token_id), **kw)
    if "group_spread" in hooks:  # greedy samples differ within a group: member k of a prompt is cut by k tokens
        n, orig_sample = cfg.batch.n_samples_per_prompt, engine.sample
        engine.sample = lambda ids, mask, params=None: spread_groups(orig_sample(ids, mask, params), n,
                                                                     engine.pad_token_id)
    if "reward_fn" in hooks:
        kind, lo, hi = hooks["reward_fn"].split(":")
        assert kind == "fraction", kind
        trainer.reward_source = RewardFnSource(fraction_reward(int(lo), int(hi)))

    roles = engine.trained_roles  # ("actor",) in a critic-free run
    before = {role: engine.full_state_dict(role) for role in roles}
    steps_before = {role: engine.optimizer_steps(role) for role in roles}

    rollouts = []  # per iteration: this rank's generation batches
    orig_rollout_phase = trainer.rollout_phase

    def rollout_phase():
        gens = orig_rollout_phase()
        rs = [g.rollout for g in gens]
        rollouts.append({
            "prompt_lengths": [r.prompt_length for r in rs],
            "response_lengths": [r.response_lengths.tolist() for r in rs],
            "sequences": rs[0].sequences.tolist(),
            "attention_mask": rs[0].attention_mask.tolist(),
        })
        return gens

    trainer.rollout_phase = rollout_phase
    generate_calls = []  # an episode runner's generate calls on this rank: (rows, prompt width, row limits)
    if getattr(trainer.episodes, "sample", None) is not None:  # an episode runner of the trainer's own
        orig_episode_sample = trainer.episodes.sample

        def episode_sample(ids, mask, params):
            generate_calls.append((int(ids.shape[0]), int(ids.shape[1]), list(params.row_limits)))
            return orig_episode_sample(ids, mask, params)

        trainer.episodes.sample = episode_sample
    minibatch_tokens = []
    orig_train_phase = trainer.train_phase

    def train_phase(exp, stats):
        exp = orig_train_phase(exp, stats)  # the Experience (complete: experience_from_update completes it there)
        minibatch_tokens.append([int(m.rollout.action_mask.sum()) for m in exp.split(cfg.batch.mini_batch_size)])
        return exp

    trainer.train_phase = train_phase
    records = trainer.train()

    after = {role: engine.full_state_dict(role) for role in roles}
    steps_after = {role: engine.optimizer_steps(role) for role in roles}
    exp = trainer.last_experience
    mine = {
        "rollouts": rollouts,
        "minibatch_tokens": minibatch_tokens,
        "generate_calls": generate_calls,
        "experience": {"response_lengths": exp.rollout.response_lengths.tolist(),
                       "prompt_length": exp.rollout.prompt_length,
                       "scores": exp.scores.tolist(),
                       "turns": model_turns(exp.rollout.action_mask),
                       "episodes": episodes(exp.rollout)},
    }
    per_rank = gather(mine)
    result = None
    if is_main:
        change = {}
        for role in roles:
            change[role] = max(float((after[role][k].float() - before[role][k].float()).abs().max())
                               for k in before[role] if before[role][k].numel())
            torch.save(after[role], os.path.join(cfg.run.output_dir, f"final_{role}.pt"))
        result = {
            "name": spec["name"],
            "output_dir": cfg.run.output_dir,
            "world_size": engine.dist.world_size,
            "engines": sorted(engine.engines),
            "records": records,
            "ratio_trace": list(trainer.ratio_trace),
            "optimizer_steps": {role: [steps_before[role], steps_after[role]] for role in roles},
            "max_param_change": change,
            "num_params": {role: sum(v.numel() for v in before[role].values()) for role in roles},
            "ranks": per_rank,
        }
    return result


def main() -> int:
    return run_specs(run_one, "ppo_checks")


if __name__ == "__main__":
    sys.exit(main())
