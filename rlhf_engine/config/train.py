"""A PPO run: its sections, the run-level PPO fields, and the checks that span sections."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import Problems
from .data import DataConfig
from .engine import EngineConfig
from .env import EnvConfig
from .fields import DTYPES, ROLES, TRAINED_ROLES, check_choice, check_positive, is_number, opt
from .generation import BatchConfig, GenerationConfig
from .ppo import PPOConfig
from .role import RoleConfig
from .ptx import PtxConfig
from .reward_source import DEFAULT as DEFAULT_SOURCE, check_reward_sources, reward_source_kind
from .rollout import RolloutConfig
from .run import LoggingConfig, RunConfig
from .scoring import ScoringConfig


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
    data: DataConfig = opt(None, "Prompt data.")
    logging: LoggingConfig = opt(None, "Metrics sinks besides metrics.jsonl.")
    engine: EngineConfig = opt(None, "How the engines are built: LoRA reference, EMA, ZeRO-3 generation, backend, "
                               "packing.", skip_flags=("generation_backend_auto",))
    env: EnvConfig = opt(None, "Multi-turn environments.")
    run: RunConfig = opt(None, "Run directory, checkpoints and resume, timeouts, preemption signals.")
    scoring: ScoringConfig = opt(None, "What scores the rollouts when it is not a reward model.")
    ptx: PtxConfig = opt(None, "PPO-ptx: a language-modelling loss on unsupervised text.")
    rollout: RolloutConfig = opt(None, "Rollout servers (stock vLLM servers that generate for the trainer) and how "
                                 "far ahead of training they run.")
    max_steps: int = opt(10, "PPO iterations to run (one iteration = rollouts + ppo_epochs of updates).")
    num_train_epochs: int = opt(0, "Passes over the prompt data: the run stops after min(max_steps, "
                                "floor(num_train_epochs x batches_per_epoch / generation_batches)) iterations, "
                                "batches_per_epoch = floor(prompts / (per_device_generation_batch_size x world size)) "
                                "(0 = max_steps only). Raise max_steps to let the epochs decide.")
    seed: int = opt(1234, "Seed: data order depends on it; sampling uses seed + rank.")
    eval_interval: int = opt(0, "Evaluate (greedy generation on held-out prompts: eval/score, eval/eos_rate, "
                             "eval/response_length) before iteration 0, every N iterations, and after the last (0 = off).")
    eval_data_path: str = opt("", "Held-out prompts for evaluation (.jsonl etc.); '' = the eval_split of data_path.")
    dtype: str = opt("auto", "Default dtype of every role: auto (bf16 on GPUs that support it, fp16 on other GPUs, "
                     "fp32 on CPU; resolved at start-up, logged, and stored in the checkpoints' fingerprint), fp32, "
                     "bf16 or fp16.")
    export_final: bool = opt(True, "At the end, export the actor and critic (and the EMA) as Hugging Face folders "
                             "(ZeRO-3 consolidated, LoRA merged, tokenizer saved) to export_dir.")
    export_dir: str = opt("", "Where export_final writes <role>/ folders ('' = <output_dir>/final).")
    def __post_init__(self) -> None:
        for name, cls in (("actor", RoleConfig), ("critic", RoleConfig), ("reference", RoleConfig),
                          ("reward", RoleConfig), ("ppo", PPOConfig), ("generation", GenerationConfig),
                          ("batch", BatchConfig), ("data", DataConfig), ("logging", LoggingConfig),
                          ("engine", EngineConfig), ("env", EnvConfig), ("run", RunConfig),
                          ("scoring", ScoringConfig), ("ptx", PtxConfig), ("rollout", RolloutConfig)):
            if getattr(self, name) is None:
                setattr(self, name, cls())

    @property
    def has_critic(self) -> bool:
        """Whether the advantage estimator needs a critic (rlhf_engine/estimators.py)."""
        from ..estimators import ESTIMATORS

        est = ESTIMATORS.get(self.ppo.advantage_estimator)
        return est is None or est.needs_critic  # an unknown name is reported by validate()

    @property
    def scored_without_model(self) -> bool:
        """A reward function, a reward server or an environment scores the rollouts: no reward engine is built."""
        return reward_source_kind(self).name != DEFAULT_SOURCE

    @property
    def response_budget(self) -> int:
        """The most tokens after the prompt: max_answer_seq_len, or an episode's budget with an environment."""
        g = self.generation
        return self.env.episode_tokens(g.max_answer_seq_len) if self.env.on else g.max_answer_seq_len

    @property
    def generation_positions(self) -> int:
        """The most positions after the prompt a generate call may feed the actor. The hf backend keeps feeding a
        row that reached its episode's budget while its batch-mates finish their turn (Hugging Face advances every
        row's positions), up to one turn past the budget; lean stops a finished row's positions."""
        g = self.generation
        if self.env.on and self.engine.generation_backend == "hf":
            return self.response_budget + g.max_answer_seq_len - 1
        return self.response_budget

    @property
    def active_roles(self) -> tuple:
        """The roles the run has (each gets an engine, except a reference that is the actor's disabled adapter): no
        reward model when a reward function scores the rollouts, no critic when the estimator needs none, no
        reference when nothing reads it (`PPOConfig.reads_reference`). The one definition of the run's roles."""
        return tuple(r for r in ROLES if not (r == "reward" and self.scored_without_model)
                     and not (r == "critic" and not self.has_critic)
                     and not (r == "reference" and not self.ppo.reads_reference))

    @property
    def trained_roles(self) -> tuple:
        """The roles of this run that train (have an optimizer), in step order."""
        return tuple(r for r in TRAINED_ROLES if r in self.active_roles)

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
        for role in ("actor", "critic"):  # trained roles default to stage 0, which cannot offload parameters
            if getattr(self, role).offload_params is True and getattr(self, role).zero_stage is None:
                p.add(f"{role}_offload_params", True, f"parameter offload needs ZeRO stage 3 and {role}_zero_stage "
                      f"defaults to 0: set {role}_zero_stage 3 (or drop {role}_offload_params)")
        if self.critic.init_from not in ("", "reward", "actor"):
            p.add("critic_init_from", self.critic.init_from, "must be 'reward' or 'actor'")
        self._validate_engine_settings(p)
        self.ppo.validate(p)
        self.generation.validate(p)
        self.batch.validate(p)
        self.data.validate(p)
        self.logging.validate(p)
        self.env.validate(p)
        self._validate_environment(p)
        self.run.validate(p)
        self.rollout.validate(p)
        if self.rollout.servers_on and self.engine.requested_backend[0] != "vllm":
            p.add("generation_backend", self.engine.requested_backend[0], "rollout servers are vLLM servers: add "
                  "--generation_backend vllm (the run then plans the rollout correction for vLLM's log-probs)")
        check_choice(p, "", self, "dtype", DTYPES)
        check_positive(p, "", self, "max_steps")
        check_positive(p, "", self, "eval_interval", allow_zero=True)
        self._validate_epochs_ptx_scoring(p)
        check_reward_sources(self, p)  # one source scores the rollouts (config/reward_source.py)
        self._validate_estimator(p)
        if self.eval_interval and not self.eval_data_path and not self.data.eval_split:
            p.add("eval_interval", self.eval_interval, "needs held-out prompts: set eval_data_path or eval_split")
        p.raise_if_any()
        return self

    def _validate_environment(self, p: Problems) -> None:
        """An environment scores its episodes itself; what shapes or cuts a single response does not apply."""
        if not self.env.on:
            return
        ppo, g = self.ppo, self.generation
        for name, off in (("normalize_reward", False), ("missing_eos_penalty", 0.0), ("overlong_buffer_len", 0)):
            if getattr(ppo, name) != off:
                p.add(name, getattr(ppo, name), "shapes a single response's score; with an environment the step "
                      "rewards are used as they are (shape them in the environment)")
        if is_number(g.min_answer_seq_len) and g.min_answer_seq_len > 0:
            p.add("min_answer_seq_len", g.min_answer_seq_len, "counts from the response's start, which an episode's "
                  "later turns do not share: not supported with an environment")
        backend, flag = self.engine.requested_backend
        if backend == "hybrid":
            p.add(flag, getattr(self.engine, flag), "the hybrid backend sizes its inference cache for "
                  "max_prompt_seq_len + max_answer_seq_len, which an episode's later turns outgrow: use lean or hf "
                  "with an environment")
        if is_number(self.eval_interval) and self.eval_interval > 0:
            p.add("eval_interval", self.eval_interval, "evaluates single responses with a reward model or function; "
                  "evaluation by playing episodes is not built yet: set it to 0 with an environment")

    def _validate_estimator(self, p: Problems) -> None:
        """Group sizes, and no critic setting in a run without a critic (it would be silently ignored)."""
        from ..estimators import ESTIMATORS, GROUP_ESTIMATORS

        ppo, est = self.ppo, self.ppo.advantage_estimator
        if est not in ESTIMATORS:
            return  # reported by PPOConfig.validate
        n = self.batch.n_samples_per_prompt
        if est in GROUP_ESTIMATORS and isinstance(n, int) and n < 2:
            p.add("n_samples_per_prompt", n, f"advantage_estimator {est} compares the responses of one prompt: "
                  "give 2 or more")
        L, max_len = ppo.overlong_buffer_len, self.generation.max_answer_seq_len
        if isinstance(L, int) and isinstance(max_len, int) and L > max_len:
            p.add("overlong_buffer_len", L, f"must be <= max_answer_seq_len ({max_len}): the penalty starts "
                  "max_answer_seq_len - overlong_buffer_len tokens in")
        if ppo.filter_uniform_groups is True and est not in GROUP_ESTIMATORS:
            p.add("filter_uniform_groups", True, f"needs a group estimator ({', '.join(GROUP_ESTIMATORS)}); "
                  f"advantage_estimator is {est}")
        if self.has_critic:
            return
        why = f"advantage_estimator {est} builds no critic: drop it"
        default_role = RoleConfig()
        for f in dataclasses.fields(RoleConfig):
            if getattr(self.critic, f.name) != getattr(default_role, f.name):
                p.add(f"critic_{f.name}", getattr(self.critic, f.name), why)
        for name in ("critic_warmup_iterations", "value_clip"):
            if getattr(ppo, name) != getattr(PPOConfig(), name):
                p.add(name, getattr(ppo, name), why)

    def _validate_epochs_ptx_scoring(self, p: Problems) -> None:
        """Epochs, ptx, what scores the rollouts (the guards, reward shaping and critic warm-up are PPOConfig's)."""
        if not isinstance(self.num_train_epochs, int) or isinstance(self.num_train_epochs, bool) or \
                self.num_train_epochs < 0:
            p.add("num_train_epochs", self.num_train_epochs, "must be a whole number >= 0 (0 = max_steps only)")
        self.ptx.validate(p)
        if self.ptx.unsupervised_dataset_name and self.batch.max_tokens_per_micro_batch:
            p.add("max_tokens_per_micro_batch", self.batch.max_tokens_per_micro_batch, "PPO-ptx pairs each "
                  "micro-batch with gradient_accumulation_steps ptx micro-batches; token-budget micro-batches vary "
                  "in number: not with unsupervised_dataset_name")
        for name in ("tokenizer_name_or_path", "use_chat_template"):
            if getattr(self.reward, name) and self.scored_without_model:
                by = "reward_fn" if self.scoring.reward_fn else "reward_url"
                p.add(f"reward_{name}", getattr(self.reward, name), f"is for a reward model; {by} "
                      f"({getattr(self.scoring, by)!r}) replaces it: drop one")
        self.scoring.validate(p)
        for role in ("actor", "critic", "reference"):
            if getattr(self, role).use_chat_template:
                p.add(f"{role}_use_chat_template", True, "is for the reward role only (reward_use_chat_template); "
                      "the actor's prompts follow use_chat_template")

    def _validate_engine_settings(self, p: Problems) -> None:
        """LoRA per role, the adapter-disabled reference, EMA (the Hybrid Engine's checks need the model config and
        CUDA: engine.preflight)."""
        e = self.engine
        e.validate(p)
        for role in ("reference", "reward"):
            if getattr(self, role).lora_dim:
                p.add(f"{role}_lora_dim", getattr(self, role).lora_dim, f"the {role} is frozen (eval-only) and takes "
                      "no adapter; LoRA is for the trained roles (actor_lora_dim, critic_lora_dim)")
        for role in ("actor", "critic"):
            rc = getattr(self, role)
            if rc.lora_dim and is_number(rc.lora_dropout) and rc.lora_dropout != 0:
                p.add(f"{role}_lora_dropout", rc.lora_dropout, "must be 0 in PPO: the old log-probs (and values) "
                      "come from eval-mode forwards and the update from training forwards, so adapter dropout would "
                      "make the PPO ratio differ from 1 even at learning rate 0")
        if e.reference_from_actor_adapter is True:
            if not self.actor.lora_dim:
                p.add("reference_from_actor_adapter", True, "needs actor LoRA: set actor_lora_dim > 0 (the reference "
                      "is the actor with its adapter disabled), or drop reference_from_actor_adapter")
            ref = self.reference.model_name_or_path
            if ref and ref != self.actor.model_name_or_path:
                p.add("reference_from_actor_adapter", True, f"the reference would be the actor's base weights "
                      f"({self.actor.model_name_or_path}), but reference_model_name_or_path is {ref!r}: drop one")
        if not self.ppo.reads_reference:  # settings of a reference that is not built
            for name, value in (("reference_model_name_or_path", self.reference.model_name_or_path),
                                ("reference_from_actor_adapter", e.reference_from_actor_adapter is True)):
                if value:
                    p.add(name, value, "sets the reference, but nothing reads it: kl_coef and kl_loss_coef are 0 "
                          "(no reference engine is built); give a KL term or --monitor_reference_kl, or drop it")
        if e.enable_ema is True and self.actor.lora_dim:
            p.add("enable_ema", True, "is not supported with actor LoRA (an average of the adapter factors A and B is "
                  "not the average of the adapted weights); drop enable_ema or actor_lora_dim")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def data_path(self) -> Any:
        """Shortcut for `data.data_path` (the flag and config key stay `data_path`)."""
        return self.data.data_path

    @data_path.setter
    def data_path(self, value: Any) -> None:
        self.data.data_path = value
