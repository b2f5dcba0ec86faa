"""The policy losses: PPO's clipped surrogate (:func:`policy_loss`, optionally dual-clipped and clip-higher), GSPO
and CISPO, with the argument checks, aggregation and stats they share. The registry that picks one by name
(``--policy_loss``) is ``rlhf_engine/policy_losses.py``.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple, Union

import torch

from .checks import _Check, _mask, _num_tokens, _number, _raise_first, _tensor


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                action_mask: torch.Tensor, clip_eps: float, dual_clip: Optional[float] = None,
                num_tokens: Optional[Union[int, float, torch.Tensor]] = None, *, check: bool = True,
                clip_eps_high: Optional[float] = None, token_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (optionally dual-clipped, optionally clip-higher), token-level terms.

    ``ratio = exp(logprobs - old_logprobs)`` (log-ratio set to 0 at padding first: ratio 1, no overflow);
    per token ``max(-A * ratio, -A * clamp(ratio, 1 - eps, 1 + eps_high))`` (``eps_high = clip_eps_high``, default
    ``clip_eps``: DAPO's clip-higher when larger); with ``dual_clip = c`` tokens with ``A < 0`` take
    ``min(that, -c * A)``. ``loss = sum over real tokens / num_tokens`` (see the package docstring), or with
    ``token_weights`` ``sum over real tokens of term * weight`` (``loss_token_weights``: the other aggregation modes).
    ``old_logprobs`` and ``advantages`` are treated as constants (detached).

    Args:
        logprobs: ``[B, R]`` current actor log-probs (with grad).
        old_logprobs: ``[B, R]`` rollout-time actor log-probs.
        advantages: ``[B, R]`` (typically whitened) advantages.
        action_mask: ``[B, R]`` 0/1.
        clip_eps: >= 0.
        dual_clip: None or a constant > 1.
        num_tokens: global real-token count of the mini-batch (int or 1-element tensor, e.g. all-reduced);
            None uses ``action_mask.sum()``.
        clip_eps_high: >= 0, the upper clip bound; None = ``clip_eps``.
        token_weights: ``[B, R]`` weight of each token's term (replaces ``1 / num_tokens``), or None.
        check: run the data-dependent checks (``action_mask`` holds only 0/1, ``num_tokens`` >= the local token
            count), one host sync per call. False skips them (shape, dtype and hyperparameter checks still run): for
            micro-batches sliced from a batch validated once, like the PPO trainer's (its mask was checked by
            ``compute_rewards``/``compute_gae`` in this iteration; its ``num_tokens`` is an all-reduced sum that
            includes this micro-batch's tokens).

    Returns:
        ``(loss [], stats)``; stats are detached 0-dim fp32 tensors: ``approx_kl`` (masked mean of
        ``(r - 1) - log r``), ``clipfrac`` (share of real tokens where the clipped term is strictly larger, i.e.
        selected), ``ratio_mean``, ``ratio_max``, ``ratio_min`` (over real tokens; 1 when there is none) and
        ``tokens`` (local real-token count). With no real token the loss is 0 (and still differentiable).
    """
    lp, old, adv, m, tokens, denom, eps, eps_high = _policy_args(
        logprobs, old_logprobs, advantages, action_mask, clip_eps, clip_eps_high, num_tokens, check)
    c = None if dual_clip is None else _number("dual_clip", dual_clip, gt=1.0)
    adv = torch.where(m, adv, 0.0)
    log_ratio = torch.where(m, lp - old, 0.0)
    ratio = log_ratio.exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps, 1.0 + eps_high)
    per_token = torch.maximum(pg1, pg2)
    if c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -c * adv), per_token)
    return _aggregate(per_token, m, denom, token_weights, lp), _policy_stats(
        ratio, log_ratio, pg2.detach() > pg1.detach(), m, tokens)


def _policy_args(logprobs, old_logprobs, advantages, action_mask, clip_eps, clip_eps_high, num_tokens, check):
    """The checked inputs of every policy loss: (logprobs, old (detached), advantages (detached), mask (bool),
    local token count, denominator, eps, eps_high)."""
    lp = _tensor("logprobs", logprobs, ndim=2)
    old = _tensor("old_logprobs", old_logprobs, shape=lp.shape, shape_of="logprobs").detach()
    adv = _tensor("advantages", advantages, shape=lp.shape, shape_of="logprobs").detach()
    eps = _number("clip_eps", clip_eps, ge=0.0)
    eps_high = eps if clip_eps_high is None else _number("clip_eps_high", clip_eps_high, ge=0.0)
    checks: Optional[List[_Check]] = [] if check else None
    m = _mask("action_mask", action_mask, lp.shape, "logprobs", checks)
    tokens = m.sum().float()
    denom = _num_tokens(num_tokens, tokens, checks)
    _raise_first(checks)
    return lp, old, adv, m, tokens, denom, eps, eps_high


