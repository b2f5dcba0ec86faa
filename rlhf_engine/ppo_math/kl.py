"""KL(actor || reference) estimators: the names ``KL_ESTIMATORS`` (k1, k2, k3), their per-token formulas (``_kl``,
shared by the rewards and the KL loss) and the checked :func:`kl_penalty`.
"""
from __future__ import annotations

import torch

from .checks import _tensor


KL_ESTIMATORS = ("k1", "k2", "k3")


def _estimator(name: str, estimator: object) -> str:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"{name}: expected one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")
    return estimator  # type: ignore[return-value]


def _kl(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    log_ratio = lp - ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(-log_ratio) + log_ratio  # k3: exp(ref - lp) - 1 - (ref - lp)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token sample estimate of KL(actor || ref) from tokens sampled by the actor; ``log r = logprobs - ref``.

    * ``k1``: ``log r`` (unbiased, can be negative per token).
    * ``k2``: ``0.5 * (log r)^2`` (biased, >= 0, low variance).
    * ``k3``: ``exp(-log r) - 1 + log r`` = ``ref/actor - 1 - log(ref/actor)`` (Schulman; unbiased and >= 0).

    Args:
        logprobs: ``[B, R]`` (any shape) actor log-probs of the sampled tokens.
        ref_logprobs: same shape, reference log-probs of the same tokens.
        estimator: one of ``KL_ESTIMATORS``.

    Returns:
        same shape, fp32.
    """
    est = _estimator("estimator", estimator)
    lp = _tensor("logprobs", logprobs)
    ref = _tensor("ref_logprobs", ref_logprobs, shape=lp.shape, shape_of="logprobs")
    return _kl(lp, ref, est)
