"""Advantage estimators: a registry of pure functions, picked by name (`--advantage_estimator`).

Every estimator takes the same keyword arguments and returns `(advantages [B, R], returns [B, R] or None)`:

    rewards      [B, R] fp32  per-token rewards (KL penalty on every action, clipped score on the last real one)
    action_mask  [B, R]       1 on real response tokens
    values       [B, R] fp32  rollout-time critic values, or None in a run without a critic
    scores       [B]    fp32  the shaped sequence scores that entered the rewards
    group_ids    [B]    long  the prompt of each response (the N samples of a prompt share it; contiguous, one rank)
    gamma, lam   float        discount and GAE lambda
    moments      callable     (x [B, R], mask) -> (mean, var) of x's real tokens over EVERY rank (a collective; None:
                              local statistics), for the estimators that whiten

`needs_critic` says whether the run builds a critic for it (its values go in, its returns are the critic's targets).
Adding an estimator is one function here with `@register(name, needs_critic=...)`: the config accepts the name,
`trainer/experience.build_experience` calls it, and without a critic the run builds no critic engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .ppo_math import compute_gae

EstimatorFn = Callable[..., "tuple[torch.Tensor, Optional[torch.Tensor]]"]


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: EstimatorFn
    needs_critic: bool


ESTIMATORS: dict[str, Estimator] = {}


def register(name: str, needs_critic: bool) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: add `fn` to the registry under `name` (a second registration of a name is an error)."""
    def deco(fn: EstimatorFn) -> EstimatorFn:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ESTIMATORS[name] = Estimator(name, fn, needs_critic)
        return fn

    return deco


