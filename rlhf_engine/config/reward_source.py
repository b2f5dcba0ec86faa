"""Which source scores a run's rollouts: the registry of reward-source kinds, and the choice from the config.

Each kind names the flags that choose it; the run's source is the one kind whose flags are set, or the reward model
when none is. Two kinds chosen at once is one problem naming exactly the flags that were set. The implementations
(built once per run from the plan, each `score(rollout) -> [B] scores`) live in rlhf_engine/trainer/reward_sources/,
one file per kind, and its registry there maps each kind's name to its class (a test holds the two key sets equal):
a new kind is that file, one line in `REWARD_SOURCES` below and one in `trainer.reward_sources.SOURCE_CLASSES`. This
layer names kinds only; pure attribute reads of a TrainConfig: the config's validation asks, and the trainer builds
what the choice names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class SourceKind:
    name: str
    what: str  # how messages and docs name it
    chosen_by: Callable[[Any], dict]  # a TrainConfig -> the flags choosing this kind that are set ({}: not chosen)


def _set(**flags: Any) -> dict:
    return {k: v for k, v in flags.items() if v}


def _function(cfg: Any) -> dict:
    sc = cfg.scoring
    return _set(reward_fn=sc.reward_fn) if not sc.reward_workers else {}


def _workers(cfg: Any) -> dict:
    sc = cfg.scoring
    return _set(reward_fn=sc.reward_fn, reward_workers=sc.reward_workers) if sc.reward_fn and sc.reward_workers else {}


DEFAULT = "reward_model"
REWARD_SOURCES = {k.name: k for k in (
    SourceKind("environment", "the environment's step rewards", lambda c: _set(environment=c.env.environment)),
    SourceKind("server", "a reward server", lambda c: _set(reward_url=c.scoring.reward_url)),
    SourceKind("workers", "a reward function in worker processes", _workers),
    SourceKind("function", "a reward function", _function),
    SourceKind(DEFAULT, "the reward model", lambda c: {}),
)}


def chosen_sources(cfg: Any) -> list:
    """[(SourceKind, the flags set that choose it)] of every kind the config chooses (the default not counted)."""
    return [(k, flags) for k in REWARD_SOURCES.values() if (flags := k.chosen_by(cfg))]


def reward_source_kind(cfg: Any) -> SourceKind:
    """The run's source: the kind its flags choose, else the reward model (a conflict is `check_reward_sources`')."""
    chosen = chosen_sources(cfg)
    return chosen[0][0] if chosen else REWARD_SOURCES[DEFAULT]


def check_reward_sources(cfg: Any, p: Any) -> None:
    """One problem when flags choose more than one source, naming the flags that were set."""
    chosen = chosen_sources(cfg)
    if len(chosen) < 2:
        return
    flags = {k: v for _, f in chosen for k, v in f.items()}
    kinds = " and ".join(k.what for k, _ in chosen)
    p.add(", ".join(flags), tuple(flags.values()), f"both score the rollouts ({kinds}), and one source does: keep "
          "the flags of one")
