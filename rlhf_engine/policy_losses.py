"""Policy losses: a registry of pure functions, picked by name (`--policy_loss`), as `estimators.py` holds the
advantage estimators.

Every policy loss takes the arguments of `ppo_math.policy_loss` and returns `(loss [], stats)`:

    logprobs       [B, R] fp32  the actor's log-probs of the sampled tokens (with grad)
    old_logprobs   [B, R] fp32  the experience's (detached)
    advantages     [B, R] fp32  (detached; already weighted by the rollout correction)
    action_mask    [B, R]       1 on the tokens the loss trains
    clip_eps, clip_eps_high     the lower / upper clip (clip_eps_high None = clip_eps)
    dual_clip                   ppo_clip only (None elsewhere; the config refuses it with another loss)
    num_tokens                  the global token count of the mini-batch (token_mean)
    token_weights  [B, R]       the other aggregation modes' weights (`ppo_math.loss_token_weights`), or None
    check                       run the data-dependent checks

stats: approx_kl, clipfrac, ratio_mean, ratio_max, ratio_min, tokens (detached 0-dim fp32). Adding a loss is one
function with `@register_policy_loss(name)` here (or in `ppo_math` with a line below): the config accepts the name
and the actor objective (trainer/objectives.py) calls it.
"""
from __future__ import annotations

from typing import Callable

from .ppo_math import cispo_loss, gspo_loss, policy_loss

PolicyLossFn = Callable[..., tuple]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: add `fn` to the registry under `name` (a second registration of a name is an error)."""
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


register_policy_loss("ppo_clip")(policy_loss)  # PPO's clipped surrogate (dual clip, clip-higher)
register_policy_loss("gspo")(gspo_loss)  # the length-normalised sequence ratio, clipped per response
register_policy_loss("cispo")(cispo_loss)  # a clipped, detached IS weight times the log-prob