def _aggregate(per_token: torch.Tensor, m: torch.Tensor, denom: torch.Tensor, token_weights: Optional[torch.Tensor],
               lp: torch.Tensor) -> torch.Tensor:
    """sum over real tokens / denom, or with ``token_weights`` the weighted sum (``loss_token_weights``)."""
    if token_weights is None:
        return torch.where(m, per_token, 0.0).sum() / denom
    w = _tensor("token_weights", token_weights, shape=lp.shape, shape_of="logprobs").detach()
    return torch.where(m, per_token * w, 0.0).sum()


@torch.no_grad()
def _policy_stats(ratio: torch.Tensor, log_ratio: torch.Tensor, clipped: torch.Tensor, m: torch.Tensor,
                  tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """approx_kl (of the token log-ratios), clipfrac (share of real tokens where ``clipped``), ratio_mean / _max /
    _min (of ``ratio``, 1 with no real token) and tokens; detached 0-dim fp32."""
    n = tokens.clamp_min(1.0)
    r = ratio.detach()
    lr = log_ratio.detach()
    has = tokens > 0
    one = torch.ones((), device=r.device)
    if r.numel():
        r_max = torch.where(has, torch.where(m, r, -math.inf).max(), one)
        r_min = torch.where(has, torch.where(m, r, math.inf).min(), one)
    else:
        r_max = r_min = one
    return {
        "approx_kl": torch.where(m, (r - 1.0) - lr, 0.0).sum() / n,
        "clipfrac": (m & clipped).sum().float() / n,
        "ratio_mean": torch.where(m, r, 0.0).sum() / n,
        "ratio_max": r_max,
        "ratio_min": r_min,
        "tokens": tokens,
    }


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              action_mask: torch.Tensor, clip_eps: float, dual_clip: Optional[float] = None,
              num_tokens: Optional[Union[int, float, torch.Tensor]] = None, *, check: bool = True,
              clip_eps_high: Optional[float] = None, token_weights: Optional[torch.Tensor] = None
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), its GSPO-token form, as verl's ``gspo``.

    The sequence ratio is length-normalised: ``s_i = exp(mean_t (logprobs - old_logprobs))`` over the response's
    real tokens. Each token carries ``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]``: its value is ``s_i``, its
    gradient ``s_i * grad log pi(y_it)``. The clip is PPO's on that sequence-level value, per token
    ``max(-A s_it, -A clip(s_it, 1 - eps, 1 + eps_high))``, so a whole response is clipped or not. The paper
    aggregates per response (``loss_agg_mode seq_mean_token_mean``) with much smaller eps (3e-4 / 4e-4) than PPO's;
    here the run's ``loss_agg_mode`` and clip settings apply as given. ``dual_clip`` does not apply (ignored,
    refused by the config). Arguments and stats as ``policy_loss`` (``ratio_*``: the sequence ratios; ``clipfrac``:
    tokens of clipped responses; ``approx_kl``: of the token log-ratios).
    """
    lp, old, adv, m, tokens, denom, eps, eps_high = _policy_args(
        logprobs, old_logprobs, advantages, action_mask, clip_eps, clip_eps_high, num_tokens, check)
    adv = torch.where(m, adv, 0.0)
    log_ratio = torch.where(m, lp - old, 0.0)
    seq = log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # mean token log-ratio
    # value log s_i, gradient grad log pi (the addition last: verl's order, no cancellation in the value)
    log_s = torch.where(m, lp - lp.detach() + seq.detach(), 0.0)
    ratio = log_s.clamp(max=10.0).exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps, 1.0 + eps_high)
    per_token = torch.maximum(pg1, pg2)
    return _aggregate(per_token, m, denom, token_weights, lp), _policy_stats(
        ratio, log_ratio, pg2.detach() > pg1.detach(), m, tokens)


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               action_mask: torch.Tensor, clip_eps: float, dual_clip: Optional[float] = None,
               num_tokens: Optional[Union[int, float, torch.Tensor]] = None, *, check: bool = True,
               clip_eps_high: Optional[float] = None, token_weights: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025): a clipped, detached importance weight times the log-prob, as verl's
    ``cispo``: per token ``-A * sg(clip(r, 1 - eps, 1 + eps_high)) * logprobs`` with ``r = exp(logprobs -
    old_logprobs)``. Unlike PPO's clip, a clipped token keeps its gradient (``-A * w * grad log pi``, w the clipped
    weight). The paper bounds only the top (a large eps_low); here both bounds are the run's ``clip_eps`` /
    ``clip_eps_high``. ``dual_clip`` does not apply. Arguments and stats as ``policy_loss`` (``clipfrac``: tokens
    whose weight was clipped).
    """
    lp, old, adv, m, tokens, denom, eps, eps_high = _policy_args(
        logprobs, old_logprobs, advantages, action_mask, clip_eps, clip_eps_high, num_tokens, check)
    adv = torch.where(m, adv, 0.0)
    log_ratio = torch.where(m, lp - old, 0.0)
    ratio = log_ratio.exp()
    weight = ratio.detach().clamp(1.0 - eps, 1.0 + eps_high)
    per_token = -adv * weight * torch.where(m, lp, 0.0)
    return _aggregate(per_token, m, denom, token_weights, lp), _policy_stats(
        ratio, log_ratio, weight != ratio.detach(), m, tokens)
