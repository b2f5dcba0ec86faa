"""Log-probs and entropy from logits, the checked entry points (the chunked fp32 kernels are in
``rlhf_engine/logit_kernels.py``), and :func:`mask_stop_tokens_`, which masks the stop tokens' logits at the
positions ``min_new_tokens`` forbids, so log-probs and entropy see the distribution sampling used.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..logit_kernels import chunked_entropy, chunked_logprobs, chunked_logprobs_and_entropy
from .checks import _number, _raise_first, _shape


def _logits_args(logits: object, temperature: object, chunk_rows: Optional[int]
                 ) -> Tuple[torch.Tensor, float, Optional[int]]:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        is_tensor = isinstance(logits, torch.Tensor)
        what = f"dtype {logits.dtype}, shape {_shape(logits)}" if is_tensor else type(logits).__name__
        raise ValueError(f"logits: expected a floating-point tensor [..., V], got {what}")
    t = _number("temperature", temperature, gt=0.0)
    if math.isinf(t):
        raise ValueError("temperature: expected a finite value > 0, got inf")
    if chunk_rows is not None:  # None: logit_kernels.default_chunk_rows(V), resolved by the kernels
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows: expected a positive int or None, got {chunk_rows!r}")
    return logits, t, chunk_rows


def _checked_labels(labels: object, logits: torch.Tensor, check: bool) -> torch.Tensor:
    """labels [...] (logits' shape without V) -> [N] long, ids checked to lie in [0, V) when `check`."""
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
            or labels.dtype == torch.bool:
        what = f"dtype {labels.dtype}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels: expected an integer (long) tensor, got {what}")
    if _shape(labels) != _shape(logits)[:-1]:
        raise ValueError(f"labels: expected shape {_shape(logits)[:-1]} (logits' shape without the vocab dim), "
                         f"got {_shape(labels)}")
    vocab = logits.shape[-1]
    flat = labels.reshape(-1).long()
    if check and flat.numel():
        out_of_range = (flat < 0) | (flat >= vocab)
        _raise_first([(out_of_range.any(), lambda: f"labels: expected ids in [0, {vocab}), got e.g. "
                                                   f"{flat[out_of_range][0].item()}")])
    return flat


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         chunk_rows: Optional[int] = None, *, check: bool = True) -> torch.Tensor:
    """Log-probability of each label under softmax(logits / temperature), computed in fp32.

    Args:
        logits: ``[..., V]`` any floating dtype (bf16/fp16 are upcast chunk by chunk).
        labels: ``[...]`` integer token ids in ``[0, V)`` (same leading shape as ``logits``).
        temperature: > 0; the logits are divided by it (use the sampling temperature).
        chunk_rows: rows of the flattened ``[N, V]`` logits processed at once; default
            ``max(1, LOGITS_CHUNK_NUMEL // V)`` (``rlhf_engine.logit_kernels``) so one fp32 chunk stays bounded.
        check: check that every label is in ``[0, V)`` (one host sync). False skips it, for labels already checked
            (the PPO training forward: the same response ids the experience forward checked in this iteration).
            An id out of range then fails inside ``gather`` (an index error on CPU, a device-side assert on CUDA).

    Returns:
        ``[...]`` fp32, ``logits[label]/T - logsumexp(logits/T)``. Differentiable w.r.t. ``logits`` with a chunked
        backward that never materialises a full fp32 copy of the logits (the gradient has the logits' dtype).
    """
    logits, t, chunk_rows = _logits_args(logits, temperature, chunk_rows)
    flat = _checked_labels(labels, logits, check)
    if flat.numel() == 0:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device) + 0.0 * logits.sum()
    return chunked_logprobs(logits, flat, t, chunk_rows).view(labels.shape)


def logprobs_and_entropy_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                                    chunk_rows: Optional[int] = None, *, check: bool = True
                                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` in one pass over the logits (the experience
    forwards, and an on-policy training forward's metrics): ``([...] fp32 log-probs, [...] fp32 entropy)``, bitwise
    equal to the two separate calls. With grad the log-probs are differentiable as :func:`logprobs_from_logits`'s
    and the entropy is NOT (a metric; an entropy bonus takes :func:`entropy_from_logits`). Arguments and checks as
    in :func:`logprobs_from_logits`."""
    logits, t, chunk_rows = _logits_args(logits, temperature, chunk_rows)
    flat = _checked_labels(labels, logits, check)
    if flat.numel() == 0:
        zeros = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
        return zeros + 0.0 * logits.sum(), zeros.clone()
    lp, ent = chunked_logprobs_and_entropy(logits, flat, t, chunk_rows)
    return lp.view(labels.shape), ent.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0,
                        chunk_rows: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) in nats, computed in fp32 chunk by chunk.

    Args:
        logits: ``[..., V]`` any floating dtype. ``-inf`` logits are allowed (they contribute 0).
        temperature: > 0.
        chunk_rows: as in :func:`logprobs_from_logits`.

    Returns:
        ``[...]`` fp32 ``-sum_v p_v log p_v``; differentiable with a chunked backward.
    """
    logits, t, chunk_rows = _logits_args(logits, temperature, chunk_rows)
    lead = _shape(logits)[:-1]
    if math.prod(lead) == 0:
        return torch.zeros(lead, dtype=torch.float32, device=logits.device) + 0.0 * logits.sum()
    return chunked_entropy(logits, t, chunk_rows).view(lead)


STOP_MASK_VALUE = -1e4  # exp(-1e4 - max) is exactly 0 in fp32; finite, so entropy's p * log p stays 0 (never NaN)


def mask_stop_tokens_(logits: torch.Tensor, stop_token_ids: torch.Tensor, min_new_tokens: int,
                      response_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The distribution sampling used under `min_new_tokens`: stop tokens cannot end a response before it.

    Args:
        logits: ``[B, R, V]`` the logits predicting response tokens 0..R-1 (modified IN PLACE: a masked copy of the
            whole tensor would cost what the chunked log-prob kernels save; autograd handles the in-place write,
            and the masked entries get gradient 0).
        stop_token_ids: ``[K]`` long, the stop tokens.
        min_new_tokens: positions ``t < min_new_tokens`` get ``STOP_MASK_VALUE`` at the stop tokens.
        response_index: ``[B, R]`` long, the response position ``t`` of each logit row when they are not in order
            (packed rows: ``[1, K]``); None: column ``t`` predicts token ``t``.

    Returns:
        ``logits`` (the same tensor).
    """
    n = min(int(min_new_tokens), logits.shape[1] if response_index is None else int(min_new_tokens))
    if n <= 0 or not stop_token_ids.numel():
        return logits
    stops = stop_token_ids.to(logits.device)
    if response_index is None:
        logits[:, :n].index_fill_(-1, stops, STOP_MASK_VALUE)
    else:
        rows, cols = (response_index < n).nonzero(as_tuple=True)
        logits[rows[:, None], cols[:, None], stops[None, :]] = STOP_MASK_VALUE
    return logits
