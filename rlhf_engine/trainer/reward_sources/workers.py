"""`--reward_fn` with `--reward_workers N`: one call per response in worker processes, each with a timeout
(rlhf_engine/rewards/workers.py); its timeouts and restarts are counted as reward/worker_* metrics."""
from __future__ import annotations

from typing import Any

from .function import FunctionSource


class WorkerSource(FunctionSource):
    @classmethod
    def load(cls, cfg: Any) -> Any:
        from ...rewards import ParallelReward

        sc = cfg.scoring
        return ParallelReward(sc.reward_fn, sc.reward_workers, sc.reward_timeout_s, sc.on_error_score)

    def take_counts(self) -> dict:
        return self.loaded.take_counts()

    def close(self) -> None:
        self.loaded.close()
