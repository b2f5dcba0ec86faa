"""Typed configuration: one dataclass per concern, help text on every field, `validate()` collecting every error.

Naming: a field's name is its CLI flag and its config-file key. Role fields are prefixed with the role on the command
line (`--actor_learning_rate` sets `TrainConfig.actor.learning_rate`). Imports stdlib only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import Problems

DTYPES = ("fp32", "bf16", "fp16")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
ROLES = ("actor", "critic", "reference", "reward")


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with help text (the CLI and the docs read `metadata['help']`)."""
    if isinstance(default, (list, dict)):  # mutable defaults need a factory
        return field(default_factory=lambda: default.copy(), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _positive(p: Problems, prefix: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        bad = not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or (v < 0 if allow_zero else v <= 0)
        if bad:
            p.add(prefix + n, v, f"must be {'>= 0' if allow_zero else '> 0'}")


def _choice(p: Problems, prefix: str, obj: Any, name: str, choices: tuple) -> None:
    v = getattr(obj, name)
    if v not in choices:
        p.add(prefix + name, v, f"must be one of {', '.join(map(str, choices))}")


@dataclass
class PPOConfig:
    """PPO hyperparameters (the values DeepSpeed-Chat hard-codes are fields here)."""

    ppo_epochs: int = opt(1, "Passes over each rollout buffer per iteration.")
    kl_coef: float = opt(0.1, "Initial coefficient beta of the per-token KL penalty -beta*KL(actor||reference).")
    kl_estimator: str = opt("k1", "Per-token KL estimator in the reward: k1 = log r, k2 = (log r)^2/2, k3 = r-1-log r "
                            "(r = p_ref/p_actor for k3). k1 matches InstructGPT / DeepSpeed-Chat.")
    adaptive_kl: bool = opt(False, "Adapt kl_coef towards kl_target (Ziegler et al. 2019) instead of keeping it fixed.")
    kl_target: float = opt(6.0, "Target per-sequence KL for the adaptive controller (nats).")
    kl_horizon: int = opt(10000, "Horizon (in samples) of the adaptive KL controller.")
    clip_eps: float = opt(0.2, "PPO ratio clip range epsilon: the ratio is clipped to [1-eps, 1+eps].")
    dual_clip: Optional[float] = opt(None, "Dual-clip constant c > 1 (Ye et al. 2020) bounding the loss for negative "
                                     "advantages; None disables it.")
    value_clip: float = opt(0.2, "Critic value clip range: new values are clipped to old +- value_clip.")
    gamma: float = opt(1.0, "Discount factor of GAE.")
    lam: float = opt(0.95, "GAE lambda.")
    reward_clip: float = opt(5.0, "Scores are clamped to [-reward_clip, reward_clip] before they enter the reward.")
    whiten_advantages: bool = opt(True, "Whiten advantages (global masked mean/std across ranks) before the update.")
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient on the actor loss (0 = off).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        _positive(p, prefix, self, "ppo_epochs", "kl_horizon")
        _positive(p, prefix, self, "kl_coef", "kl_target", "clip_eps", "value_clip", "reward_clip", "entropy_coef",
                  allow_zero=True)
        _choice(p, prefix, self, "kl_estimator", KL_ESTIMATORS)
        for n in ("gamma", "lam"):
            v = getattr(self, n)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                p.add(prefix + n, v, "must lie in [0, 1]")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            p.add(prefix + "dual_clip", self.dual_clip, "must be > 1 (or None to disable dual clipping)")


@dataclass
class GenerationConfig:
    """Rollout sampling controls. Explicit values here override the model's own generation_config."""

    max_prompt_seq_len: int = opt(256, "Longest prompt in tokens; longer prompts are rejected by the data layer.")
    max_answer_seq_len: int = opt(256, "Maximum number of generated tokens per response.")
    min_answer_seq_len: int = opt(0, "Minimum number of generated tokens before EOS may be sampled.")
    temperature: float = opt(1.0, "Sampling temperature; the same temperature divides the logits in training.")
    top_p: float = opt(1.0, "Nucleus sampling mass (1.0 = off).")
    top_k: int = opt(0, "Top-k sampling (0 = off).")
    do_sample: bool = opt(True, "Sample (True) or decode greedily (False).")
    stop_token_ids: list = opt([], "Extra token ids that end a response (the tokenizer's EOS always does).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        _positive(p, prefix, self, "max_prompt_seq_len", "max_answer_seq_len", "temperature")
        _positive(p, prefix, self, "min_answer_seq_len", "top_k", allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            p.add(prefix + "top_p", self.top_p, "must lie in (0, 1]")
        if self.min_answer_seq_len > self.max_answer_seq_len:
            p.add(prefix + "min_answer_seq_len", self.min_answer_seq_len,
                  f"must be <= max_answer_seq_len ({self.max_answer_seq_len})")


@dataclass
class BatchConfig:
    """Batch arithmetic of one iteration (per rank unless said otherwise)."""

    per_device_generation_batch_size: int = opt(4, "Prompts each rank generates for in one generate() call.")
    generation_batches: int = opt(1, "Rollout batches buffered per iteration before training on them.")
    per_device_training_batch_size: int = opt(4, "Micro-batch size of each actor/critic forward/backward.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step (one mini-batch).")
    experience_micro_batch_size: int = opt(0, "Micro-batch of the experience forwards (0 = the generation batch).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        names = ("per_device_generation_batch_size", "generation_batches", "per_device_training_batch_size",
                 "gradient_accumulation_steps")
        _positive(p, prefix, self, *names)
        _positive(p, prefix, self, "experience_micro_batch_size", allow_zero=True)
        if any(not isinstance(getattr(self, n), int) or getattr(self, n) <= 0 for n in names):
            return
        rollout, mini = self.rollout_size, self.mini_batch_size
        if rollout % mini:
            p.add(prefix + "per_device_training_batch_size", self.per_device_training_batch_size,
                  f"per_device_generation_batch_size ({self.per_device_generation_batch_size}) x generation_batches "
                  f"({self.generation_batches}) = {rollout} rollouts per rank must be a multiple of "
                  f"per_device_training_batch_size ({self.per_device_training_batch_size}) x "
                  f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) = {mini}; e.g. set "
                  f"generation_batches to a multiple of {mini // math.gcd(mini, self.per_device_generation_batch_size)}")

    @property
    def rollout_size(self) -> int:
        """Samples per rank per iteration."""
        return self.per_device_generation_batch_size * self.generation_batches

    @property
    def mini_batch_size(self) -> int:
        """Samples per rank per optimizer step."""
        return self.per_device_training_batch_size * self.gradient_accumulation_steps

    def describe(self, world_size: int) -> str:
        steps = self.rollout_size // self.mini_batch_size
        return (f"batch: {self.rollout_size} rollouts/rank/iteration x {world_size} ranks = "
                f"{self.rollout_size * world_size} per iteration; mini-batch {self.mini_batch_size}/rank "
                f"({self.per_device_training_batch_size} x {self.gradient_accumulation_steps} accumulation) -> "
                f"{steps} optimizer steps per PPO epoch")


@dataclass
class RoleConfig:
    """One model role (actor, critic, reference or reward) and how its DeepSpeed engine is placed."""

    model_name_or_path: str = opt("", "Local folder or hub id of the model (required for actor; see each role).")
    tokenizer_name_or_path: str = opt("", "Tokenizer folder or hub id ('' = the model's).")
    zero_stage: Optional[int] = opt(None, "ZeRO stage 0-3. None: actor/critic 0; reference/reward follow 3 when "
                                    "their trained counterpart uses 3, else 0 (eval-only engines must be 0 or 3).")
    offload: bool = opt(False, "Offload optimizer state (trained roles) or parameters (eval-only roles) to CPU.")
    offload_params: bool = opt(False, "Also offload parameters to CPU (ZeRO-3 only).")
    dtype: str = opt("", "fp32, bf16 or fp16 ('' = the run's dtype).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory (trained roles).")
    learning_rate: float = opt(1e-6, "Peak learning rate (trained roles).")
    weight_decay: float = opt(0.0, "AdamW weight decay (trained roles).")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    lr_scheduler_type: str = opt("constant", "Learning-rate schedule: " + ", ".join(SCHEDULERS) + ".")
    num_warmup_steps: int = opt(0, "Warm-up optimizer steps of the schedule.")
    gradient_clipping: float = opt(1.0, "Clip the global gradient norm to this value (0 = off).")
    init_from: str = opt("", "critic only: 'reward' (default: the reward model's weights) or 'actor' (the actor's "
                         "backbone with a new scalar head).")
    ds_config: str = opt("", "Optional DeepSpeed JSON merged over the built config of this role (keys validated).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            p.add(prefix + "zero_stage", self.zero_stage, "must be 0, 1, 2 or 3")
        if self.dtype and self.dtype not in DTYPES:
            p.add(prefix + "dtype", self.dtype, f"must be one of {', '.join(DTYPES)} (or '' for the run's dtype)")
        _positive(p, prefix, self, "learning_rate", "weight_decay", "num_warmup_steps", "gradient_clipping",
                  allow_zero=True)
        _positive(p, prefix, self, "adam_eps")
        for n in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, n) < 1.0:
                p.add(prefix + n, getattr(self, n), "must lie in [0, 1)")
        _choice(p, prefix, self, "lr_scheduler_type", SCHEDULERS)
        if self.offload_params and self.zero_stage not in (3, None):
            p.add(prefix + "offload_params", True, f"parameter offload needs zero_stage 3 (got {self.zero_stage})")


@dataclass
class TrainConfig:
    """Everything one PPO run needs."""

    actor: RoleConfig = opt(None, "Actor (the policy being trained).")
    critic: RoleConfig = opt(None, "Critic (value model).")
    reference: RoleConfig = opt(None, "Reference (frozen initial actor for the KL penalty).")
    reward: RoleConfig = opt(None, "Reward model (frozen).")
    ppo: PPOConfig = opt(None, "PPO hyperparameters.")
    generation: GenerationConfig = opt(None, "Rollout sampling.")
    batch: BatchConfig = opt(None, "Batch arithmetic.")
    data_path: str = opt("", "Prompt data: a local .jsonl file with a 'prompt' column.")
    output_dir: str = opt("runs/ppo", "Run directory: metrics.jsonl, resolved configs, checkpoints.")
    max_steps: int = opt(10, "PPO iterations to run (one iteration = rollouts + ppo_epochs of updates).")
    seed: int = opt(1234, "Seed: data order depends on it; sampling uses seed + rank.")
    dtype: str = opt("fp32", "Default dtype of every role: fp32, bf16 or fp16.")

    def __post_init__(self) -> None:
        for name, cls in (("actor", RoleConfig), ("critic", RoleConfig), ("reference", RoleConfig),
                          ("reward", RoleConfig), ("ppo", PPOConfig), ("generation", GenerationConfig),
                          ("batch", BatchConfig)):
            if getattr(self, name) is None:
                setattr(self, name, cls())

    def validate(self) -> "TrainConfig":
        """Raise one `ConfigError` listing every problem; return self when valid."""
        p = Problems()
        for role in ROLES:
            getattr(self, role).validate(p, prefix=f"{role}_")
        for role in ("reference", "reward"):
            if getattr(self, role).zero_stage in (1, 2):
                p.add(f"{role}_zero_stage", getattr(self, role).zero_stage,
                      "eval-only engines must use ZeRO stage 0 or 3 (DeepSpeed needs an optimizer for 1/2)")
        if not self.actor.model_name_or_path:
            p.add("actor_model_name_or_path", "", "give a local model folder or hub id")
        if self.critic.init_from not in ("", "reward", "actor"):
            p.add("critic_init_from", self.critic.init_from, "must be 'reward' or 'actor'")
        self.ppo.validate(p)
        self.generation.validate(p)
        self.batch.validate(p)
        _choice(p, "", self, "dtype", DTYPES)
        _positive(p, "", self, "max_steps")
        p.raise_if_any()
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
