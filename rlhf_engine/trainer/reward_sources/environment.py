"""`--environment`: an episode's score is the sum of its turns' rewards (they also enter the per-token rewards
where they sit, on each turn's last action: experience.build_experience)."""
from __future__ import annotations

from typing import Any

from ...rollout import Rollout
from .base import RewardSource


class EnvironmentReturns(RewardSource):
    source_name = "environment"

    @classmethod
    def columns(cls, loaded: Any):
        from ...data.columns import ColumnRequest

        return ColumnRequest(all_columns=True, field="environment")  # the factory gets every column

    def score(self, rollout: Rollout):
        return rollout.turn_rewards.sum(-1)
