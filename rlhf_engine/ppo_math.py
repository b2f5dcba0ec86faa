"""PPO math for RLHF: log-probs, KL penalties, rewards, GAE, losses, KL controllers. Pure functions of tensors.

Imports torch only (and ``logit_kernels``, the torch-only chunked fp32 log-prob/entropy kernels behind
:func:`logprobs_from_logits` and :func:`entropy_from_logits`, which check their arguments here). Everything is
computed in fp32 whatever the input dtype (bf16/fp16 inputs are upcast; fp64 inputs are computed in fp32 too), and
every result is fp32.

Conventions
-----------
* Per-token tensors cover the response actions only and have shape ``[B, R]`` (batch, response length).
* ``action_mask[b, t] == 1`` iff response token ``t`` of row ``b`` is a token the model wrote (EOS included). A
  single-turn response is right-padded, so its mask row reads ``1 ... 1 0 ... 0``; a multi-turn episode's row has
  holes ``1 1 0 0 1 1 0 0`` where observation and chat-template tokens sit (context: real tokens, no actions). Every
  function here takes either: per-token terms are computed at actions only, the score lands on the LAST action, and
  GAE and discounted returns pass over the holes (the next action's value is the next state's). Masks may be bool,
  integer or floating tensors holding only 0/1.
* Values at masked (padding) positions of any input are junk and never influence any result: inputs are selected
  with ``torch.where`` (not multiplied by the mask, so even NaN/inf junk cannot leak), and every per-token output is
  exactly 0 at padding.
* Bad input (shape/dtype mismatch, non-0/1 masks, out-of-range
  hyperparameters, unknown estimator names) raises ``ValueError`` naming the argument. Data-dependent checks (mask
  values, label range, finite scores) are batched into one host sync per call. The functions a trainer calls per
  micro-batch (:func:`logprobs_from_logits`, :func:`policy_loss`, :func:`value_loss`) take ``check=False`` to skip
  them for tensors already validated (each sync makes the host wait for the device instead of queueing the next
  kernels); shape, dtype and hyperparameter checks need no sync and always run.

Token-level loss aggregation across micro-batches and ranks
-----------------------------------------------------------
``policy_loss`` / ``value_loss`` return ``sum over real tokens of per-token loss / num_tokens``, where the trainer
passes ``num_tokens`` = the GLOBAL real-token count of the whole mini-batch (all micro-batches of all ranks). Then,
with shards ``s`` holding token sets ``T_s``,

    sum_s loss_s = sum_s (sum_{t in T_s} l_t) / N = (sum_t l_t) / N,   N = sum_s |T_s|,

which is exactly the full-batch token mean; gradients add up the same way (gradient accumulation sums, and the
data-parallel all-reduce must then SUM, or average with the world size folded into N). The naive alternative,
averaging per-shard means ``(1/S) sum_s (sum_{t in T_s} l_t) / |T_s|``, weights each token by ``1/(S |T_s|)``, so
tokens of short shards count more than tokens of long shards; it equals the full-batch mean only when all shards hold
the same number of tokens. With ``num_tokens=None`` the local token count is used (a plain local mean).

Stats are returned as detached 0-dim fp32 tensors (no host sync). Means (``approx_kl``, ``clipfrac``, ``ratio_mean``)
are local; to combine them across shards weight each by its ``tokens``; ``ratio_max``/``ratio_min`` combine with
MAX/MIN.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .logit_kernels import chunked_entropy, chunked_logprobs, chunked_logprobs_and_entropy

__all__ = [
    "KL_ESTIMATORS",
    "logprobs_from_logits",
    "entropy_from_logits",
    "mask_stop_tokens_",
    "masked_whiten",
    "kl_penalty",
    "compute_rewards",
    "compute_gae",
    "last_action_index",
    "policy_loss",
    "LOSS_AGG_MODES",
    "loss_token_weights",
    "kl_loss",
    "ROLLOUT_CORRECTIONS",
    "RENAMED_CORRECTIONS",
    "gspo_loss",
    "cispo_loss",
    "rollout_correction",
    "value_loss",
    "sft_loss",
    "pairwise_loss",
    "FixedKLController",
    "AdaptiveKLController",
]

KL_ESTIMATORS = ("k1", "k2", "k3")

_Check = Tuple[torch.Tensor, Callable[[], str]]  # (0-dim bool tensor "input is bad", message builder)


# ----------------------------------------------------------------------------------------------------------------------
# Validation helpers (private)
# ----------------------------------------------------------------------------------------------------------------------


def _shape(x: torch.Tensor) -> Tuple[int, ...]:
    return tuple(x.shape)


def _tensor(name: str, x: object, *, shape: Optional[Sequence[int]] = None,
            shape_of: str = "", ndim: Optional[int] = None) -> torch.Tensor:
    """Check that `x` is a floating tensor of the given shape/ndim; return it upcast to fp32 (graph kept)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {_shape(x)}")
    if shape is not None and _shape(x) != tuple(shape):
        ref = f" (the shape of {shape_of})" if shape_of else ""
        raise ValueError(f"{name}: expected shape {tuple(shape)}{ref}, got {_shape(x)}")
    return x.float()


