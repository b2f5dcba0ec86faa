"""The losses of the supervised steps: the causal-LM negative log-likelihood of SFT and ptx (:func:`sft_loss`) and
the pairwise (Bradley-Terry) reward-model loss (:func:`pairwise_loss`), aggregated like the PPO losses.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch

from .checks import _Check, _mask, _num_tokens, _number, _raise_first, _shape, _tensor
from .logprobs import logprobs_from_logits


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
             num_tokens: Optional[Union[int, float, torch.Tensor]] = None
             ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Causal-LM negative log-likelihood of the masked label tokens, token-level aggregation like :func:`policy_loss`.

    The logits at position ``t`` predict ``labels[:, t + 1]``; that token's weight is ``loss_mask[:, t + 1]`` (so
    ``loss_mask[:, 0]`` is never used: nothing predicts the first token). Per token ``-log p(label)`` from
    :func:`logprobs_from_logits` (fp32, temperature 1: the same function PPO's actor log-probs use);
    ``loss = sum over masked tokens / num_tokens``.

    Args:
        logits: ``[B, L, V]`` model output (any floating dtype; with grad).
        labels: ``[B, L]`` integer token ids (usually the input ids).
        loss_mask: ``[B, L]`` 0/1: 1 for every token the loss trains (SFT: response tokens and their EOS; 0 for
            prompt tokens and padding).
        num_tokens: global count of masked tokens of the mini-batch; None uses the local count.

    Returns:
        ``(loss [], stats)``: ``nll_sum`` (sum of ``-log p`` over masked tokens) and ``tokens`` (local masked-token
        count), detached 0-dim fp32 tensors. With no masked token the loss is 0 (and still differentiable).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"logits: expected a [B, L, V] tensor, got "
                         f"{_shape(logits) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if not isinstance(labels, torch.Tensor) or _shape(labels) != _shape(logits)[:2]:
        raise ValueError(f"labels: expected shape {_shape(logits)[:2]} (logits' [B, L]), got "
                         f"{_shape(labels) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    checks: List[_Check] = []
    m = _mask("loss_mask", loss_mask, _shape(labels), "labels", checks)[:, 1:]
    tokens = m.sum().float()
    denom = _num_tokens(num_tokens, tokens, checks)
    _raise_first(checks)
    logprobs = logprobs_from_logits(logits[:, :-1], labels[:, 1:])
    nll = torch.where(m, -logprobs, 0.0)
    loss = nll.sum() / denom
    return loss, {"nll_sum": nll.detach().sum(), "tokens": tokens}


def pairwise_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: float = 0.0,
                  pair_mask: Optional[torch.Tensor] = None,
                  num_pairs: Optional[Union[int, float, torch.Tensor]] = None
                  ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Pairwise (Bradley-Terry) reward-model loss: ``sum over pairs of -log sigmoid(c - r - margin) / num_pairs``.

    Args:
        chosen_scores, rejected_scores: ``[B]`` scores of the preferred and the dispreferred response (with grad).
        margin: >= 0; asks for a score gap of about ``margin`` (0 = plain Bradley-Terry).
        pair_mask: ``[B]`` 0/1, 0 for a padding pair that must not count (None = all pairs count).
        num_pairs: global pair count of the mini-batch (all ranks, all micro-batches); None = the local count.

    Returns:
        ``(loss [], stats)`` with detached 0-dim fp32 sums over the counted pairs: ``loss_sum``, ``correct`` (pairs
        with ``c > r``, strictly), ``gap_sum`` (sum of ``c - r``), ``chosen_sum``, ``rejected_sum`` and ``pairs``.
    """
    c = _tensor("chosen_scores", chosen_scores, ndim=1)
    r = _tensor("rejected_scores", rejected_scores, shape=c.shape, shape_of="chosen_scores")
    mg = _number("margin", margin, ge=0.0)
    checks: List[_Check] = []
    m = (torch.ones_like(c, dtype=torch.bool) if pair_mask is None
         else _mask("pair_mask", pair_mask, c.shape, "chosen_scores", checks))
    pairs = m.sum().float()
    if num_pairs is None:
        denom = pairs.clamp_min(1.0)
    else:
        n = torch.as_tensor(num_pairs, dtype=torch.float32, device=c.device).reshape(())
        checks.append((pairs > n, lambda: f"num_pairs: expected the global pair count, which is >= the local count "
                                          f"{int(pairs.item())}, got {n.item():g}"))
        denom = n.clamp_min(1.0)
    _raise_first(checks)
    diff = torch.where(m, c - r, 0.0)
    per_pair = torch.where(m, -torch.nn.functional.logsigmoid(diff - mg), 0.0)
    loss = per_pair.sum() / denom
    with torch.no_grad():
        stats = {"loss_sum": per_pair.sum(), "correct": (m & (diff > 0)).sum().float(), "gap_sum": diff.sum(),
                 "chosen_sum": torch.where(m, c, 0.0).sum(), "rejected_sum": torch.where(m, r, 0.0).sum(),
                 "pairs": pairs}
    return loss, {k: v.detach() for k, v in stats.items()}
