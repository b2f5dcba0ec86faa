"""From scores to advantages: per-token rewards (the KL penalty plus the clipped score on the last action,
:func:`compute_rewards`), :func:`last_action_index`, generalised advantage estimation over the actions
(:func:`compute_gae`) and masked whitening (:func:`masked_whiten`), all computed at actions only.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from .checks import _Check, _f32, _mask, _number, _raise_first, _shape, _tensor
from .kl import _estimator, _kl


def _values_and_mask(values: object, mask: object, mask_name: str = "mask") -> Tuple[torch.Tensor, torch.Tensor]:
    v = _tensor("values", values)
    checks: List[_Check] = []
    m = _mask(mask_name, mask, v.shape, "values", checks)
    _raise_first(checks)
    return v, m


def _mean_var(v: torch.Tensor, m: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and unbiased variance (divided by ``count - 1`` when ``count > 1``, else by ``count``; an empty
    mask gives 0, 0)."""
    n = m.sum().float()
    mean = torch.where(m, v, 0.0).sum() / n.clamp_min(1.0)
    sq = torch.where(m, (v - mean) ** 2, 0.0).sum()
    return mean, sq / torch.where(n > 1.0, n - 1.0, n).clamp_min(1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  mean: Optional[Union[float, torch.Tensor]] = None,
                  var: Optional[Union[float, torch.Tensor]] = None) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` on masked positions (plus ``mean`` again if not ``shift_mean``).

    Args:
        values: ``[B, R]`` (any shape) floating.
        mask: same shape, 0/1.
        shift_mean: if False the mean is added back (only the scale changes).
        eps: >= 0, added to the variance.
        mean, var: optional precomputed statistics (python numbers or 1-element tensors), e.g. global ones
            all-reduced across ranks. Give both or neither; when omitted they are the masked mean and the unbiased
            masked variance of ``values``.

    Returns:
        ``values.shape`` fp32; exactly 0 where ``mask == 0``.
    """
    v, m = _values_and_mask(values, mask)
    eps = _number("eps", eps, ge=0.0)
    if (mean is None) != (var is None):
        raise ValueError(f"{'var' if var is None else 'mean'}: expected mean and var to be given together, got only "
                         f"{'mean' if var is None else 'var'}")
    if mean is None:
        mu, sigma2 = _mean_var(v, m)
    else:
        for name, s in (("mean", mean), ("var", var)):
            if isinstance(s, torch.Tensor) and s.numel() != 1:
                raise ValueError(f"{name}: expected a number or a 1-element tensor, got shape {_shape(s)}")
            if not isinstance(s, torch.Tensor):
                _number(name, s, ge=0.0 if name == "var" else None)
        mu, sigma2 = _f32(mean, v.device).reshape(()), _f32(var, v.device).reshape(())
    out = (v - mu) * torch.rsqrt(sigma2 + eps)
    if not shift_mean:
        out = out + mu
    return torch.where(m, out, 0.0)


def compute_rewards(logprobs: torch.Tensor, ref_logprobs: Optional[torch.Tensor], scores: torch.Tensor,
                    action_mask: torch.Tensor, kl_coef: float, reward_clip: float,
                    kl_estimator: str = "k1") -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-kl_coef * KL`` on every action plus the clipped score on the last action.

    A ``[B]`` score, clamped to ``[-reward_clip, reward_clip]``, is added at the row's last action (index
    ``length - 1`` for a right-padded response, ``length = action_mask.sum(-1)``): the last action the loss trains.
    (DeepSpeed-Chat put it at ``length``, the first padding position, a masked action, so the score never reached the
    loss.) EOS-ended and truncated rows follow the same rule; a row without actions stays all 0. ``[B, R]`` scores are
    an episode's per-turn rewards already placed on the last action of each turn: each is clamped and added where it
    is (0 off actions). Computed without gradient.

    Args:
        logprobs: ``[B, R]`` actor log-probs of the response tokens.
        ref_logprobs: ``[B, R]`` reference log-probs, or None: a run without a reference, whose KL is 0 (then
            ``kl_coef`` must be 0).
        scores: ``[B]`` scores, or ``[B, R]`` placed turn rewards; must be finite.
        action_mask: ``[B, R]`` 0/1 (holes between an episode's turns allowed).
        kl_coef: >= 0.
        reward_clip: >= 0 (``float('inf')`` disables clipping).
        kl_estimator: one of ``KL_ESTIMATORS``.

    Returns:
        ``(rewards [B, R], kl [B, R])`` fp32, both exactly 0 at padding; ``kl = kl_penalty(...) * action_mask``.
    """
    est = _estimator("kl_estimator", kl_estimator)
    lp = _tensor("logprobs", logprobs, ndim=2)
    ref = None if ref_logprobs is None else _tensor("ref_logprobs", ref_logprobs, shape=lp.shape,
                                                    shape_of="logprobs")
    placed = isinstance(scores, torch.Tensor) and scores.dim() == 2
    sc = _tensor("scores", scores, shape=lp.shape if placed else lp.shape[:1],
                 shape_of="logprobs" if placed else "logprobs[:, 0]")
    beta = _number("kl_coef", kl_coef, ge=0.0)
    if ref is None and beta != 0:
        raise ValueError(f"kl_coef: {beta} needs reference log-probs; ref_logprobs is None")
    clip = _number("reward_clip", reward_clip, ge=0.0)
    checks: List[_Check] = []
    m = _mask("action_mask", action_mask, lp.shape, "logprobs", checks)
    bad_scores = ~torch.isfinite(sc)
    checks.append((bad_scores.any(), lambda: f"scores: expected finite values, got non-finite scores in rows "
                                             f"{bad_scores.nonzero().flatten().tolist()}"))
    _raise_first(checks)
    with torch.no_grad():
        # Select before the estimator so junk at padding cannot overflow (k3 exponentiates); log r = 0 there.
        kl = (torch.zeros_like(lp) if ref is None else
              torch.where(m, _kl(torch.where(m, lp, 0.0), torch.where(m, ref, 0.0), est), 0.0))
        rewards = torch.where(m, -beta * kl, 0.0)
        if placed:
            rewards = rewards + torch.where(m, sc.clamp(-clip, clip), 0.0)
        elif rewards.shape[1] > 0:
            last = last_action_index(m)  # rows without actions get index 0 and add exactly 0 there
            bonus = torch.where(m.any(-1), sc.clamp(-clip, clip), 0.0)
            rewards = rewards.scatter_add(1, last[:, None], bonus[:, None])
    return rewards, kl


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` 0/1 -> ``[B]`` long: the index of each row's last action (0 for a row without one)."""
    m = action_mask.long()
    R = m.shape[-1]
    return torch.where(m.any(-1), R - 1 - m.flip(-1).argmax(-1), 0)


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float,
                lam: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response, computed without gradient.

    Over the actions of a row, in order (``t'`` = the next action after ``t``):
    ``delta_t = r_t + gamma * V_{t'} - V_t``, ``A_t = delta_t + gamma * lam * A_{t'}``, with ``V`` and ``A`` of the
    (absent) action after the last one 0: the episode ends there, also for truncated rows. In a right-padded response
    ``t' = t + 1``; in an episode the context tokens between turns are skipped, so the last action of a turn
    bootstraps from the value of the next turn's first action, read after the observation. Junk at padding and
    context changes nothing. ``returns = advantages + values`` at actions.

    Args:
        rewards: ``[B, R]`` per-token rewards (see :func:`compute_rewards`).
        values: ``[B, R]`` critic values at the response tokens (rollout-time values).
        action_mask: ``[B, R]`` 0/1 (holes between an episode's turns allowed).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages [B, R], returns [B, R])`` fp32, detached, exactly 0 at padding.
    """
    r = _tensor("rewards", rewards, ndim=2)
    v = _tensor("values", values, shape=r.shape, shape_of="rewards")
    g = _number("gamma", gamma, ge=0.0, le=1.0)
    lmb = _number("lam", lam, ge=0.0, le=1.0)
    checks: List[_Check] = []
    mb = _mask("action_mask", action_mask, r.shape, "rewards", checks)
    _raise_first(checks)
    with torch.no_grad():
        m = mb.float()
        r = torch.where(mb, r, 0.0)
        v = torch.where(mb, v, 0.0)
        n_rows, length = r.shape
        next_value = r.new_zeros(n_rows)  # V and A of the next action (0 after the last one)
        next_adv = r.new_zeros(n_rows)
        advantages = [r.new_zeros(n_rows)] * length
        for t in range(length - 1, -1, -1):
            adv_t = r[:, t] + g * next_value - v[:, t] + g * lmb * next_adv
            advantages[t] = adv_t
            # at an action the recursion moves on; padding and context tokens pass the next action's terms through
            next_value = torch.where(mb[:, t], v[:, t], next_value)
            next_adv = torch.where(mb[:, t], adv_t, next_adv)
        adv = (torch.stack(advantages, dim=1) if length else r.clone()) * m
        returns = (adv + v) * m
    return adv, returns