def _mask(name: str, mask: object, shape: Sequence[int], shape_of: str, checks: Optional[List[_Check]]
          ) -> torch.Tensor:
    """Check a 0/1 mask of the given shape (value checks are appended to `checks`; None skips them, and their
    kernels); return it as a bool tensor."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise ValueError(f"{name}: expected a bool, integer or floating 0/1 tensor, got dtype {mask.dtype}")
    if _shape(mask) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} (the shape of {shape_of}), got {_shape(mask)}")
    if mask.dtype != torch.bool:
        raw = mask
        if checks is not None:
            not01 = (raw != 0) & (raw != 1)
            checks.append((not01.any(), lambda: f"{name}: expected only 0/1 values, got e.g. "
                                                f"{raw[not01][0].item()!r}"))
        mask = raw != 0
    return mask


def _raise_first(checks: Optional[List[_Check]]) -> None:
    """Evaluate the data-dependent checks with a single host sync; raise ValueError for the first failing one."""
    if not checks:
        return
    device = checks[0][0].device
    flags = torch.stack([bad.reshape(()).to(device) for bad, _ in checks]).tolist()
    for bad, (_, message) in zip(flags, checks):
        if bad:
            raise ValueError(message())


def _number(name: str, x: object, *, ge: Optional[float] = None, gt: Optional[float] = None,
            le: Optional[float] = None) -> float:
    """A real number (python/numpy scalar or 1-element tensor) within the given bounds, as a python float."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex():
            raise ValueError(f"{name}: expected a real number, got a tensor of shape {_shape(x)} and dtype {x.dtype}")
        x = x.item()
    if isinstance(x, (str, bytes, bool)) or x is None:
        raise ValueError(f"{name}: expected a real number, got {x!r}")
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a real number, got {x!r}") from None
    if math.isnan(v):
        raise ValueError(f"{name}: expected a real number, got nan")
    if ge is not None and not v >= ge:
        raise ValueError(f"{name}: expected a value >= {ge}, got {v}")
    if gt is not None and not v > gt:
        raise ValueError(f"{name}: expected a value > {gt}, got {v}")
    if le is not None and not v <= le:
        raise ValueError(f"{name}: expected a value <= {le}, got {v}")
    return v


def _estimator(name: str, estimator: object) -> str:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"{name}: expected one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")
    return estimator  # type: ignore[return-value]


def _num_tokens(num_tokens: object, local: torch.Tensor, checks: Optional[List[_Check]]) -> torch.Tensor:
    """The loss denominator as a 0-dim fp32 tensor (>= 1 so an all-empty batch gives loss 0, never NaN); the check
    `num_tokens >= local` is appended to `checks` (None: not checked)."""
    if num_tokens is None:
        return local.clamp_min(1.0)
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1 or num_tokens.is_complex() or num_tokens.dtype == torch.bool:
            raise ValueError(f"num_tokens: expected a number or a 1-element real tensor, got shape "
                             f"{_shape(num_tokens)} and dtype {num_tokens.dtype}")
        n = num_tokens.reshape(()).to(device=local.device, dtype=torch.float32)
    else:
        n = torch.tensor(_number("num_tokens", num_tokens, ge=0), dtype=torch.float32, device=local.device)
    if checks is None:
        return n.clamp_min(1.0)
    checks.append((local > n, lambda: f"num_tokens: expected the global real-token count, which is >= the local count "
                                      f"{int(local.item())}, got {n.item():g}"))
    return n.clamp_min(1.0)


