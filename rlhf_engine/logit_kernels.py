"""Chunked fp32 log-prob and entropy kernels over ``[..., V]`` logits, with custom chunked backwards. Torch only.

Why chunked: the math must run in fp32, but upcasting whole ``[B, R, V]`` bf16 logits (a large vocabulary times every
response token) materialises a full fp32 copy, and plain autograd through ``log_softmax`` also saves fp32 ``[B, R, V]``
activations for the backward. Here the flattened ``[N, V]`` rows are processed ``chunk_rows`` at a time, so at most
about ``LOGITS_CHUNK_NUMEL`` fp32 elements exist at once, and non-contiguous slices such as ``logits[:, :-1]`` are read
through views, never copied whole.

What the custom backward does: the forward saves only the input logits (already alive) and an ``[N]`` fp32
logsumexp (plus the ``[N]`` entropy); the backward recomputes softmax chunk by chunk and writes the gradient straight
into a tensor of the logits' dtype (``onehot - softmax`` for log-probs, ``-p (log p + H)`` for the entropy, both
divided by the temperature).

No input checks here: callers pass validated arguments (``rlhf_engine.ppo_math.logprobs_from_logits`` and
``entropy_from_logits`` are the checked public entry points).
"""
from __future__ import annotations

import math
from typing import Iterator, List, Optional, Tuple

import torch

__all__ = ["LOGITS_CHUNK_NUMEL", "default_chunk_rows", "chunked_logprobs", "chunked_entropy",
           "chunked_logprobs_and_entropy"]

