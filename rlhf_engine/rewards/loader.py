"""Load `module:function` reward functions and call them with checks that name the function on every failure."""
from __future__ import annotations

import importlib
import math
from typing import Callable, Sequence

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]


class RewardFunctionError(RuntimeError):
    """The reward function raised, returned the wrong number of values, or a non-finite value."""


def load_reward_fn(spec: str) -> RewardFn:
    """'package.module:function' -> the function. Raises ValueError naming the spec and the fix."""
    if spec.count(":") != 1:
        raise ValueError(f"reward_fn = {spec!r}: expected 'module:function', e.g. "
                         "'rlhf_engine.rewards.sentiment:vader_positive'")
    module_name, fn_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (any import failure is the user's to fix)
        raise ValueError(f"reward_fn = {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); "
                         "make it importable (PYTHONPATH) or fix the module name") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward_fn = {spec!r}: {module_name} has no callable {fn_name!r}")
    fn.__rlhf_spec__ = spec  # for error messages
    return fn


def call_reward_fn(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """Call `fn` and check its answer: one finite float per sample."""
    name = getattr(fn, "__rlhf_spec__", getattr(fn, "__qualname__", repr(fn)))
    try:
        out = fn(list(prompts), list(responses))
    except Exception as e:  # noqa: BLE001
        raise RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e} (on a batch of "
                                  f"{len(responses)} responses); fix the function: it is called as fn(prompts, "
                                  "responses), two lists of str, and returns one float per response") from e
    try:
        values = [float(v) for v in out]
    except Exception as e:  # noqa: BLE001
        raise RewardFunctionError(f"reward function {name} must return a sequence of numbers, got "
                                  f"{type(out).__name__}") from e
    if len(values) != len(responses):
        raise RewardFunctionError(f"reward function {name} returned {len(values)} values for {len(responses)} "
                                  "samples; return one float per sample")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardFunctionError(f"reward function {name} returned non-finite values for samples {bad[:10]}")
    return values
