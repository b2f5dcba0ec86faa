"""Token selection of the lean backend: pure torch functions over one decoding step's logits.

The distribution is exactly the one PPO scores: softmax((logits with the stop tokens masked before min_new_tokens) /
temperature), no truncation (the config refuses top-k / top-p when sampling). Sampling uses the inverse CDF of that
distribution, one uniform number per row, with the cumulative sum in float64: torch.multinomial on CPU draws one
exponential variate per vocabulary entry, which measured 3.4 ms of a 5.8 ms decoding step (OPT H64, batch 4). The
same pass over the logits gives the logsumexp, hence the generation-time log-prob, at no extra cost.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...ppo_math import STOP_MASK_VALUE


def step_scores(logits: torch.Tensor, step: int, stop_ids: torch.Tensor, min_new_tokens: int,
                temperature: float) -> torch.Tensor:
    """The scores response token `step` is drawn from.

    Args:
        logits: ``[B, V]`` the model's next-token logits (any float dtype; not modified).
        step: the response position being drawn (0-based).
        stop_ids: ``[K]`` long, the stop tokens: set to ``STOP_MASK_VALUE`` while ``step < min_new_tokens``, the value
            the trainer's log-probs use (ppo_math.mask_stop_tokens_).
        temperature: > 0; 1.0 leaves the scores as they are.

    Returns:
        ``[B, V]`` fp32 scores; the distribution is their softmax.
    """
    s = logits.float()
    if step < min_new_tokens and stop_ids.numel():
        s = s.index_fill(-1, stop_ids, STOP_MASK_VALUE)
    return s / temperature if temperature != 1.0 else s


def sample_from_scores(scores: torch.Tensor, generator: Optional[torch.Generator] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row drawn from softmax(scores), and its log-prob.

    Inverse-CDF sampling: u ~ U[0, 1) per row, the token is the first index whose float64 cumulative mass exceeds
    u * total. A token of mass 0 can never be drawn (the cumulative sum does not grow there).

    Args:
        scores: ``[B, V]`` fp32.

    Returns:
        (tokens ``[B]`` long, log-probs ``[B]`` fp32 of those tokens under softmax(scores)).
    """
    top = scores.max(-1, keepdim=True).values
    mass = (scores - top).exp_()
    cdf = mass.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=scores.device, generator=generator) * total
    tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.shape[-1] - 1).squeeze(1)
    lse = top.squeeze(1) + total.squeeze(1).log().float()
    return tokens, scores.gather(1, tokens[:, None]).squeeze(1) - lse


def greedy_from_scores(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax token per row ``[B]``, its log-prob ``[B]`` under softmax(scores)) of ``[B, V]`` fp32 scores."""
    tokens = scores.argmax(-1)
    return tokens, scores.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scores, -1)
