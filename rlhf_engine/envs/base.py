"""What an environment is, and how one is named on the command line."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from ..plugins import load_callable


class Step(NamedTuple):
    """An environment's answer to one model turn."""

    observation: Optional[str] = None  # the next user message (None or '' with done: nothing more to say)
    reward: float = 0.0  # the reward of this turn, placed on its last model-written token
    done: bool = False  # the episode ends after this turn


class EnvironmentFailure(RuntimeError):
    """An environment call raised, timed out or answered with something that is not a Step."""


def load_environment_factory(spec: str) -> Callable[[dict], Any]:
    """'package.module:factory' -> the factory. Raises ValueError naming the spec and the fix."""
    return load_callable(spec, "environment", "rlhf_engine.envs.calculator:make_env", what="factory")


def as_step(answer: Any) -> Step:
    """A step() answer as a Step: a Step, or a (observation, reward, done) triple; anything else is refused."""
    if isinstance(answer, Step):
        step = answer
    elif isinstance(answer, tuple) and len(answer) == 3:
        step = Step(*answer)
    else:
        raise EnvironmentFailure(f"step() returned {type(answer).__name__}; expected Step(observation, reward, done)")
    if step.observation is not None and not isinstance(step.observation, str):
        raise EnvironmentFailure(f"step() observation is {type(step.observation).__name__}; expected str or None")
    try:
        reward = float(step.reward)
    except (TypeError, ValueError):
        raise EnvironmentFailure(f"step() reward {step.reward!r} is not a number") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise EnvironmentFailure(f"step() reward {reward} is not finite")
    return Step(step.observation, reward, bool(step.done))
