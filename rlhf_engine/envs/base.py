"""What an environment is, and how one is named on the command line."""
from __future__ import annotations

import importlib
from typing import Any, Callable, NamedTuple, Optional


class Step(NamedTuple):
    """An environment's answer to one model turn."""

    observation: Optional[str] = None  # the next user message (None or '' with done: nothing more to say)
    reward: float = 0.0  # the reward of this turn, placed on its last model-written token
    done: bool = False  # the episode ends after this turn


class EnvironmentFailure(RuntimeError):
    """An environment call raised, timed out or answered with something that is not a Step."""


def load_environment_factory(spec: str) -> Callable[[dict], Any]:
    """'package.module:factory' -> the factory. Raises ValueError naming the spec and the fix."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"environment = {spec!r}: expected 'module:factory', e.g. "
                         "'rlhf_engine.envs.calculator:make_env'")
    module_name, name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (any import failure is the user's to fix)
        raise ValueError(f"environment = {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); make it "
                         "importable (PYTHONPATH) or fix the module name") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"environment = {spec!r}: {module_name} has no callable {name!r}")
    return factory


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
