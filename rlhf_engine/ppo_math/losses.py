"""The other terms of the PPO losses: the per-token weights of the loss aggregation modes (``LOSS_AGG_MODES``,
:func:`loss_token_weights`), the KL term of the actor loss (:func:`kl_loss`) and the clipped critic loss
(:func:`value_loss`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch

from .checks import _Check, _f32, _mask, _num_tokens, _number, _raise_first, _shape, _tensor
from .kl import _estimator, _kl


LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def loss_token_weights(action_mask: torch.Tensor, mode: str, num_tokens: Union[float, torch.Tensor],
                       num_seqs: Union[float, torch.Tensor], max_len: int) -> torch.Tensor:
    """The weight of each token's loss term under an aggregation mode, normalised over the WHOLE mini-batch (all
    ranks: ``num_tokens`` / ``num_seqs`` are its global real-token and response counts), so any micro-batch split and
    rank count give the same loss.

    Args:
        action_mask: ``[B, R]`` 0/1 (the policy loss's mask).
        mode: ``token_mean`` = 1 / num_tokens; ``seq_mean_token_mean`` = 1 / (response length x num_seqs);
            ``seq_mean_token_sum_norm`` = 1 / (max_len x num_seqs) (Dr. GRPO).
        max_len: ``max_answer_seq_len``.

    Returns:
        ``[B, R]`` fp32, 0 on padding.
    """
    m = _mask("action_mask", action_mask, _shape(action_mask), "action_mask", None).float()
    if mode == "token_mean":
        return m / _f32(num_tokens, m.device).clamp(min=1.0)
    seqs = _f32(num_seqs, m.device).clamp(min=1.0)
    if mode == "seq_mean_token_mean":
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * seqs)
    if mode == "seq_mean_token_sum_norm":
        return m / (float(max_len) * seqs)
    raise ValueError(f"mode: expected one of {', '.join(LOSS_AGG_MODES)}, got {mode!r}")


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor, estimator: str,
            token_weights: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """A KL(actor || reference) term of the actor loss, aggregated like the policy loss.

    Per token, ``d = logprobs - ref_logprobs``: k1 = d (gradient ``grad log pi``: 0 in expectation under pi), k2 =
    d^2 / 2 (gradient ``d grad log pi``, the gradient of the reverse KL), k3 = exp(-d) - 1 + d (an unbiased estimate
    of the KL's value, but gradient ``(1 - exp(-d)) grad log pi``, not the reverse-KL gradient).

    Args:
        logprobs: ``[B, R]`` actor log-probs (with grad). ref_logprobs: ``[B, R]`` (constant).
        action_mask: ``[B, R]`` 0/1. estimator: one of ``KL_ESTIMATORS``.
        token_weights: ``[B, R]`` (``loss_token_weights``).

    Returns:
        ``(loss [], {"kl": local masked token mean of the estimate, detached})``.
    """
    lp = _tensor("logprobs", logprobs, ndim=2)
    ref = _tensor("ref_logprobs", ref_logprobs, shape=lp.shape, shape_of="logprobs").detach()
    m = _mask("action_mask", action_mask, lp.shape, "logprobs", None)
    # select before the estimator: junk at padding (inf, NaN) would otherwise reach k3's exp and, through the
    # masked product's backward (0 * inf), turn the gradient into NaN
    d_lp, d_ref = torch.where(m, lp.float(), 0.0), torch.where(m, ref.float(), 0.0)
    k = _kl(d_lp, d_ref, _estimator("estimator", estimator))
    loss = torch.where(m, k * token_weights.detach(), 0.0).sum()
    with torch.no_grad():
        kl = torch.where(m, k, 0.0).sum() / m.sum().clamp(min=1)
    return loss, {"kl": kl.detach().float()}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               clip_range: float, num_tokens: Optional[Union[int, float, torch.Tensor]] = None, *,
               check: bool = True) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped critic loss, token-level aggregation like :func:`policy_loss`.

    ``v_clipped = old + clamp(values - old, -clip_range, clip_range)``; per token
    ``0.5 * max((values - returns)^2, (v_clipped - returns)^2)``. ``old_values``/``returns`` are detached.

    Args:
        values: ``[B, R]`` current critic values (with grad).
        old_values: ``[B, R]`` rollout-time values.
        returns: ``[B, R]`` GAE returns.
        action_mask: ``[B, R]`` 0/1.
        clip_range: >= 0 (``float('inf')`` disables clipping).
        num_tokens: as in :func:`policy_loss`.
        check: as in :func:`policy_loss`.

    Returns:
        ``(loss [], stats)``: ``clipfrac`` (share of real tokens where the clipped term is strictly larger) and
        ``tokens``, detached 0-dim fp32 tensors.
    """
    v = _tensor("values", values, ndim=2)
    old = _tensor("old_values", old_values, shape=v.shape, shape_of="values").detach()
    ret = _tensor("returns", returns, shape=v.shape, shape_of="values").detach()
    clip = _number("clip_range", clip_range, ge=0.0)
    checks: Optional[List[_Check]] = [] if check else None
    m = _mask("action_mask", action_mask, v.shape, "values", checks)
    tokens = m.sum().float()
    denom = _num_tokens(num_tokens, tokens, checks)
    _raise_first(checks)

    v = torch.where(m, v, 0.0)
    old = torch.where(m, old, 0.0)
    ret = torch.where(m, ret, 0.0)
    v_clipped = old + (v - old).clamp(-clip, clip)
    loss1 = (v - ret).square()
    loss2 = (v_clipped - ret).square()
    loss = 0.5 * torch.where(m, torch.maximum(loss1, loss2), 0.0).sum() / denom
    with torch.no_grad():
        stats = {"clipfrac": (m & (loss2 > loss1)).sum().float() / tokens.clamp_min(1.0), "tokens": tokens}
    return loss, stats
