"""Load `module:function` reward functions, read which data columns they ask for, and call them with checks that
name the function on every failure.

The calling rule (docs/rewards.md):
  - `fn(prompts, responses)`: two positional parameters and nothing else. It is called exactly as before: prompts
    decoded without special tokens, no columns.
  - `fn(prompts, responses, answer, difficulty=None)`: every further parameter names a column of the data row. A
    parameter without a default is a required column (missing from the data: a start-up error naming it); one with
    a default is passed when every data source has that column, else its default applies.
  - `fn(prompts, responses, **kwargs)`: every column the data sources share (besides the prompt column).
Such functions receive the prompts as the model saw them: templates applied, special tokens kept. Columns arrive as
keyword lists aligned with `responses` (a prompt's N samples each get its row's values).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from ..plugins import load_callable

RewardFn = Callable[..., Sequence[float]]


class RewardFunctionError(RuntimeError):
    """The reward function raised, returned the wrong number of values, or a non-finite value."""


@dataclass(frozen=True)
class RewardSignature:
    """What a reward function asks for besides (prompts, responses): see the module docstring."""

    required: tuple[str, ...] = ()  # columns it cannot do without
    optional: tuple[str, ...] = ()  # columns it takes when the data has them (parameters with defaults)
    all_columns: bool = False  # it takes **kwargs: every shared column

    @property
    def legacy(self) -> bool:
        """A plain `fn(prompts, responses)`: called exactly as before the calling rule (no columns, prompts decoded
        without special tokens)."""
        return not (self.required or self.optional or self.all_columns)


def reward_signature(fn: Callable) -> RewardSignature:
    """Read the calling rule off `fn`'s parameters. Raises ValueError when it cannot take (prompts, responses)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: assume the plain two-argument form
        return RewardSignature()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ValueError(f"takes {len(positional)} positional parameter(s); a reward function takes (prompts, "
                         "responses, [data columns...])")
    rest = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    bad = [p.name for p in params[2:] if p.kind == p.POSITIONAL_ONLY]
    if bad:
        raise ValueError(f"parameters {bad} are positional-only; data columns are passed by name")
    return RewardSignature(required=tuple(p.name for p in rest if p.default is p.empty),
                           optional=tuple(p.name for p in rest if p.default is not p.empty),
                           all_columns=any(p.kind == p.VAR_KEYWORD for p in params))


def load_reward_fn(spec: str) -> RewardFn:
    """'package.module:function' -> the function. Raises ValueError naming the spec and the fix."""
    fn = load_callable(spec, "reward_fn", "rlhf_engine.rewards.sentiment:vader_positive")
    try:
        reward_signature(fn)
    except ValueError as e:
        raise ValueError(f"reward_fn = {spec!r}: {e}") from e
    try:
        fn.__rlhf_spec__ = spec  # for error messages
    except AttributeError:  # a builtin or a bound method: error messages fall back to its name
        pass
    return fn


def reward_fn_name(fn: Callable) -> str:
    return getattr(fn, "__rlhf_spec__", getattr(fn, "__qualname__", repr(fn)))


def call_reward_fn(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                   columns: Optional[Mapping[str, Sequence[Any]]] = None) -> list[float]:
    """Call `fn(prompts, responses, **columns)` and check its answer: one finite float per sample."""
    name = reward_fn_name(fn)
    columns = {k: list(v) for k, v in (columns or {}).items()}
    try:
        out = fn(list(prompts), list(responses), **columns)
    except RewardFunctionError:  # a reward server or the worker pool: it names itself and the fix already
        raise
    except Exception as e:  # noqa: BLE001
        called = "fn(prompts, responses" + "".join(f", {c}=[...]" for c in columns) + ")"
        raise RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e} (on a batch of "
                                  f"{len(responses)} responses); fix the function: it is called as {called}, lists "
                                  "of one entry per response, and returns one float per response") from e
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
