"""The actor's and the critic's losses of one micro-batch, built once from `PPOConfig`, and the ordered
post-processing of an experience before training.

    actor = ActorObjective(engine, cfg.ppo, max_answer_seq_len)   # the plan's choice: policy loss by name, ...
    loss, stats = actor(micro, counts)                             # training forward + loss of one micro-batch

`Counts` are the mini-batch's token and response counts on ALL ranks (one all-reduce per mini-batch, the trainer's):
every loss is a share of a global mean, so any micro-batch split and rank count give the same gradient (ppo_math).

`experience_steps(ppo, n_samples)`: the corrections and filters, in order, each a function
`step(exp, stats, on_policy_rows) -> Experience` that returns a new Experience (the input is not changed) and adds
its metrics to `stats`: the rollout correction (ppo_math.rollout_correction), then the uniform-group filter.
`on_policy_rows` k: rows [0, k) have no old log-probs yet (`PPOConfig.defers_old_logprobs`); a truncate correction
leaves their weights to their training forward (`ActorObjective`, on_policy). Whitening is the last step
(`whiten_advantages`), applied by the trainer after the statistics of the raw advantages are taken.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch

from ..config import PPOConfig
from ..estimators import uniform_groups
from ..policy_losses import get_policy_loss
from ..ppo_math import kl_loss, loss_token_weights, rollout_correction, value_loss
from ..rollout import Experience, Rollout
from .experience import group_ids_of
from .ppo_metrics import add_correction_stats, max_abs_diff


@dataclass
class Counts:
    """A mini-batch's counts over every rank: real tokens, tokens and responses in the policy loss (at least 1),
    ptx tokens (fp32 0-dim)."""

    tokens: torch.Tensor
    policy_tokens: torch.Tensor
    policy_seqs: torch.Tensor
    ptx_tokens: torch.Tensor


def corrected_advantages(micro: Experience) -> torch.Tensor:
    """The advantages the policy loss sees: weighted by the rollout correction (w > 0 scales a token's loss term),
    else as they are."""
    return micro.advantages if micro.advantage_weights is None else micro.advantages * micro.advantage_weights


class ActorObjective:
    """The actor's loss: the registered policy loss (`--policy_loss`) on the corrected advantages, aggregated by
    `loss_agg_mode`, plus `kl_loss_coef` x the KL loss, minus `entropy_coef` x the token-mean entropy."""

    def __init__(self, engine: Any, ppo: PPOConfig, max_answer_seq_len: int):
        self.engine, self.ppo, self.max_len = engine, ppo, int(max_answer_seq_len)
        self.correction = ppo.rollout_correction if ppo.rollout_correction != "none" else None
        self.policy_loss = get_policy_loss(ppo.policy_loss)
        self.with_entropy = ppo.entropy_coef > 0
        # per-token weights: only for the other aggregation modes and the KL loss (token_mean divides by the count)
        self.needs_weights = ppo.loss_agg_mode != "token_mean" or bool(ppo.kl_loss_coef)

    def forward(self, rollout: Rollout, on_policy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The training forward of one micro-batch's rollout: ([b, R] log-probs, [b, R] entropy or None), with
        grad."""
        # check=False: no host sync per micro-batch; its ids and masks were checked with the whole experience. An
        # on-policy forward's entropy is the experience's metric: differentiable only for the entropy bonus
        return self.engine.actor_forward(rollout, with_entropy=self.with_entropy or on_policy, check=False,
                                         entropy_grad=self.with_entropy)

    def __call__(self, micro: Experience, counts: Counts, on_policy: bool = False,
                 outputs: Optional[tuple] = None) -> tuple[torch.Tensor, dict]:
        """Training forward and loss of one micro-batch -> (loss [], stats: the policy loss's, `policy_term` (the
        policy loss alone), `kl_loss`, `max_abs_log_ratio` (fp64, the ratio trace); all detached). `on_policy`: no
        optimizer step since the rollout, and the micro-batch's old log-probs were left to this forward
        (`PPOConfig.defers_old_logprobs`): they are its own log-probs, detached (every ratio exactly 1), returned in
        the stats as `old_logprobs` with the `entropy` [b, R] the experience forward would have given, and with a
        (truncate) rollout correction its weights from them (`correct` left these rows to this forward): `correction`
        = (mode, [b, R] weights, its stats). `outputs`: its `forward`'s, already run (the experience was completed
        from them: `experience_from_update`)."""
        ppo, r = self.ppo, micro.rollout
        logprobs, entropy = outputs if outputs is not None else self.forward(r, on_policy)
        old_logprobs = logprobs.detach() if on_policy else micro.old_logprobs
        pmask = r.action_mask if micro.policy_mask is None else micro.policy_mask
        advantages, correction = corrected_advantages(micro), None
        if on_policy and self.correction:  # the weights `correct` would have given these rows, from the same numbers
            cw, _, cs = rollout_correction(old_logprobs, micro.rollout_logprobs, r.action_mask, self.correction,
                                           ppo.rollout_correction_cap)
            advantages, correction = micro.advantages * cw, (self.correction, cw, cs)
        weights = (loss_token_weights(pmask, ppo.loss_agg_mode, counts.policy_tokens, counts.policy_seqs,
                                      self.max_len) if self.needs_weights else None)
        loss, stats = self.policy_loss(
            logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
            action_mask=pmask, clip_eps=ppo.clip_eps, clip_eps_high=ppo.upper_clip, dual_clip=ppo.dual_clip,
            num_tokens=counts.policy_tokens, check=False,
            token_weights=None if ppo.loss_agg_mode == "token_mean" else weights)  # token_mean: sum / tokens
        stats["policy_term"] = loss.detach()  # logged alone as policy/loss; the sum below is actor/loss
        if ppo.kl_loss_coef:
            kloss, _ = kl_loss(logprobs, micro.ref_logprobs, pmask, ppo.kl_loss_estimator, weights)
            loss = loss + ppo.kl_loss_coef * kloss
            stats["kl_loss"] = kloss.detach()
        if self.with_entropy:
            loss = loss - ppo.entropy_coef * (entropy * r.action_mask).sum() / counts.tokens
        stats["max_abs_log_ratio"] = max_abs_diff(logprobs, old_logprobs, r.action_mask)
        if on_policy:
            stats["old_logprobs"], stats["entropy"], stats["correction"] = old_logprobs, entropy.detach(), correction
        return loss, stats


class CriticObjective:
    """The critic's clipped value loss, a share of the mini-batch's global token mean."""

    def __init__(self, engine: Any, ppo: PPOConfig):
        self.engine, self.clip = engine, ppo.value_clip

    def forward(self, rollout: Rollout) -> torch.Tensor:
        """The training forward of one micro-batch's rollout: [b, R] values, with grad."""
        return self.engine.critic_forward(rollout)

    def __call__(self, micro: Experience, counts: Counts, outputs: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, dict]:
        """The loss of one micro-batch from its training forward (`outputs`: `forward`'s, already run)."""
        r = micro.rollout
        values = outputs if outputs is not None else self.forward(r)
        return value_loss(values=values, old_values=micro.values, returns=micro.returns, action_mask=r.action_mask,
                          clip_range=self.clip, num_tokens=counts.tokens, check=False)


# ---- experience post-processing: pure steps over an Experience, in order --------------------------------------------
Step = Callable[[Experience, Any, int], Experience]  # (experience, stats, on_policy_rows)


def correct(exp: Experience, stats: Any, on_policy_rows: int, mode: str, cap: float) -> Experience:
    """`--rollout_correction`: advantage weights and the policy mask from the generation-time log-probs. Rows
    [0, on_policy_rows) have no old log-probs yet: their weights stay 1 (on real tokens) here and their training
    forward computes them (`ActorObjective`), which a truncate mode allows (the policy mask is unchanged)."""
    k, mask = on_policy_rows, exp.rollout.action_mask
    if k and not mode.endswith("truncate"):
        raise ValueError(f"rollout_correction {mode}: masks tokens, so it needs every row's old log-probs first")
    weights, keep, cs = rollout_correction(exp.old_logprobs[k:], exp.rollout_logprobs[k:], mask[k:], mode, cap)
    add_correction_stats(stats, mode, cs)
    if k:
        weights, keep = torch.cat([mask[:k].float(), weights]), torch.cat([mask[:k], keep])
    return dataclasses.replace(exp, advantage_weights=weights, policy_mask=keep)


def filter_uniform_groups(exp: Experience, stats: Any, on_policy_rows: int, n_samples: int) -> Experience:
    """`--filter_uniform_groups`: a group whose shaped scores are all equal (all right, all wrong) leaves the policy
    loss (never dropped: shapes stay). Equal SCORES, not returns: the returns also hold each response's KL."""
    mask = exp.rollout.action_mask
    uniform = uniform_groups(exp.scores, group_ids_of(exp.rollout.batch_size, n_samples, mask.device))
    keep = exp.policy_mask if exp.policy_mask is not None else mask
    stats.add("uniform_rows", uniform.sum())
    return dataclasses.replace(exp, policy_mask=keep * (~uniform)[:, None].to(keep.dtype))


def experience_steps(ppo: PPOConfig, n_samples: int) -> list[Step]:
    """The run's corrections and filters, in the order they apply (module docstring)."""
    steps: list[Step] = []
    if ppo.rollout_correction != "none":
        steps.append(partial(correct, mode=ppo.rollout_correction, cap=ppo.rollout_correction_cap))
    if ppo.filter_uniform_groups:
        steps.append(partial(filter_uniform_groups, n_samples=n_samples))
    return steps
