"""`--reward_url`: each rank POSTs its batch, with the rollout's ids (rlhf_engine/rewards/remote.py)."""
from __future__ import annotations

from typing import Any

from .function import FunctionSource


class ServerSource(FunctionSource):
    @classmethod
    def load(cls, cfg: Any) -> Any:
        from ...rewards import RemoteReward

        sc = cfg.scoring
        return RemoteReward(sc.reward_url, sc.reward_timeout_s, sc.reward_retries,
                            auth_token_env=sc.reward_auth_token_env)
