"""Typed configuration: one dataclass per section, help text on every field, `validate()` collecting every error.

A field's name is its flag and its config-file key (`flat.py`): a section's fields are flat flags (`--output_dir`
sets `cfg.run.output_dir`), a role's are prefixed with the role (`--actor_learning_rate` sets
`TrainConfig.actor.learning_rate`). The sections import the standard library and `errors` only; the names the
registries accept (estimators, KL estimators, policy losses) are read from their modules, which import torch, when a
config is validated.

    fields.py      opt (a field with its help), the shared checks, DTYPES / ROLES
    role.py        RoleConfig: one model (actor, critic, reference, reward; the model of steps 1 and 2)
    ppo.py         PPOConfig and each estimator family's defaults
    generation.py  GenerationConfig (sampling), BatchConfig (the batch arithmetic of an iteration)
    data.py        DataConfig: prompts or training rows, blends, templates
    env.py         EnvConfig: multi-turn environments
    engine.py      EngineConfig: LoRA reference, EMA, ZeRO-3 generation, backend, packing
    scoring.py     ScoringConfig: a reward function or server in place of the reward model
    ptx.py         PtxConfig: PPO-ptx's unsupervised text and weight
    run.py         RunConfig (run directory, checkpoints, resume, timeouts, signals) and LoggingConfig, shared by
                   every step
    train.py       TrainConfig: a PPO run
    supervised.py  SupervisedConfig, SFTConfig, RewardTrainConfig: steps 1 and 2
    flat.py        flat_fields / flat_dict: the config as flags and config-file keys
"""
from .data import BAD_ROW_POLICIES, LONG_PROMPT_POLICIES, DataConfig, parse_data_sources
from .engine import GATHER_ONCE_MODES, EngineConfig
from .env import ENV_ERRORS, EnvConfig
from .fields import DTYPES, ROLES, SCHEDULERS, TRAINED_ROLES, opt
from .flat import flat_dict, flat_fields
from .generation import BatchConfig, GenerationConfig
from .ppo import ESTIMATOR_DEFAULTS, GROUP_KL_IN_LOSS, PPOConfig, apply_estimator_defaults
from .ptx import PtxConfig
from .role import RoleConfig
from .rollout import RolloutConfig
from .run import PREEMPT_SIGNALS, LoggingConfig, RunConfig
from .scoring import ScoringConfig
from .supervised import LONG_RESPONSE_POLICIES, RewardTrainConfig, SFTConfig, SupervisedConfig
from .train import TrainConfig

__all__ = ["BAD_ROW_POLICIES", "DTYPES", "ENV_ERRORS", "ESTIMATOR_DEFAULTS", "GATHER_ONCE_MODES", "GROUP_KL_IN_LOSS",
           "LONG_PROMPT_POLICIES", "LONG_RESPONSE_POLICIES", "PREEMPT_SIGNALS", "ROLES", "SCHEDULERS", "TRAINED_ROLES",
           "BatchConfig", "DataConfig", "EngineConfig", "EnvConfig", "GenerationConfig", "LoggingConfig", "PPOConfig",
           "PtxConfig", "RewardTrainConfig", "RoleConfig", "RolloutConfig", "RunConfig", "ScoringConfig", "SFTConfig", "SupervisedConfig",
           "TrainConfig", "apply_estimator_defaults", "flat_dict", "flat_fields", "opt", "parse_data_sources"]
