"""Programmatic rewards: `--reward_fn module:function` replaces the reward model.

A reward function takes `(prompts: list[str], responses: list[str])`, plus any data columns it declares as further
parameters (loader.py: the calling rule), and returns one float per sample. `math.py`: a verifiable answer checker.
"""
from .loader import (RewardFunctionError, RewardSignature, call_reward_fn, load_reward_fn, reward_fn_name,
                     reward_signature)

__all__ = ["RewardFunctionError", "RewardSignature", "call_reward_fn", "load_reward_fn", "reward_fn_name",
           "reward_signature"]