def _f32(x: Union[float, torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------------------------------
# Log-probs and entropy from logits (checked entry points; the chunked fp32 kernels are in logit_kernels.py)
# ----------------------------------------------------------------------------------------------------------------------


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
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` in one pass over the logits, without grad (the
    experience forwards): ``([...] fp32 log-probs, [...] fp32 entropy)``, bitwise equal to the two separate calls.
    Arguments and checks as in :func:`logprobs_from_logits`."""
    logits, t, chunk_rows = _logits_args(logits, temperature, chunk_rows)
    if logits.requires_grad and torch.is_grad_enabled():
        raise ValueError("logprobs_and_entropy_from_logits has no backward: call it under torch.no_grad(), or use "
                         "logprobs_from_logits and entropy_from_logits")
    flat = _checked_labels(labels, logits, check)
    if flat.numel() == 0:
        zeros = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
        return zeros, zeros.clone()
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


# ----------------------------------------------------------------------------------------------------------------------
# Masked whitening
# ----------------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------------
# KL, rewards, GAE
# ----------------------------------------------------------------------------------------------------------------------


def _kl(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    log_ratio = lp - ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(-log_ratio) + log_ratio  # k3: exp(ref - lp) - 1 - (ref - lp)


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


def compute_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, scores: torch.Tensor,
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
        ref_logprobs: ``[B, R]`` reference log-probs.
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
    ref = _tensor("ref_logprobs", ref_logprobs, shape=lp.shape, shape_of="logprobs")
    placed = isinstance(scores, torch.Tensor) and scores.dim() == 2
    sc = _tensor("scores", scores, shape=lp.shape if placed else lp.shape[:1],
                 shape_of="logprobs" if placed else "logprobs[:, 0]")
    beta = _number("kl_coef", kl_coef, ge=0.0)
    clip = _number("reward_clip", reward_clip, ge=0.0)
    checks: List[_Check] = []
    m = _mask("action_mask", action_mask, lp.shape, "logprobs", checks)
    bad_scores = ~torch.isfinite(sc)
    checks.append((bad_scores.any(), lambda: f"scores: expected finite values, got non-finite scores in rows "
                                             f"{bad_scores.nonzero().flatten().tolist()}"))
    _raise_first(checks)
    with torch.no_grad():
        # Select before the estimator so junk at padding cannot overflow (k3 exponentiates); log r = 0 there.
        kl = torch.where(m, _kl(torch.where(m, lp, 0.0), torch.where(m, ref, 0.0), est), 0.0)
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


# ----------------------------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------------------------


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
        0-dim fp32 counts.
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
    stats = {"capped": zero, "masked": zero, "masked_seqs": zero}
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
    return weights, keep.to(action_mask.dtype), stats


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                action_mask: torch.Tensor, clip_eps: float, dual_clip: Optional[float] = None,
                num_tokens: Optional[Union[int, float, torch.Tensor]] = None, *, check: bool = True,
                clip_eps_high: Optional[float] = None, token_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (optionally dual-clipped, optionally clip-higher), token-level terms.

    ``ratio = exp(logprobs - old_logprobs)`` (log-ratio set to 0 at padding first: ratio 1, no overflow);
    per token ``max(-A * ratio, -A * clamp(ratio, 1 - eps, 1 + eps_high))`` (``eps_high = clip_eps_high``, default
    ``clip_eps``: DAPO's clip-higher when larger); with ``dual_clip = c`` tokens with ``A < 0`` take
    ``min(that, -c * A)``. ``loss = sum over real tokens / num_tokens`` (see the module docstring), or with
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


# ----------------------------------------------------------------------------------------------------------------------
# KL controllers
# ----------------------------------------------------------------------------------------------------------------------


class FixedKLController:
    """Constant KL coefficient. ``value`` is the coefficient; ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = _number("kl_coef", kl_coef, ge=0.0)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for interface parity with :class:`AdaptiveKLController`)."""

    def state_dict(self) -> Dict[str, float]:
        """``{"value": float}``."""
        return {"value": self.value}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Restore ``value`` from :meth:`state_dict`'s output."""
        if not isinstance(state, dict) or "value" not in state:
            raise ValueError(f"state: expected a dict with key 'value', got {state!r}")
        self.value = _number("state['value']", state["value"], ge=0.0)


class AdaptiveKLController(FixedKLController):
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences").

    ``update(current_kl, n_steps)``: ``e = clip(current_kl / target - 1, -0.2, 0.2)``;
    ``value *= 1 + e * n_steps / horizon``. The coefficient grows when the measured KL exceeds ``target`` and shrinks
    below it. ``current_kl`` must use the same units as ``target`` (e.g. per-sequence KL summed over tokens, averaged
    over the batch); ``n_steps`` is the number of samples since the last update.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        super().__init__(init_kl_coef)
        self.target = _number("target", target, gt=0.0)
        self.horizon = _number("horizon", horizon, gt=0.0)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards keeping ``current_kl`` (python number or 1-element tensor) at ``target``."""
        kl = _number("current_kl", current_kl)
        if math.isinf(kl):
            raise ValueError(f"current_kl: expected a finite number, got {kl}")
        steps = _number("n_steps", n_steps, ge=0.0)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * steps / self.horizon

    def state_dict(self) -> Dict[str, float]:
        """``{"value", "target", "horizon"}``; ``load_state_dict`` restores ``value`` only (target and horizon come
        from the current configuration)."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}
