"""Reward sources: what scores a run's rollouts, one class per kind (rlhf_engine/config/reward_source.py holds the
registry and the choice from the config). A source is loaded once by the plan (`load`: a user's code is imported
and checked before any weight), built once by the trainer's setup, and called as `source(prompt_ids, rollout) ->
[B] scores` by the experience step and the evaluation; neither chooses one.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ...config.reward_source import SourceKind
from .base import RewardFnSource, RewardSource


@dataclass(frozen=True)
class LoadedSource:
    """The plan's part: the kind and what `load` gave (a reward function, a server client, ...; None for some)."""

    kind: SourceKind
    loaded: Any


def source_class(kind: SourceKind) -> type:
    module, name = kind.impl.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def build_reward_source(loaded: LoadedSource, engine: Any, cfg: Any) -> RewardSource:
    return source_class(loaded.kind)(loaded.loaded, engine, cfg)


__all__ = ["LoadedSource", "RewardFnSource", "RewardSource", "build_reward_source", "source_class"]
