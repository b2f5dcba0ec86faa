"""Experience making: rollout -> old/reference log-probs, values (with a critic), scores -> rewards -> the advantage
estimator (rlhf_engine/estimators.py, `ppo.advantage_estimator`; GAE by default) -> (global) whitening."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from ..config import PPOConfig
from ..comm import all_reduce
from .. import estimators
from ..ppo_math import compute_rewards, masked_whiten
from ..rollout import Experience, Rollout
from .guards import NonFiniteError  # noqa: F401  (re-exported: defined with the other stop reasons)


# A programmatic reward: (prompt_ids [B, P] left-padded, rollout) -> [B] scores, replacing the reward model.
RewardFn = Callable[[torch.Tensor, Rollout], torch.Tensor]


def decode_rollout(tokenizer, rollout: Rollout, keep_special_prompt: bool = False) -> tuple[list[str], list[str]]:
    """The real prompt and response text of every row (padding dropped by mask; special tokens skipped, or kept in
    the prompts with `keep_special_prompt`: the prompt exactly as the model saw it, chat template included)."""
    P = rollout.prompt_length
    pmask = rollout.attention_mask[:, :P].bool()
    prompts = [tokenizer.decode(row[m].tolist(), skip_special_tokens=not keep_special_prompt)
               for row, m in zip(rollout.prompts, pmask)]
    responses = [tokenizer.decode(row[: int(n)].tolist(), skip_special_tokens=True)
                 for row, n in zip(rollout.responses, rollout.response_lengths)]
    return prompts, responses


def row_columns(rollout: Rollout) -> dict[str, list]:
    """The data columns of a rollout's rows as keyword lists aligned with its samples ({} without rows)."""
    if not rollout.rows or not rollout.rows[0].columns:
        return {}
    return {c: [row.columns[c] for row in rollout.rows] for c in rollout.rows[0].columns}