# Upper bound on the number of fp32 elements materialised at once by chunked_logprobs / chunked_entropy
# (2**26 elements = 256 MiB). Rows of the flattened [N, V] logits are processed in chunks of max(1, this // V) rows.
LOGITS_CHUNK_NUMEL = 1 << 26


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk when none is given: ``max(1, LOGITS_CHUNK_NUMEL // V)`` (read at call time)."""
    return max(1, LOGITS_CHUNK_NUMEL // max(1, vocab))


def _row_blocks(x: torch.Tensor) -> List[torch.Tensor]:
    """2-D views [n_i, V] of `x` [..., V] covering its rows in flattened (C) order, without copying.

    `x.view(-1, V)` fails for e.g. a `logits[:, :-1]` slice; then recurse over the first dim (each `x[i]` usually is
    viewable), so a non-contiguous slice never triggers a full copy of the logits."""
    vocab = x.shape[-1]
    if x.dim() <= 2:
        return [x.reshape(-1, vocab)] if x.dim() == 1 else [x]
    try:
        return [x.view(-1, vocab)]
    except RuntimeError:
        return [block for i in range(x.shape[0]) for block in _row_blocks(x[i])]


def _chunks(blocks: List[torch.Tensor], chunk_rows: int) -> Iterator[Tuple[int, torch.Tensor]]:
    """Yield (flat row offset, [n, V] chunk view) over the row blocks, chunks of at most `chunk_rows` rows."""
    offset = 0
    for block in blocks:
        for s in range(0, block.shape[0], chunk_rows):
            chunk = block[s:s + chunk_rows]
            yield offset + s, chunk
        offset += block.shape[0]


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    x = chunk.float()
    return x / temperature if temperature != 1.0 else x


def _logprobs_forward(blocks, labels, n_rows, temperature, chunk_rows, device, with_entropy=False):
    """([N] log p(label), [N] logsumexp, [N] entropy or None): with_entropy computes it in the same pass (one
    scaling and one logsumexp per chunk: the experience forwards), with exactly the operations of the entropy
    kernel, so both results are bitwise those of the separate kernels."""
    out = torch.empty(n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    ent = torch.empty(n_rows, dtype=torch.float32, device=device) if with_entropy else None
    for off, chunk in _chunks(blocks, chunk_rows):
        rows = slice(off, off + chunk.shape[0])
        x = _scaled(chunk, temperature)
        lse[rows] = torch.logsumexp(x, dim=-1)
        out[rows] = x.gather(-1, labels[rows, None]).squeeze(-1) - lse[rows]
        if ent is not None:
            ent[rows] = _entropy_of(x, lse[rows])
    return out, lse, ent


def _entropy_of(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[n, V] scaled fp32 logits and their [n] logsumexp -> [n] entropy (never modifies `x`)."""
    logp = x - lse[:, None]
    p = logp.exp()
    logp.masked_fill_(logp == -math.inf, 0.0)  # 0 * log 0 = 0 for -inf logits
    return -(p * logp).sum(-1)


def _entropy_forward(blocks, n_rows, temperature, chunk_rows, device):
    ent = torch.empty(n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    for off, chunk in _chunks(blocks, chunk_rows):
        rows = slice(off, off + chunk.shape[0])
        x = _scaled(chunk, temperature)  # may be the input itself (fp32, T=1): never modify it in place
        lse[rows] = torch.logsumexp(x, dim=-1)
        ent[rows] = _entropy_of(x, lse[rows])
    return ent, lse


class _LogProbsFn(torch.autograd.Function):
    """Chunked log p(label) whose backward recomputes softmax chunk by chunk: only the input logits (already alive)
    and an [N] fp32 logsumexp are saved, never a full fp32 copy of the logits."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_rows):  # noqa: D102
        blocks = _row_blocks(logits)
        out, lse, _ = _logprobs_forward(blocks, labels, labels.shape[0], temperature, chunk_rows, logits.device)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        return _logprobs_backward(ctx, grad_out), None, None, None


def _logprobs_backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
    """The logits' gradient of chunked log p(label), softmax recomputed chunk by chunk from the saved logsumexp."""
    logits, labels, lse = ctx.saved_tensors
    vocab, t = logits.shape[-1], ctx.temperature
    grad = torch.empty((labels.shape[0], vocab), dtype=logits.dtype, device=logits.device)
    for off, chunk in _chunks(_row_blocks(logits), ctx.chunk_rows):
        rows = slice(off, off + chunk.shape[0])
        g_out = grad_out[rows, None].float()
        g = (_scaled(chunk, t) - lse[rows, None]).exp_().mul_(-g_out)  # -softmax * grad
        g.scatter_add_(-1, labels[rows, None], g_out)  # + onehot * grad
        grad[rows] = g / t if t != 1.0 else g
    return grad.view(logits.shape)


class _LogProbsAndEntropyFn(torch.autograd.Function):
    """`_LogProbsFn` that also returns the rows' entropy from the same pass, as a metric (not differentiable): an
    on-policy training forward's, which the experience would otherwise have computed."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_rows):  # noqa: D102
        out, lse, ent = _logprobs_forward(_row_blocks(logits), labels, labels.shape[0], temperature, chunk_rows,
                                          logits.device, with_entropy=True)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_entropy):  # noqa: D102
        return _logprobs_backward(ctx, grad_out), None, None, None


class _EntropyFn(torch.autograd.Function):
    """Chunked softmax entropy; dH/dx_j = -p_j (log p_j + H) / temperature, recomputed chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_rows):  # noqa: D102
        n_rows = math.prod(logits.shape[:-1])
        ent, lse = _entropy_forward(_row_blocks(logits), n_rows, temperature, chunk_rows, logits.device)
        ctx.save_for_backward(logits, lse, ent)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        logits, lse, ent = ctx.saved_tensors
        vocab, t = logits.shape[-1], ctx.temperature
        grad = torch.empty((ent.shape[0], vocab), dtype=logits.dtype, device=logits.device)
        for off, chunk in _chunks(_row_blocks(logits), ctx.chunk_rows):
            rows = slice(off, off + chunk.shape[0])
            logp = _scaled(chunk, t) - lse[rows, None]
            p = logp.exp()
            logp.masked_fill_(logp == -math.inf, 0.0)
            g = p.mul_(logp.add_(ent[rows, None])).mul_(-grad_out[rows, None].float())
            grad[rows] = g / t if t != 1.0 else g
        return grad.view(logits.shape), None, None


def chunked_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     chunk_rows: Optional[int] = None) -> torch.Tensor:
    """``log softmax(logits / temperature)[label]`` per row, in fp32, chunk by chunk (unchecked).

    Args:
        logits: ``[..., V]`` floating, with N = prod of the leading dims >= 1 rows; any strides.
        labels: ``[N]`` long ids in ``[0, V)``, the labels of the rows of ``logits`` in flattened (C) order.
        temperature: finite, > 0.
        chunk_rows: positive int, or None for :func:`default_chunk_rows`.

    Returns:
        ``[N]`` fp32. Through the chunked autograd function when grad is enabled and ``logits`` requires it (its
        gradient has the logits' dtype), else a plain no-grad loop.
    """
    rows = default_chunk_rows(logits.shape[-1]) if chunk_rows is None else chunk_rows
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogProbsFn.apply(logits, labels, temperature, rows)
    return _logprobs_forward(_row_blocks(logits), labels, labels.shape[0], temperature, rows, logits.device)[0]


def chunked_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: Optional[int] = None) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row in nats, in fp32, chunk by chunk (unchecked).

    Args:
        logits: ``[..., V]`` floating, N = prod of the leading dims >= 1 rows; ``-inf`` logits contribute 0.
        temperature: finite, > 0.
        chunk_rows: positive int, or None for :func:`default_chunk_rows`.

    Returns:
        ``[N]`` fp32 ``-sum_v p_v log p_v`` (rows in flattened order); differentiable like :func:`chunked_logprobs`.
    """
    rows = default_chunk_rows(logits.shape[-1]) if chunk_rows is None else chunk_rows
    if torch.is_grad_enabled() and logits.requires_grad:
        return _EntropyFn.apply(logits, temperature, rows)
    n_rows = math.prod(logits.shape[:-1])
    return _entropy_forward(_row_blocks(logits), n_rows, temperature, rows, logits.device)[0]


def chunked_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                                 chunk_rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_logprobs` and :func:`chunked_entropy` of the same logits in one pass (unchecked).

    The same per-chunk operations as the two separate kernels, so the results are bitwise equal to theirs; half
    the passes over the logits. Returns ``([N] fp32 log-probs, [N] fp32 entropy)``: with grad enabled and ``logits``
    requiring it, the log-probs are differentiable as :func:`chunked_logprobs`'s and the entropy is not.
    """
    rows = default_chunk_rows(logits.shape[-1]) if chunk_rows is None else chunk_rows
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogProbsAndEntropyFn.apply(logits, labels, temperature, rows)
    with torch.no_grad():
        out, _, ent = _logprobs_forward(_row_blocks(logits), labels, labels.shape[0], temperature, rows,
                                        logits.device, with_entropy=True)
    return out, ent
