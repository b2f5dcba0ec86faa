"""What every reward source is."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...rollout import Rollout


class RewardSource:
    """`score(rollout) -> [B]` scores of a rollout batch (checked by experience.score_rollout); callable as a
    RewardFn, `source(prompt_ids, rollout)`. `source_name` is how errors name it."""

    source_name = ""

    @classmethod
    def load(cls, cfg: Any) -> Any:
        """Plan time, before any weight: import and check what the source needs (ValueError: what is wrong)."""
        return None

    @classmethod
    def columns(cls, loaded: Any) -> Optional[Any]:
        """The data columns (a data.ColumnRequest) the rows must keep for scoring; None: none."""
        return None

    def __init__(self, loaded: Any, engine: Any, cfg: Any):
        self.loaded = loaded

    def score(self, rollout: Rollout) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, prompt_ids: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        return self.score(rollout)

    def take_counts(self) -> dict:
        """Counters since the last take (metrics reward/<name>); {} for most sources."""
        return {}

    def close(self) -> None:
        pass


class RewardFnSource(RewardSource):
    """A RewardFn, `fn(prompt_ids, rollout) -> [B]`, as a source (programmatic runs, tests)."""

    def __init__(self, fn, name: str = ""):
        super().__init__(None, None, None)
        self.fn, self.source_name = fn, name or getattr(fn, "source_name", "")

    def score(self, rollout: Rollout) -> torch.Tensor:
        return self.fn(rollout.prompts, rollout)