def get(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


@register("gae", needs_critic=True)
def gae(*, rewards: torch.Tensor, action_mask: torch.Tensor, values: Optional[torch.Tensor], gamma: float,
        lam: float, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over the critic's values: `ppo_math.compute_gae`."""
    return compute_gae(rewards=rewards, values=values, action_mask=action_mask, gamma=gamma, lam=lam)


# ---- critic-free estimators -----------------------------------------------------------------------------------------
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
WHITEN_EPS = 1e-8


def masked_whiten_tokens(x: torch.Tensor, action_mask: torch.Tensor, mean: Optional[torch.Tensor] = None,
                         var: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + 1e-8)`` over real tokens (0 on padding). x, action_mask ``[B, R]``. ``mean``/``var``:
    statistics of every rank (the trainer passes global ones); omitted, the masked mean and unbiased variance of
    ``x`` on this rank."""
    from .ppo_math import masked_whiten

    return masked_whiten(x, action_mask, eps=WHITEN_EPS, mean=mean, var=var)


def group_advantages(scores: torch.Tensor, group_ids: torch.Tensor, action_mask: torch.Tensor, estimator: str,
                     eps: float = 1e-6, mean: Optional[torch.Tensor] = None,
                     var: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Group-baseline advantages of N responses per prompt, every token of a response getting its sequence's value.

    Args:
        scores: ``[B]`` each response's return (the trainer passes the sum of its per-token rewards: shaped score
            minus kl_coef x its summed KL).
        group_ids: ``[B]`` long, equal for the responses of one prompt (groups need not be sorted).
        action_mask: ``[B, R]`` 0/1.
        estimator: ``grpo`` = (s - group mean) / (group std + eps), std unbiased (n - 1), as TRL and verl;
            ``dr_grpo`` = s - group mean (Dr. GRPO: no std division); ``rloo`` = s - mean of the OTHER responses of
            the group (leave-one-out); ``reinforce_pp_baseline`` = s - group mean, then token-level masked whitening
            over the batch (``mean``/``var``: global statistics of those token values, else local).
        eps: added to the group std (grpo).

    Returns:
        ``[B, R]`` fp32 advantages, 0 on padding. A group whose scores are all equal gets 0 (grpo: 0 / eps).
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"estimator: expected one of {', '.join(GROUP_ESTIMATORS)}, got {estimator!r}")
    s = scores.float()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError("group_advantages: every group needs at least 2 responses (n_samples_per_prompt >= 2)")
    n = counts.float()[inverse]  # [B] the size of each response's group
    total = torch.zeros(counts.shape[0], device=s.device).index_add_(0, inverse, s)[inverse]
    group_mean = total / n
    if estimator == "grpo":
        sq = torch.zeros(counts.shape[0], device=s.device).index_add_(0, inverse, (s - group_mean) ** 2)[inverse]
        seq = (s - group_mean) / ((sq / (n - 1)).sqrt() + eps)
    elif estimator == "rloo":
        seq = s - (total - s) / (n - 1)
    else:  # dr_grpo, reinforce_pp_baseline
        seq = s - group_mean
    adv = seq[:, None] * action_mask.float()
    if estimator == "reinforce_pp_baseline":
        return masked_whiten_tokens(adv, action_mask, mean=mean, var=var)
    return adv


def reinforce_pp_advantages(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float,
                            mean: Optional[torch.Tensor] = None,
                            var: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted per-token returns of the per-token rewards, token-level masked whitening.

    Args:
        rewards: ``[B, R]`` per-token rewards (KL penalty on every action, clipped score on the last real one).
        action_mask: ``[B, R]`` 0/1 (holes between an episode's turns allowed).
        gamma: discount in [0, 1].
        mean, var: global statistics of the returns over real tokens (else local).

    Returns:
        ``(advantages [B, R], returns [B, R])`` fp32: ``returns_t = sum_k gamma^k rewards`` over the actions from
        ``t`` on (k counts actions: context tokens between turns are skipped); advantages are the whitened returns;
        both 0 off actions.
    """
    m = action_mask.float()
    r = rewards.float() * m
    returns = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        # padding and context tokens (m = 0) pass the running return through unchanged
        running = torch.where(m[:, t] > 0, r[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = returns * m
    return masked_whiten_tokens(returns, action_mask, mean=mean, var=var), returns


# ---- the registry entries of the critic-free estimators: what the trainer calls -----------------------------------
def _global(moments, x: torch.Tensor, mask: torch.Tensor):
    """(mean, var) of x's real tokens over every rank (`moments`, the trainer's collective), or (None, None)."""
    return moments(x, mask) if moments is not None else (None, None)


def _group(name: str):
    def fn(*, rewards: torch.Tensor, action_mask: torch.Tensor, group_ids: torch.Tensor, moments=None,
           **_: object) -> tuple[torch.Tensor, None]:
        returns = (rewards.float() * action_mask.float()).sum(-1)  # shaped score - kl_coef x summed KL, as verl
        mean = var = None
        if name == "reinforce_pp_baseline":  # the whitening statistics of every rank's centred token values
            mean, var = _global(moments, group_advantages(returns, group_ids, action_mask, "dr_grpo"), action_mask)
        return group_advantages(returns, group_ids, action_mask, name, mean=mean, var=var), None

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"`group_advantages(..., {name!r})` of each response's summed per-token rewards."
    return fn


for _name in GROUP_ESTIMATORS:
    register(_name, needs_critic=False)(_group(_name))


@register("reinforce_pp", needs_critic=False)
def reinforce_pp(*, rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float, moments=None,
                 **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """`reinforce_pp_advantages` with the returns' global whitening statistics."""
    _, returns = reinforce_pp_advantages(rewards, action_mask, gamma)
    mean, var = _global(moments, returns, action_mask)
    return reinforce_pp_advantages(rewards, action_mask, gamma, mean=mean, var=var)


def uniform_groups(returns: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] bool: the response belongs to a group whose returns [B] are all equal (no signal to learn from)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    g = counts.shape[0]
    r = returns.float()
    hi = torch.full((g,), -torch.inf, device=r.device).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full((g,), torch.inf, device=r.device).scatter_reduce(0, inverse, r, "amin")
    return (hi == lo)[inverse]
