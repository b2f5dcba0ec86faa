"""The reward model (the default): the reward engine's score at each sequence's last real token, through the reward
model's own tokenizer when it has one (trainer/reward_shaping.py: RetokenizedRewardModel)."""
from __future__ import annotations

from ...rollout import Rollout
from ..reward_shaping import reward_model_scorer
from .base import RewardSource


class RewardModelSource(RewardSource):
    source_name = "reward model"

    def __init__(self, loaded, engine, cfg):
        super().__init__(loaded, engine, cfg)
        self.engine = engine
        self.retokenized = reward_model_scorer(engine, cfg)  # None: the actor's ids are the reward model's
        if self.retokenized is not None:
            self.source_name = self.retokenized.source_name

    def score(self, rollout: Rollout):
        if self.retokenized is not None:
            return self.retokenized(rollout.prompts, rollout)
        return self.engine.reward_scores(rollout)
