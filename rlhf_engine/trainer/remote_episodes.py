"""Episodes played on rollout workers (`--environment` with `--rollout_workers N`): each batch goes to a worker with
its data rows and the worker plays its episodes there (workers/rollout_worker.py; docs/async-rollouts.md says why)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..envs import EnvironmentFailure


def environment_failure(message: Optional[str]) -> Optional[EnvironmentFailure]:
    """A worker's report of the environment failure that ended a batch, as the trainer's ranks raise it."""
    return EnvironmentFailure(message) if message is not None else None


class RemoteEpisodes:
    """The trainer's episode runner with rollout workers: `run` answers as envs.EpisodeRunner.run does, the
    episodes played on a worker with the current weights (max_staleness 0; ahead of training: trainer/ahead.py)."""

    def __init__(self, backend: Any, params: Any):
        self.backend, self.params = backend, params

    def run(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list) -> tuple:
        gen = self.backend.generate(prompt_ids, prompt_mask, self.params, rows=list(rows))
        return gen.rollout, gen.logprobs, gen.episode_stats, environment_failure(gen.failure)
