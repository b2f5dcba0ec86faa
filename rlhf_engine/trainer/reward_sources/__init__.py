"""Reward sources: what scores a run's rollouts, one class per kind (rlhf_engine/config/reward_source.py holds the
registry and the choice from the config). A source is loaded once by the plan (`load`: a user's code is imported
and checked before any weight), built once by the trainer's setup, and called as `source(prompt_ids, rollout) ->
[B] scores` by the experience step and the evaluation; neither chooses one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config.reward_source import SourceKind
from .base import RewardFnSource, RewardSource
from .environment import EnvironmentReturns
from .function import FunctionSource
from .model import RewardModelSource
from .server import ServerSource
from .workers import WorkerSource

# kind name (config/reward_source.REWARD_SOURCES) -> its class; the same keys there and here (a test checks)
SOURCE_CLASSES = {"environment": EnvironmentReturns, "server": ServerSource, "workers": WorkerSource,
                  "function": FunctionSource, "reward_model": RewardModelSource}


@dataclass(frozen=True)
class LoadedSource:
    """The plan's part: the kind and what `load` gave (a reward function, a server client, ...; None for some)."""

    kind: SourceKind
    loaded: Any


def source_class(kind: SourceKind) -> type:
    return SOURCE_CLASSES[kind.name]


def build_reward_source(loaded: LoadedSource, engine: Any, cfg: Any) -> RewardSource:
    return source_class(loaded.kind)(loaded.loaded, engine, cfg)


__all__ = ["LoadedSource", "RewardFnSource", "RewardSource", "SOURCE_CLASSES", "build_reward_source", "source_class"]
