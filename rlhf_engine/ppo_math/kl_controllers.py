"""The KL coefficient of the rewards: constant (:class:`FixedKLController`) or adapted towards a target KL
(:class:`AdaptiveKLController`, Ziegler et al. 2019), with state dicts for checkpoints.
"""
from __future__ import annotations

import math
from typing import Dict

from .checks import _number


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
