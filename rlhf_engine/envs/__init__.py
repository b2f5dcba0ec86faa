"""Multi-turn rollouts: environments that answer the model's turns (docs/environments.md).

    factory = load_environment_factory("my_pkg.envs:make")     # --environment
    env = factory(row)                                          # row: the data row's columns and its 'prompt'
    env.reset() -> Optional[str]                                # the first user message (None: the row's prompt)
    env.step(response: str) -> Step(observation, reward, done)

`EpisodeRunner` plays a batch of episodes with the run's generation backend, token in, token out: the model's
sampled ids are kept as sampled, each observation is tokenised once (inside the chat template's turn wrapping where
the prompts use it) and appended as context. The result is the canonical layout (rollout.py) with holes in the
action mask and each turn's reward on its last action.
"""
from .base import EnvironmentFailure, Step, load_environment_factory
from .episodes import EpisodeRunner, EpisodeStats
from .turns import TurnFormat, cut_at_stop_strings

__all__ = ["EnvironmentFailure", "Step", "load_environment_factory", "EpisodeRunner", "EpisodeStats", "TurnFormat",
           "cut_at_stop_strings"]
