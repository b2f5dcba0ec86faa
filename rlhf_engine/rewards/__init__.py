"""Programmatic rewards: `--reward_fn module:function` replaces the reward model.

A reward function takes `(prompts: list[str], responses: list[str])` and returns one float per sample.
"""
from .loader import RewardFunctionError, call_reward_fn, load_reward_fn

__all__ = ["RewardFunctionError", "call_reward_fn", "load_reward_fn"]
