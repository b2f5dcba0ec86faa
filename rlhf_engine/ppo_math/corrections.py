"""Rollout correction: importance weights (and a policy mask) for a generation backend that does not sample exactly
from pi_old, in TRL's four modes (``ROLLOUT_CORRECTIONS``; ``RENAMED_CORRECTIONS`` are the refused names of an
earlier release).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from .checks import _mask, _number, _tensor


ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# the names of an earlier release: refused, naming the mode that replaces them
RENAMED_CORRECTIONS = {"tis": "token_truncate", "mis": "sequence_mask"}


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor,
                       mode: str, cap: float) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Importance correction for a generation backend that does not sample exactly from pi_old (TRL's four modes).

    With ``d_t = old_logprobs - rollout_logprobs`` (0 on padding), the token ratio ``rho_t = exp(d_t)`` and the
    sequence ratio ``rho = exp(sum_t d_t)`` of each response:

    * ``token_truncate``: ``w_t = min(rho_t, C)`` (truncated importance sampling);
    * ``token_mask``: ``w_t = rho_t`` where ``rho_t <= C``; a token above the cap gets 0 and leaves the policy mask;
    * ``sequence_truncate``: every token of a response gets ``w = min(rho, C)``;
    * ``sequence_mask``: every token of a response gets ``w = rho`` where ``rho <= C``; a response above the cap gets
      0 and leaves the policy mask (the critic still trains on it);
    * ``none``: weights 1, mask unchanged.

    The weights multiply the advantages of the policy loss (w > 0 scales both PPO terms alike, so
    ``-A w max(r, clip(r))`` holds); masked tokens leave the policy loss's token count too. Only the upper cap is
    applied, as in TRL (the earlier ``mis`` also dropped responses below 1/C).

    Args:
        old_logprobs, rollout_logprobs: ``[B, R]`` recomputed and generation-time log-probs of the sampled tokens.
        action_mask: ``[B, R]`` 0/1.
        mode: one of ``ROLLOUT_CORRECTIONS``.
        cap: C > 1.

    Returns:
        ``(weights [B, R] fp32 (0 on padding and on masked tokens), policy mask [B, R] (action_mask minus masked
        tokens), stats)``, all detached; stats: ``capped`` (truncate modes: real tokens whose weight was cut to C),
        ``masked`` (mask modes: real tokens masked out), ``masked_seqs`` (sequence_mask: responses masked out),
        0-dim fp32 counts, and ``weight_dev_max``: the largest ``|w - 1|`` over the tokens kept (0 when nothing was
        corrected: the stale-rollout tests' negative control).
    """
    old = _tensor("old_logprobs", old_logprobs, ndim=2).detach()
    roll = _tensor("rollout_logprobs", rollout_logprobs, shape=old.shape, shape_of="old_logprobs").detach()
    m = _mask("action_mask", action_mask, old.shape, "old_logprobs", None)
    if mode in RENAMED_CORRECTIONS:
        raise ValueError(f"mode {mode!r} is now {RENAMED_CORRECTIONS[mode]!r} (docs/sampling.md)")
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"mode: expected one of {', '.join(ROLLOUT_CORRECTIONS)}, got {mode!r}")
    c = _number("cap", cap, gt=1.0)
    d = torch.where(m, old.float() - roll.float(), 0.0)
    zero = torch.zeros((), device=d.device)
    stats = {"capped": zero, "masked": zero, "masked_seqs": zero, "weight_dev_max": zero}
    if mode == "none":
        return m.float(), m.to(action_mask.dtype), stats
    if mode.startswith("token"):
        ratio = d.exp()
    else:  # the sequence ratio on every token of its response
        ratio = d.sum(-1, keepdim=True).exp().expand_as(d)
    over = (ratio > c) & m
    if mode.endswith("truncate"):
        weights, keep = torch.where(m, ratio.clamp(max=c), 0.0), m
        stats["capped"] = over.sum().float()
    else:
        keep = m & ~over
        weights = torch.where(keep, ratio, 0.0)
        stats["masked"] = over.sum().float()
        if mode == "sequence_mask":
            stats["masked_seqs"] = over.any(-1).sum().float()
    stats["weight_dev_max"] = torch.where(keep, (weights - 1.0).abs(), 0.0).max() if keep.any() else zero
    return weights, keep.to(action_mask.dtype), stats
