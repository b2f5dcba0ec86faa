"""Programmatic rewards: `--reward_fn module:function` or `--reward_url URL` replace the reward model.

A reward function takes `(prompts: list[str], responses: list[str])`, plus any data columns it declares as further
parameters (loader.py: the calling rule), and returns one float per sample. `math_answer.py`: verifiable answer
checkers; `workers.py`: a reward function in worker processes with timeouts (`--reward_workers`); `remote.py`: a
reward server as a reward function (`--reward_url`), and `serve.py` the reference server.
"""
from .loader import (RewardFunctionError, RewardSignature, call_reward_fn, load_reward_fn, reward_fn_name,
                     reward_signature)
from .remote import RemoteReward
from .workers import ParallelReward

__all__ = ["ParallelReward", "RemoteReward", "RewardFunctionError", "RewardSignature", "call_reward_fn",
           "load_reward_fn", "reward_fn_name", "reward_signature"]
