"""Advantage estimators: a registry of pure functions, picked by name (`--advantage_estimator`).

Every estimator takes the same keyword arguments and returns `(advantages [B, R], returns [B, R] or None)`:

    rewards      [B, R] fp32  per-token rewards (KL penalty on every action, clipped score on the last real one)
    action_mask  [B, R]       1 on real response tokens
    values       [B, R] fp32  rollout-time critic values, or None in a run without a critic
    scores       [B]    fp32  the shaped sequence scores that entered the rewards
    gamma, lam   float        discount and GAE lambda

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
