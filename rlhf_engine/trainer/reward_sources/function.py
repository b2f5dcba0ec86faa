"""`--reward_fn module:function` in the trainer's process: the text of each response, the data columns it asks
for (the calling rule, rlhf_engine/rewards/loader.py)."""
from __future__ import annotations

from typing import Any

from ...rollout import Rollout
from ..experience import text_reward
from .base import RewardSource


class FunctionSource(RewardSource):
    @classmethod
    def load(cls, cfg: Any) -> Any:
        from ...rewards import load_reward_fn

        return load_reward_fn(cfg.scoring.reward_fn)

    @classmethod
    def columns(cls, loaded: Any):
        """The data columns the function declares (the calling rule); None for a plain one."""
        from ...data.columns import ColumnRequest
        from ...rewards import reward_signature

        sig = reward_signature(loaded)
        return None if sig.legacy else ColumnRequest(sig.required, sig.optional, sig.all_columns, field="reward_fn")

    def __init__(self, loaded, engine, cfg):
        super().__init__(loaded, engine, cfg)
        self.fn = text_reward(loaded, engine.tokenizer)
        self.source_name = self.fn.source_name

    def score(self, rollout: Rollout):
        return self.fn(rollout.prompts, rollout)
