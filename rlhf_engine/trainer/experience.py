"""Experience making: rollout -> old/reference log-probs, values, scores -> rewards -> GAE -> (global) whitening."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config import PPOConfig
from ..engine import all_reduce
from ..ppo_math import compute_gae, compute_rewards, masked_whiten
from ..rollout import Experience, Rollout


class NonFiniteError(RuntimeError):
    """A non-finite score, loss or advantage: training cannot continue with a silent wrong number."""


# A programmatic reward: (prompt_ids [B, P] left-padded, rollout) -> [B] scores, replacing the reward model.
RewardFn = Callable[[torch.Tensor, Rollout], torch.Tensor]


def decode_rollout(tokenizer, rollout: Rollout) -> tuple[list[str], list[str]]:
    """The real prompt and response text of every row (padding dropped by mask; special tokens skipped)."""
    P = rollout.prompt_length
    pmask = rollout.attention_mask[:, :P].bool()
    prompts = [tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(rollout.prompts, pmask)]
    responses = [tokenizer.decode(row[: int(n)].tolist(), skip_special_tokens=True)
                 for row, n in zip(rollout.responses, rollout.response_lengths)]
    return prompts, responses


def text_reward(fn: Callable, tokenizer) -> RewardFn:
    """Adapt a text reward function `fn(prompts, responses) -> floats` (see rlhf_engine.rewards) to a RewardFn."""
    from ..rewards import call_reward_fn

    def reward(prompt_ids: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        prompts, responses = decode_rollout(tokenizer, rollout)
        return torch.tensor(call_reward_fn(fn, prompts, responses), dtype=torch.float32)

    return reward


def make_experience(engine, rollout: Rollout, ppo: PPOConfig, kl_coef: float,
                    reward_fn: Optional[RewardFn] = None) -> tuple[Experience, torch.Tensor]:
    """One rollout batch -> (Experience without whitening, [B, R] rollout entropy).

    Every forward runs in eval mode with the rollout's position ids (engine contract). `reward_fn`, when given,
    scores the batch instead of the reward model: `reward_fn(rollout.prompts, rollout)` returns [B] scores.
    """
    old_logprobs, entropy = engine.actor_logprobs(rollout, with_entropy=True)
    ref_logprobs = engine.ref_logprobs(rollout)
    values = engine.critic_values(rollout)
    if reward_fn is None:
        scores, source = engine.reward_scores(rollout), "reward model"
    else:
        scores, source = reward_fn(rollout.prompts, rollout), "reward_fn"
    scores = torch.as_tensor(scores).to(device=old_logprobs.device, dtype=torch.float32)
    if scores.shape != (rollout.batch_size,):
        raise ValueError(f"{source} returned scores of shape {tuple(scores.shape)}; expected "
                         f"({rollout.batch_size},), one score per sequence")
    if not torch.isfinite(scores).all():
        bad = torch.nonzero(~torch.isfinite(scores)).flatten().tolist()
        raise NonFiniteError(f"{source} returned non-finite scores for rows {bad} of this rank's rollout batch "
                             f"(values {scores[bad].tolist()})")
    mask = rollout.action_mask
    rewards, kl = compute_rewards(logprobs=old_logprobs, ref_logprobs=ref_logprobs, scores=scores, action_mask=mask,
                                  kl_coef=kl_coef, reward_clip=ppo.reward_clip, kl_estimator=ppo.kl_estimator)
    advantages, returns = compute_gae(rewards=rewards, values=values, action_mask=mask, gamma=ppo.gamma, lam=ppo.lam)
    exp = Experience(rollout=rollout, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values,
                     scores=scores, rewards=rewards, kl=kl, advantages=advantages, returns=returns)
    return exp, entropy


def global_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, unbiased var) of the masked elements of x over every rank (one all-reduce)."""
    m = mask.float()
    xf = x.float() * m
    packed = torch.stack([m.sum(), xf.sum(), (xf * xf).sum()]).double()
    n, s, ss = all_reduce(packed).unbind()
    mean = s / n.clamp(min=1)
    var = (ss - n * mean * mean) / (n - 1).clamp(min=1)
    return n, mean.float(), var.clamp(min=0).float()


def whiten_advantages(exp: Experience) -> Experience:
    """Whiten advantages with the global masked mean/var, so every rank uses identical statistics."""
    mask = exp.rollout.action_mask
    _, mean, var = global_moments(exp.advantages, mask)
    exp.advantages = masked_whiten(exp.advantages, mask, shift_mean=True, mean=mean, var=var)
    if not torch.isfinite(exp.advantages).all():
        raise NonFiniteError("non-finite advantages after whitening")
    return exp