def text_reward(fn: Callable, tokenizer) -> RewardFn:
    """Adapt a text reward function (rlhf_engine.rewards, its calling rule) to a RewardFn: a plain
    `fn(prompts, responses)` gets the prompts without special tokens, as always; one that takes data columns gets
    the prompts as the model saw them and its columns from the rollout's rows."""
    from ..rewards import call_reward_fn, reward_fn_name, reward_signature

    plain = reward_signature(fn).legacy

    def reward(prompt_ids: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        prompts, responses = decode_rollout(tokenizer, rollout, keep_special_prompt=not plain)
        columns = {} if plain else row_columns(rollout)
        # a reward server also gets the rollout's ids, to score them as the reward engine does (rewards/remote.py)
        scorer = fn.for_rollout(rollout, tokenizer) if hasattr(fn, "for_rollout") else fn
        return torch.tensor(call_reward_fn(scorer, prompts, responses, columns), dtype=torch.float32)

    reward.source_name = f"reward_fn {reward_fn_name(fn)}"
    return reward


@dataclass
class Forwards:
    """The experience forwards of one rollout batch: [B, R] old log-probs, entropy, reference log-probs (None without
    a reference) and values (None without a critic), and the [B] scores (None when scoring failed: `error` holds
    why)."""

    old_logprobs: torch.Tensor
    entropy: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    values: Optional[torch.Tensor]
    scores: Optional[torch.Tensor]
    error: Optional[Exception] = None


@dataclass
class PendingExperience:
    """An experience before its rewards and advantages: the rollout (one buffer), its [B, R] generation log-probs
    (None where the backend gives none), the experience forwards run so far and the [B] raw and shaped scores.
    `PPOTrainer.complete_experience` turns it into the Experience."""

    rollout: Rollout
    rollout_logprobs: Optional[torch.Tensor]
    fw: Forwards
    raw_scores: torch.Tensor
    scores: torch.Tensor

    def with_forwards(self, logprobs: torch.Tensor, entropy: torch.Tensor,
                      values: Optional[torch.Tensor]) -> "PendingExperience":
        """The actor's [B, R] log-probs and entropy (and the critic's [B, R] values) from training forwards of every
        row, detached, as the experience forwards' (`experience_from_update`)."""
        fw = replace(self.fw, old_logprobs=logprobs.detach(), entropy=entropy.detach(),
                     values=values.detach() if values is not None else None)
        return replace(self, fw=fw)


def experience_forwards(engine, rollout: Rollout, source: RewardFn, on_policy_rows: int = 0,
                        values: bool = True) -> Forwards:
    """Every forward of the experience (eval mode, the rollout's position ids), then the scores of the run's reward
    source (trainer/reward_sources), `source(rollout.prompts, rollout)`. A scoring failure (the source raising, a
    wrong shape, a non-finite score) does not raise here: it is returned in `error`, so the trainer can stop every
    rank together (`StepGuard.agree`). The scoring comes after every (possibly collective) forward.
    `on_policy_rows` k (`PPOConfig.defers_old_logprobs`: the first mini-batch's rows, the same k on every rank): the
    actor's forward skips rows [0, k), whose old log-probs and entropy are 0 here and come from their first training
    forward (`ActorStep`). `values=False`: no critic forward (the values come from its training forward too:
    `experience_from_update`, where k is every row)."""
    old_logprobs, entropy = engine.actor_logprobs(rollout.select(slice(on_policy_rows, None)) if on_policy_rows
                                                  else rollout, with_entropy=True)
    if on_policy_rows:
        skipped = old_logprobs.new_zeros((min(on_policy_rows, rollout.batch_size), rollout.response_width))
        old_logprobs, entropy = torch.cat([skipped, old_logprobs]), torch.cat([skipped, entropy])
    ref_logprobs = engine.ref_logprobs(rollout) if engine.has_reference else None  # none where nothing reads it
    value_out = engine.critic_values(rollout) if engine.has_critic and values else None
    scores, error = None, None
    try:
        scores = score_rollout(rollout, source, device=old_logprobs.device)
    except Exception as e:  # noqa: BLE001  (any scoring failure is reported on every rank by the trainer)
        error = e
    return Forwards(old_logprobs, entropy, ref_logprobs, value_out, scores, error)


def score_rollout(rollout: Rollout, source: RewardFn, device: Optional[torch.device] = None) -> torch.Tensor:
    """[B] fp32 scores of a rollout batch by `source`, checked: one finite score per sequence (else ValueError /
    NonFiniteError naming the source by its `source_name`)."""
    scores, source = source(rollout.prompts, rollout), getattr(source, "source_name", "") or "reward_fn"
    scores = torch.as_tensor(scores).to(device=device or rollout.sequences.device, dtype=torch.float32)
    if scores.shape != (rollout.batch_size,):
        raise ValueError(f"{source} returned scores of shape {tuple(scores.shape)}; expected "
                         f"({rollout.batch_size},), one score per sequence")
    if not torch.isfinite(scores).all():
        bad = torch.nonzero(~torch.isfinite(scores)).flatten().tolist()
        raise NonFiniteError(f"{source} returned non-finite scores for rows {bad} of this rank's rollout batch "
                             f"(values {scores[bad].tolist()})")
    return scores


def build_experience(rollout: Rollout, fw: Forwards, scores: torch.Tensor, ppo: PPOConfig, kl_coef: float,
                     group_ids: Optional[torch.Tensor] = None, moments: Optional[Callable] = None) -> Experience:
    """Forwards + the scores that enter the reward -> rewards (KL penalty, clipped score) -> the run's advantage
    estimator (by name from the registry) -> Experience. `group_ids` [B]: the prompt of each response (None: one
    response per prompt); `moments(x, mask) -> (mean, var)`: global statistics, for the estimators that whiten."""
    mask = rollout.action_mask
    # an episode's turn rewards enter where they sit, on each turn's last action; a response's score on its last
    placed = rollout.turn_rewards.to(scores.device) if rollout.is_episode else scores
    rewards, kl = compute_rewards(logprobs=fw.old_logprobs, ref_logprobs=fw.ref_logprobs, scores=placed,
                                  action_mask=mask, kl_coef=kl_coef, reward_clip=ppo.reward_clip,
                                  kl_estimator=ppo.kl_estimator)
    estimator = estimators.get(ppo.advantage_estimator)
    if group_ids is None:
        group_ids = torch.arange(rollout.batch_size, device=mask.device)
    advantages, returns = estimator.fn(rewards=rewards, action_mask=mask, values=fw.values, scores=scores,
                                       group_ids=group_ids, gamma=ppo.gamma, lam=ppo.lam, moments=moments)
    return Experience(rollout=rollout, old_logprobs=fw.old_logprobs, ref_logprobs=fw.ref_logprobs, values=fw.values,
                      scores=scores, rewards=rewards, kl=kl, advantages=advantages, returns=returns)


def group_ids_of(batch_size: int, n_samples: int, device: torch.device) -> torch.Tensor:
    """[B] long: the prompt of each row. The n samples of a prompt are consecutive rows of every generation batch
    (and of their concatenation), so row // n names it."""
    return torch.arange(batch_size, device=device) // n_samples


def global_mean_var(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased var) of the masked elements of x over every rank: the `moments` the estimators whiten with."""
    _, mean, var = global_moments(x, mask)
    return mean, var


def global_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, unbiased var) of the masked elements of x over every rank (one all-reduce)."""
    m = mask.double()
    xd = x.double() * m  # float64 from the first product: s*s - n*ss cancels, fp32 sums would lose the variance
    packed = torch.stack([m.sum(), xd.sum(), (xd * xd).sum()])
    n, s, ss = all_reduce(packed).unbind()
    mean, var = moments_from_sums(n, s, ss)
    return n, mean.float(), var.float()


def moments_from_sums(n: torch.Tensor, s: torch.Tensor, ss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased variance, at least 0) of values from their count, sum and sum of squares."""
    mean = s / n.clamp(min=1)
    return mean, ((ss - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)


def whiten_advantages(exp: Experience) -> Experience:
    """Whiten advantages with the global masked mean/var, so every rank uses identical statistics."""
    mask = exp.rollout.action_mask
    _, mean, var = global_moments(exp.advantages, mask)
    exp.advantages = masked_whiten(exp.advantages, mask, shift_mean=True, mean=mean, var=var)
    if not torch.isfinite(exp.advantages).all():
        raise NonFiniteError("non-finite advantages after whitening")
    return exp
