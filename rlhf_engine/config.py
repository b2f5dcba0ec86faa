"""Typed configuration: one dataclass per concern, help text on every field, `validate()` collecting every error.

Naming: a field's name is its CLI flag and its config-file key. Role fields are prefixed with the role on the command
line (`--actor_learning_rate` sets `TrainConfig.actor.learning_rate`). Imports stdlib only.
"""
from __future__ import annotations

import dataclasses
import math
import string
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Optional

from .errors import Problems

DTYPES = ("auto", "fp32", "bf16", "fp16")  # auto: bf16 on GPUs that support it, fp16 on other GPUs, fp32 on CPU
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
ROLES = ("actor", "critic", "reference", "reward")  # every role a PPO run can have
TRAINED_ROLES = ("actor", "critic")  # the roles with an optimizer (the others are eval-only)


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with help text (the CLI and the docs read `metadata['help']`)."""
    if isinstance(default, (list, dict)):  # mutable defaults need a factory
        return field(default_factory=lambda: default.copy(), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _number(v: Any) -> bool:
    """A real number (not a bool, not NaN): what every numeric field needs before it can be compared."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _positive(p: Problems, prefix: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        bad = not _number(v) or (v < 0 if allow_zero else v <= 0)
        if bad:
            p.add(prefix + n, v, f"must be {'>= 0' if allow_zero else '> 0'}")


def _choice(p: Problems, prefix: str, obj: Any, name: str, choices: tuple) -> None:
    v = getattr(obj, name)
    if v not in choices:
        p.add(prefix + name, v, f"must be one of {', '.join(map(str, choices))}")


# What users of the peers expect of each estimator family, applied to the fields a run did not set (command line
# or config file: explicit flags always win); logged at start-up and tabled in docs/estimators.md. Group estimators
# put the KL in the loss (verl's GRPO recipe: kl_loss_coef 0.001 with the low-variance k3 estimator), not in the
# reward (a response's return would carry its KL, and in a group of equal scores the KL differences alone become
# the advantages); Dr. GRPO also divides each response's token sum by the fixed maximum length (its paper's fix of the
# length bias). GAE and REINFORCE++ keep the KL penalty in the reward, as InstructGPT and OpenRLHF do.
GROUP_KL_IN_LOSS = {"kl_coef": 0.0, "kl_loss_coef": 0.001, "kl_loss_estimator": "k3"}
ESTIMATOR_DEFAULTS = {
    "gae": {},
    "reinforce_pp": {},
    "grpo": GROUP_KL_IN_LOSS,
    "rloo": GROUP_KL_IN_LOSS,
    "reinforce_pp_baseline": GROUP_KL_IN_LOSS,
    "dr_grpo": {**GROUP_KL_IN_LOSS, "loss_agg_mode": "seq_mean_token_sum_norm"},
}


def apply_estimator_defaults(cfg: Any, explicit: set) -> dict:
    """Set the estimator family's defaults (`ESTIMATOR_DEFAULTS`) on the PPO fields of `cfg` (a TrainConfig) that
    are not in `explicit` (the flat keys a run gave); returns what was set."""
    applied = {}
    for key, value in ESTIMATOR_DEFAULTS.get(cfg.ppo.advantage_estimator, {}).items():
        if key not in explicit:
            setattr(cfg.ppo, key, value)
            applied[key] = value
    return applied


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
    advantage_estimator: str = opt("gae", "How advantages are estimated (rlhf_engine/estimators.py, a registry of pure "
                                   "functions): gae = GAE over the critic's values; critic-free (no critic is "
                                   "built): grpo = (return - group mean) / (group std + 1e-6), dr_grpo = return - "
                                   "group mean, rloo = return - mean of the group's other responses, "
                                   "reinforce_pp_baseline = return - group mean, then token-level whitening over the "
                                   "batch (these four need n_samples_per_prompt >= 2; a response's return = shaped "
                                   "score - kl_coef x its summed KL); reinforce_pp = discounted per-token returns, "
                                   "token-level whitening.")
    kl_loss_coef: float = opt(0.0, "Weight of a KL(actor || reference) term in the actor loss (0 = off), aggregated "
                              "like the policy loss; usable with any estimator and alongside kl_coef (the KL "
                              "penalty in the reward). Logged policy/kl_loss.")
    kl_loss_estimator: str = opt("k2", "Per-token estimator of the KL loss, with d = log pi - log pi_ref: k1 = d "
                                 "(gradient: grad log pi, zero in expectation), k2 = d^2/2 (gradient: d grad log pi, "
                                 "the reverse-KL gradient), k3 = exp(-d) - 1 + d (an unbiased KL value, but its "
                                 "gradient (1 - exp(-d)) grad log pi is not the reverse-KL gradient).")
    loss_agg_mode: str = opt("token_mean", "How the policy loss's per-token terms are aggregated over the mini-batch "
                             "on all ranks: token_mean = sum / tokens; seq_mean_token_mean = mean over responses of "
                             "each response's token mean; seq_mean_token_sum_norm = mean over responses of each "
                             "response's token sum / max_answer_seq_len (Dr. GRPO).")
    policy_loss: str = opt("ppo_clip", "The actor's policy loss (rlhf_engine/policy_losses.py, a registry): ppo_clip = "
                           "PPO's clipped surrogate (dual_clip, clip_eps_high); gspo = GSPO, the length-normalised "
                           "sequence ratio clipped per response (its paper uses loss_agg_mode seq_mean_token_mean "
                           "and clip_eps ~3e-4); cispo = CISPO, -A x sg(clip(ratio)) x log pi, a clipped token "
                           "keeps its gradient. docs/estimators.md has the formulas.")
    clip_eps_high: Optional[float] = opt(None, "Upper clip bound of the ratio (DAPO's clip-higher): the ratio is "
                                         "clipped to [1 - clip_eps, 1 + clip_eps_high]; None = clip_eps.")
    filter_uniform_groups: bool = opt(False, "With a group estimator: a group whose responses' shaped scores are all "
                                      "equal (all right, all wrong) carries no signal; its responses leave the policy "
                                      "loss (weight 0, out of the token count; never dropped). Logged "
                                      "rollout/uniform_group_rate.")
    overlong_buffer_len: int = opt(0, "DAPO's soft overlong penalty: a response longer than max_answer_seq_len - L "
                                   "gets a linear penalty reaching -overlong_penalty_factor at the limit, added to "
                                   "its shaped score before missing_eos_penalty (0 = off).")
    overlong_penalty_factor: float = opt(1.0, "The penalty of overlong_buffer_len at max_answer_seq_len.")
    rollout_correction: str = opt("none", "Importance correction for a generation backend that does not sample exactly "
                                  "from the actor (see rollout/logprob_diff_*), TRL's modes, with rho = pi_old / "
                                  "pi_rollout per token or per response (product over its tokens) and C = "
                                  "rollout_correction_cap: token_truncate = each token's advantage weighted by "
                                  "min(rho_t, C); token_mask = weighted by rho_t, tokens with rho_t > C leave the "
                                  "policy loss; sequence_truncate = every token weighted by min(rho, C); "
                                  "sequence_mask = weighted by rho, responses with rho > C leave the policy loss (the "
                                  "critic still trains on them); none. (tis and mis were renamed token_truncate and "
                                  "sequence_mask.)")
    rollout_correction_cap: float = opt(2.0, "The cap C of rollout_correction (> 1).")
    whiten_advantages: Optional[bool] = opt(None, "Whiten GAE advantages (global masked mean/std across ranks) before "
                                            "the update; None = on with gae. Only for gae (the other estimators "
                                            "normalize themselves): set with another one, it is an error.")
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient on the actor loss (0 = off).")
    critic_warmup_iterations: int = opt(0, "Critic warm-up: the first N iterations train only the critic (the actor "
                                        "and its ptx term take no step; rollouts and experience as usual); 0 = off.")
    normalize_reward: bool = opt(False, "Normalize scores by running statistics of every score seen so far (all "
                                 "ranks; updated with each iteration's scores first; saved in checkpoints): "
                                 "(score - mean) / (std + 1e-8), before missing_eos_penalty and reward_clip.")
    missing_eos_penalty: float = opt(0.0, "Subtracted from the score of every response that did not end with a stop "
                                     "token (cut at max_answer_seq_len), after normalize_reward and before the "
                                     "reward_clip clamp, in those score units; >= 0, 0 = off (TRL's flag).")
    max_consecutive_skips: int = opt(20, "Stop the run (exit code 3) after this many updates in a row were skipped "
                                     "because a gradient of the actor or critic was non-finite on some rank "
                                     "(fp16 overflow, inf/NaN; both engines always skip together). fp16's loss-scale "
                                     "calibration skips a few updates at the start. 0 = never stop.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        _positive(p, prefix, self, "ppo_epochs", "kl_horizon")
        _positive(p, prefix, self, "missing_eos_penalty", allow_zero=True)
        for n in ("critic_warmup_iterations", "max_consecutive_skips"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                p.add(prefix + n, v, "must be a whole number >= 0")
        if not isinstance(self.normalize_reward, bool):
            p.add(prefix + "normalize_reward", self.normalize_reward, "must be true or false")
        _positive(p, prefix, self, "kl_coef", "kl_target", "clip_eps", "value_clip", "reward_clip", "entropy_coef",
                  allow_zero=True)
        from .estimators import ESTIMATORS
        from .ppo_math import KL_ESTIMATORS, LOSS_AGG_MODES, RENAMED_CORRECTIONS, ROLLOUT_CORRECTIONS

        if self.rollout_correction in RENAMED_CORRECTIONS:
            p.add(prefix + "rollout_correction", self.rollout_correction, f"was renamed: use "
                  f"{RENAMED_CORRECTIONS[self.rollout_correction]} (docs/sampling.md: the four modes)")
        else:
            _choice(p, prefix, self, "rollout_correction", ROLLOUT_CORRECTIONS)
        from .policy_losses import POLICY_LOSSES

        _choice(p, prefix, self, "policy_loss", tuple(POLICY_LOSSES))
        if self.dual_clip is not None and self.policy_loss != "ppo_clip":
            p.add(prefix + "dual_clip", self.dual_clip, f"is a ppo_clip setting; policy_loss {self.policy_loss} has "
                  "no dual clip: drop it")
        _choice(p, prefix, self, "kl_loss_estimator", KL_ESTIMATORS)
        _choice(p, prefix, self, "loss_agg_mode", LOSS_AGG_MODES)
        _positive(p, prefix, self, "kl_loss_coef", "overlong_buffer_len", "overlong_penalty_factor", allow_zero=True)
        if self.clip_eps_high is not None and not (_number(self.clip_eps_high) and self.clip_eps_high >= 0):
            p.add(prefix + "clip_eps_high", self.clip_eps_high, "must be >= 0 (or None for clip_eps)")
        if self.advantage_estimator != "gae" and self.whiten_advantages is not None:
            p.add(prefix + "whiten_advantages", self.whiten_advantages, f"applies to gae only; "
                  f"{self.advantage_estimator} normalizes its own advantages: drop it")
        if not (_number(self.rollout_correction_cap) and self.rollout_correction_cap > 1.0):
            p.add(prefix + "rollout_correction_cap", self.rollout_correction_cap, "must be > 1")
        _choice(p, prefix, self, "kl_estimator", KL_ESTIMATORS)
        _choice(p, prefix, self, "advantage_estimator", tuple(ESTIMATORS))
        for n in ("gamma", "lam"):
            v = getattr(self, n)
            if not _number(v) or not 0.0 <= v <= 1.0:
                p.add(prefix + n, v, "must lie in [0, 1]")
        if self.dual_clip is not None and not (_number(self.dual_clip) and self.dual_clip > 1.0):
            p.add(prefix + "dual_clip", self.dual_clip, "must be > 1 (or None to disable dual clipping)")
        if self.adaptive_kl is True and _number(self.kl_target) and self.kl_target <= 0:
            p.add(prefix + "kl_target", self.kl_target, "must be > 0 with adaptive_kl (the controller divides by it)")


    @property
    def whitens(self) -> bool:
        """Whether GAE advantages are whitened (whiten_advantages; None = on for gae)."""
        return self.advantage_estimator == "gae" and self.whiten_advantages is not False

    @property
    def upper_clip(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


@dataclass
class GenerationConfig:
    """Rollout sampling controls: rollouts are sampled from exactly the distribution PPO's log-probs describe. The
    model's own generation_config is not used (its sampling fields are named in a start-up warning)."""

    max_prompt_seq_len: int = opt(256, "Longest prompt in tokens; longer prompts are rejected by the data layer.")
    max_answer_seq_len: int = opt(256, "Maximum number of generated tokens per response.")
    min_answer_seq_len: int = opt(0, "Minimum number of generated tokens before a stop token may be sampled; every "
                                  "log-prob the trainer computes masks the stop tokens at those positions too.")
    temperature: float = opt(1.0, "Sampling temperature; the same temperature divides the logits in every log-prob "
                             "(old, reference, training).")
    top_p: float = opt(1.0, "Nucleus sampling mass: must stay 1.0 when sampling (a truncated distribution is not "
                       "the full softmax PPO's log-probs describe); used only with do_sample false, where it "
                       "does nothing.")
    top_k: int = opt(0, "Top-k sampling: must stay 0 (off) when sampling, for the same reason as top_p.")
    do_sample: bool = opt(True, "Sample (True) or decode greedily (False).")
    stop_token_ids: list = opt([], "Extra token ids that end a response. A response ends at the first of: these, the "
                               "tokenizer's EOS, the model generation_config's eos_token_id(s), and with "
                               "use_chat_template the template's end-of-turn token.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        _positive(p, prefix, self, "max_prompt_seq_len", "max_answer_seq_len", "temperature")
        _positive(p, prefix, self, "min_answer_seq_len", "top_k", allow_zero=True)
        if not (_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            p.add(prefix + "top_p", self.top_p, "must lie in (0, 1]")
        elif self.do_sample is True and self.top_p < 1.0:
            p.add(prefix + "top_p", self.top_p, "must be 1.0 when sampling: nucleus sampling draws from a truncated "
                  "distribution while PPO's log-probs describe the full softmax (every rollout would be off-policy); "
                  "lower temperature instead")
        if self.do_sample is True and isinstance(self.top_k, int) and self.top_k > 0:
            p.add(prefix + "top_k", self.top_k, "must be 0 when sampling: top-k sampling draws from a truncated "
                  "distribution while PPO's log-probs describe the full softmax; lower temperature instead")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            p.add(prefix + "stop_token_ids", self.stop_token_ids, "must be a list of token ids (integers >= 0)")
        if (_number(self.min_answer_seq_len) and _number(self.max_answer_seq_len)
                and self.min_answer_seq_len > self.max_answer_seq_len):
            p.add(prefix + "min_answer_seq_len", self.min_answer_seq_len,
                  f"must be <= max_answer_seq_len ({self.max_answer_seq_len})")


@dataclass
class BatchConfig:
    """Batch arithmetic of one iteration (per rank unless said otherwise)."""

    per_device_generation_batch_size: int = opt(4, "Prompts each rank generates for in one generate() call.")
    generation_batches: int = opt(1, "Rollout batches buffered per iteration before training on them.")
    per_device_training_batch_size: int = opt(4, "Micro-batch size of each actor/critic forward/backward.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step (one mini-batch).")
    experience_micro_batch_size: int = opt(0, "Micro-batch of the experience forwards (0 = the rollouts of one "
                                           "generation batch).")
    max_tokens_per_micro_batch: int = opt(0, "Micro-batches by a token budget instead of a row count: each mini-batch "
                                          "(per_device_training_batch_size x gradient_accumulation_steps rollouts) is "
                                          "cut, in order, into micro-batches of at most N real tokens (a longer "
                                          "rollout is one of its own); the ranks agree on the count (a rank with "
                                          "fewer runs empty ones). The experience forwards use the same "
                                          "micro-batches. 0 = per_device_training_batch_size rows.")
    n_samples_per_prompt: int = opt(1, "Responses sampled per prompt, on the same rank, one after another (a group). "
                                    "per_device_generation_batch_size keeps counting prompts; every rollout count "
                                    "(rollout_size, mini-batches) counts rollouts = prompts x n_samples_per_prompt. "
                                    "The group estimators need >= 2.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        names = ("per_device_generation_batch_size", "generation_batches", "per_device_training_batch_size",
                 "gradient_accumulation_steps", "n_samples_per_prompt")
        _positive(p, prefix, self, *names)
        _positive(p, prefix, self, "experience_micro_batch_size", "max_tokens_per_micro_batch", allow_zero=True)
        for n in names + ("experience_micro_batch_size", "max_tokens_per_micro_batch"):  # 2.5 is no batch size
            if _number(getattr(self, n)) and not isinstance(getattr(self, n), int):
                p.add(prefix + n, getattr(self, n), "must be a whole number")
        if any(not isinstance(getattr(self, n), int) or getattr(self, n) <= 0 for n in names):
            return
        rollout, mini = self.rollout_size, self.mini_batch_size
        samples = f" x n_samples_per_prompt ({self.n_samples_per_prompt})" if self.n_samples_per_prompt > 1 else ""
        if rollout % mini:
            p.add(prefix + "per_device_training_batch_size", self.per_device_training_batch_size,
                  f"per_device_generation_batch_size ({self.per_device_generation_batch_size}) x generation_batches "
                  f"({self.generation_batches}){samples} = {rollout} rollouts per rank must be a multiple of "
                  f"per_device_training_batch_size ({self.per_device_training_batch_size}) x "
                  f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) = {mini}; e.g. set "
                  f"generation_batches to a multiple of {mini // math.gcd(mini, self.generation_rollouts)}")

    @property
    def rollout_size(self) -> int:
        """Rollouts per rank per iteration (prompts x n_samples_per_prompt)."""
        return self.generation_rollouts * self.generation_batches

    @property
    def generation_rollouts(self) -> int:
        """Rollouts per rank of one generate() call: prompts x n_samples_per_prompt."""
        return self.per_device_generation_batch_size * self.n_samples_per_prompt

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
    tokenizer_name_or_path: str = opt("", "Tokenizer folder or hub id ('' = the model's). PPO reward role: the reward "
                                      "model's own tokenizer when its vocabulary differs from the actor's (rows are "
                                      "decoded and re-encoded for it); '' = it reads the actor's token ids.")
    zero_stage: Optional[int] = opt(None, "ZeRO stage 0-3. None: actor/critic 0; reference/reward follow 3 when "
                                    "their trained counterpart uses 3, else 0 (eval-only engines must be 0 or 3).")
    offload: bool = opt(False, "Offload optimizer state (trained roles) or parameters (eval-only roles) to CPU.")
    offload_params: bool = opt(False, "Also offload parameters to CPU (ZeRO-3 only).")
    dtype: str = opt("", "auto, fp32, bf16 or fp16 ('' = the run's dtype; auto = bf16 on GPUs that support it, fp16 "
                     "on other GPUs, fp32 on CPU).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory (trained roles).")
    trainable_layers: int = opt(0, "Train only the top N transformer blocks (+ final norm and score head); the "
                                "embeddings and lower blocks stay frozen, so backward stops early (0 = train all).")
    learning_rate: float = opt(1e-6, "Peak learning rate (trained roles).")
    weight_decay: float = opt(0.0, "AdamW weight decay (trained roles).")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    lr_scheduler_type: str = opt("constant", "Learning-rate schedule: " + ", ".join(SCHEDULERS) + ".")
    num_warmup_steps: int = opt(0, "Warm-up optimizer steps of the schedule.")
    gradient_clipping: float = opt(1.0, "Clip the global gradient norm to this value (0 = off).")
    use_chat_template: bool = opt(False, "reward only: score each sample as a conversation (the data's prompt as the "
                                  "user turn, the response as the assistant turn) through the reward tokenizer's "
                                  "chat template (tokenizer_name_or_path, else the reward model's own), instead of "
                                  "the actor's prompt text followed by the response.")
    init_from: str = opt("", "critic only: 'reward' (default: the reward model's weights) or 'actor' (the actor's "
                         "backbone with a new scalar head).")
    ds_config: str = opt("", "Optional DeepSpeed JSON merged over the built config of this role (keys validated).")
    lora_dim: int = opt(0, "LoRA rank (peft) of a trained role; 0 = off (full fine-tuning). With LoRA only the adapter "
                        "weights train (and the critic's scalar head); exports merge the adapter into plain weights.")
    lora_alpha: float = opt(16.0, "LoRA alpha: the adapter's update is scaled by lora_alpha / lora_dim.")
    lora_dropout: float = opt(0.0, "Dropout on the LoRA input. Must be 0 in PPO (old log-probs come from eval-mode "
                              "forwards, the update from training forwards: dropout would make the ratio differ from "
                              "1 at lr 0); steps 1 and 2 allow it.")
    lora_target_modules: str = opt("all-linear", "Modules that get an adapter: 'all-linear' (every Linear / Conv1D "
                                   "layer of the backbone; never the LM head or the score head) or comma-separated "
                                   "module names or name suffixes, e.g. 'q_proj,v_proj' or 'c_attn'.")
    attn_implementation: str = opt("auto", "Attention kernel, passed to transformers: auto = transformers' default "
                                   "(sdpa); or eager, sdpa, flash_attention_2, ... (every role should use the same "
                                   "one as the actor's reference for KL 0 at lr 0).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not isinstance(self.attn_implementation, str) or not self.attn_implementation:
            p.add(prefix + "attn_implementation", self.attn_implementation, "name an attention implementation "
                  "(auto, eager, sdpa, ...)")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            p.add(prefix + "zero_stage", self.zero_stage, "must be 0, 1, 2 or 3")
        if self.dtype and self.dtype not in DTYPES:
            p.add(prefix + "dtype", self.dtype, f"must be one of {', '.join(DTYPES)} (or '' for the run's dtype)")
        _positive(p, prefix, self, "learning_rate", "weight_decay", "num_warmup_steps", "gradient_clipping", "trainable_layers",
                  allow_zero=True)
        _positive(p, prefix, self, "adam_eps")
        for n in ("adam_beta1", "adam_beta2"):
            if not (_number(getattr(self, n)) and 0.0 <= getattr(self, n) < 1.0):
                p.add(prefix + n, getattr(self, n), "must lie in [0, 1)")
        _choice(p, prefix, self, "lr_scheduler_type", SCHEDULERS)
        if self.offload_params and self.zero_stage not in (3, None):
            p.add(prefix + "offload_params", True, f"parameter offload needs zero_stage 3 (got {self.zero_stage})")
        if not (isinstance(self.lora_dim, int) and not isinstance(self.lora_dim, bool) and self.lora_dim >= 0):
            p.add(prefix + "lora_dim", self.lora_dim, "must be a whole number >= 0 (0 = LoRA off)")
        _positive(p, prefix, self, "lora_alpha")
        if not (_number(self.lora_dropout) and 0.0 <= self.lora_dropout < 1.0):
            p.add(prefix + "lora_dropout", self.lora_dropout, "must lie in [0, 1)")
        if not isinstance(self.lora_target_modules, str) or not [t for t in self.lora_target_modules.split(",")
                                                                 if t.strip()]:
            p.add(prefix + "lora_target_modules", self.lora_target_modules,
                  "give 'all-linear' or comma-separated module names")
        if self.lora_dim and getattr(self, "trainable_layers", 0):
            p.add(prefix + "lora_dim", self.lora_dim, f"cannot be combined with {prefix}trainable_layers "
                  f"({self.trainable_layers}): LoRA freezes every base weight; use one of them")


LONG_PROMPT_POLICIES = ("error", "skip", "truncate_left")
BAD_ROW_POLICIES = ("error", "skip")


def parse_data_sources(spec: Any) -> list[tuple[str, Optional[Fraction]]]:
    """`data_path` -> [(path or hub name, ratio or None)].

    `spec` is a string `"a.jsonl"`, `"a.jsonl,b.jsonl"` or `"a.jsonl:0.7,b.parquet:0.3"` (a trailing `:number` is a
    ratio; a path may not contain ','), or a list of such strings or of `[path, ratio]` pairs. Ratios are exact
    fractions of their decimal text (`0.7` is 7/10). Either every source has a ratio or none has. Raises ValueError.
    """
    items = spec if isinstance(spec, (list, tuple)) else ([] if spec is None else str(spec).split(","))
    out: list[tuple[str, Optional[Fraction]]] = []
    for item in items:
        ratio: Any = None
        if isinstance(item, (list, tuple)):
            if len(item) != 2:
                raise ValueError(f"{item!r}: a list entry is 'path', 'path:ratio' or [path, ratio]")
            path, ratio = str(item[0]).strip(), item[1]
        else:
            path = str(item).strip()
            head, sep, tail = path.rpartition(":")
            if sep and head:
                try:
                    ratio = Fraction(tail.strip())
                    path = head.strip()
                except ValueError:  # not a number: the ':' belongs to the path
                    ratio = None
        if not path:
            raise ValueError("an empty entry; separate sources with ',' and give each a path")
        if ratio is not None:
            try:
                ratio = Fraction(str(ratio))
            except (ValueError, TypeError):
                raise ValueError(f"{path}: ratio {ratio!r} is not a number") from None
            if ratio <= 0:
                raise ValueError(f"{path}: ratio {float(ratio):g} must be > 0")
        out.append((path, ratio))
    if not out:
        raise ValueError("no data source given")
    if len({r is None for _, r in out}) > 1:
        raise ValueError("give a ratio for every source (a.jsonl:0.7,b.jsonl:0.3) or for none (each used in full)")
    return out


@dataclass
class DataConfig:
    """Prompt data: sources and blending, columns, templates, split, and what to do with bad or long rows."""

    data_path: Any = opt("", "Prompt data: one source, several joined with ',' (each used in full), or a blend "
                         "'a.jsonl:0.7,b.parquet:0.3' (str, or a list in a config file). A source is a local "
                         ".jsonl/.json/.parquet/.csv file (format by extension), a folder written by datasets' "
                         "save_to_disk, or a hub dataset name (its 'train' split; with HF_HUB_OFFLINE set, read "
                         "from the local HF datasets cache only).")
    prompt_column: str = opt("prompt", "Column holding the prompt text (every source).")
    prompt_template: str = opt("", "Python format string applied to each prompt before tokenization, e.g. "
                               "'Question: {prompt}\\nAnswer:'; must contain {prompt}; other {column} fields are "
                               "filled from the row; write literal braces as {{ }}. '' = the prompt as is.")
    use_chat_template: bool = opt(False, "Wrap each prompt (after prompt_template) in the tokenizer's chat template as "
                                  "one user message with the generation prompt; the result is tokenized without "
                                  "adding special tokens again (no double BOS).")
    eval_split: float = opt(0.0, "Fraction of the prompts held out for evaluation (deterministic on data_seed).")
    long_prompt_policy: str = opt("error", "Prompts longer than max_prompt_seq_len tokens: 'error' (stop, naming "
                                  "them), 'skip' (drop and count) or 'truncate_left' (keep the last tokens, and a "
                                  "leading BOS).")
    bad_row_policy: str = opt("error", "Rows with an empty/missing/non-text prompt, or (.jsonl) invalid UTF-8 or "
                              "invalid JSON: 'error' (stop, naming them) or 'skip' (drop and count).")
    data_seed: Optional[int] = opt(None, "Seed of blending and the eval split (None = the run's seed).")
    data_cache_dir: str = opt("", "Folder of the tokenized-data cache, on node-local disk: local rank 0 of each node "
                              "tokenizes once, the node's other ranks and later runs with the same files, tokenizer "
                              "and data settings read the result. '' = $RLHF_ENGINE_DATA_CACHE, else "
                              "<RLHF_ENGINE_CACHE or ~/.cache/rlhf_engine>/tokenized; 'none' = off (every rank "
                              "tokenizes). Hub datasets and slow tokenizers are never cached.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not isinstance(self.data_path, (str, list, tuple)):
            p.add(prefix + "data_path", self.data_path, "must be a string or a list of sources")
        elif self.data_path:  # '' is caught where the data is loaded
            try:
                parse_data_sources(self.data_path)
            except ValueError as e:
                p.add(prefix + "data_path", self.data_path, str(e))
        if not isinstance(self.prompt_column, str) or not self.prompt_column:
            p.add(prefix + "prompt_column", self.prompt_column, "must name a column")
        if self.prompt_template:
            try:
                names = {name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name is not None}
            except ValueError as e:
                p.add(prefix + "prompt_template", self.prompt_template,
                      f"not a valid format string ({e}); write literal braces as {{{{ and }}}}")
            else:
                if "prompt" not in names:
                    p.add(prefix + "prompt_template", self.prompt_template, "must contain {prompt}")
                if any(not n or n.isdigit() for n in names):
                    p.add(prefix + "prompt_template", self.prompt_template,
                          "positional fields ({} or {0}) are not allowed; name them ({prompt} or a column)")
        if not _number(self.eval_split) or not 0.0 <= self.eval_split < 1.0:
            p.add(prefix + "eval_split", self.eval_split, "must lie in [0, 1)")
        _choice(p, prefix, self, "long_prompt_policy", LONG_PROMPT_POLICIES)
        _choice(p, prefix, self, "bad_row_policy", BAD_ROW_POLICIES)
        if self.data_seed is not None and (not isinstance(self.data_seed, int) or isinstance(self.data_seed, bool)):
            p.add(prefix + "data_seed", self.data_seed, "must be an integer or None")
        if not isinstance(self.data_cache_dir, str):
            p.add(prefix + "data_cache_dir", self.data_cache_dir, "must be a folder path, '' (the default) or 'none'")


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl: wandb (offline without WANDB_API_KEY) and TensorBoard."""

    wandb_project: str = opt("", "wandb project; '' = wandb off. Files go to <output_dir>/wandb; offline unless "
                             "WANDB_API_KEY is set (and WANDB_MODE is not offline).")
    wandb_entity: str = opt("", "wandb entity (team or user); '' = your default.")
    wandb_run_name: str = opt("", "wandb run name; '' = wandb picks one.")
    wandb_sample_interval: int = opt(10, "Log a wandb table of prompt / response / score every N iterations.")
    tensorboard: bool = opt(False, "Also write TensorBoard scalars to <output_dir>/tensorboard (needs tensorboard or "
                            "tensorboardX installed; otherwise one warning).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        _positive(p, prefix, self, "wandb_sample_interval")
        if _number(self.wandb_sample_interval) and not isinstance(self.wandb_sample_interval, int):
            p.add(prefix + "wandb_sample_interval", self.wandb_sample_interval, "must be a whole number")


ENV_ERRORS = ("stop", "score_zero")


@dataclass
class EnvConfig:
    """Multi-turn rollouts (docs/environments.md): the model writes a turn, an environment answers with an
    observation and a reward, until it says done. Observations are context, never trained on."""

    environment: str = opt("", "'module:factory': factory(row) gets a data row (its columns and 'prompt') and "
                           "returns an environment with reset() -> first user message or None (the row's prompt) "
                           "and step(response) -> Step(observation, reward, done). '' = single-turn rollouts "
                           "scored by the reward model or function.")
    max_turns: int = opt(4, "Most model turns per episode; the episode ends after the last one whatever the "
                         "environment says.")
    max_episode_tokens: int = opt(0, "Most tokens of an episode after the prompt, model turns and observations "
                                  "together (0 = max_turns x max_answer_seq_len). An episode that reaches it ends "
                                  "truncated (env/truncated_rate).")
    env_timeout_s: float = opt(30.0, "Seconds one reset() or step() call may take before it counts as an error.")
    env_workers: int = opt(8, "Environment calls of a turn run in this many threads, across the batch's rows.")
    env_errors: str = opt("stop", "What an environment call that raised or timed out does: 'stop' (the default: "
                          "the run stops naming the row, so a broken environment is not mistaken for a failing "
                          "model) or 'score_zero' (the episode ends there, the failed turn scoring 0; counted in "
                          "env/errors).")

    @property
    def on(self) -> bool:
        return bool(self.environment)

    def episode_tokens(self, max_answer_seq_len: int) -> int:
        """The episode's token budget after the prompt."""
        return self.max_episode_tokens or self.max_turns * max_answer_seq_len

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not isinstance(self.environment, str) or (self.environment and ":" not in self.environment):
            p.add(prefix + "environment", self.environment, "must be 'module:factory' (or '' for single-turn)")
        for name in ("max_turns", "env_workers"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                p.add(prefix + name, v, "must be a whole number >= 1")
        v = self.max_episode_tokens
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            p.add(prefix + "max_episode_tokens", v, "must be a whole number >= 0 (0 = max_turns x "
                  "max_answer_seq_len)")
        _positive(p, prefix, self, "env_timeout_s")
        _choice(p, prefix, self, "env_errors", ENV_ERRORS)


GATHER_ONCE_MODES = ("auto", "replica", "on", "off")


@dataclass
class EngineConfig:
    """Engine extensions of a PPO run: LoRA reference, EMA of the actor, ZeRO-3 generation, DeepSpeed Hybrid Engine."""

    reference_from_actor_adapter: bool = opt(False, "With actor LoRA (actor_lora_dim > 0): no reference engine is "
                                             "built; reference log-probs come from the actor with its adapter "
                                             "disabled, i.e. the initial (base) weights. Saves one model copy.")
    enable_ema: bool = opt(False, "Keep an exponential moving average of the actor in its own eval-only engine "
                           "(ZeRO 3 when the actor is at 3, else 0): ema = ema_decay*ema + (1-ema_decay)*actor after "
                           "every actor optimizer step; saved with checkpoints, exported as <output>/ema.")
    ema_decay: float = opt(0.992, "EMA decay beta in [0, 1) (DeepSpeed-Chat's value by default).")
    ema_dtype: str = opt("fp32", "dtype of the EMA weights: fp32 (default, whatever the actor's dtype: a bf16 EMA "
                         "loses updates smaller than its rounding) or '' (the actor's dtype).")
    generation_gather_once: str = opt("auto", "ZeRO-3 actor: how generation gets the partitioned weights. 'replica' "
                                      "= decode on a plain copy of the actor refreshed once per generate call (one "
                                      "extra copy of its weights per rank; no ZeRO-3 hook or collective while "
                                      "decoding); 'on' = gather the actor once per call in place (its hooks still "
                                      "run per token); 'off' = fetch every layer for every token, ranks in "
                                      "lockstep; 'auto' = replica, or off for a LoRA actor. Only when the actor's "
                                      "weights fit gather_once_max_bytes, else off (logged).")
    gather_once_max_bytes: int = opt(8 * 2**30, "Largest actor (bytes of its full weights) gathered at once for "
                                     "generation; a larger actor falls back to per-layer fetching (logged once).")
    packing: str = opt("off", "Forwards on packed rows (docs/packing.md): every experience and training forward of "
                       "actor, reference, critic and reward lays its rows' real tokens end to end, each sequence "
                       "with its own position ids and a block-diagonal causal mask, instead of padded rows. on = "
                       "refused by name where the start-up probe says a model does not compute packed rows right; "
                       "auto = on where it does (else off, logged); off = padded rows (the default: measured no "
                       "faster on a CPU, see docs/packing.md). The experience forwards then run in training "
                       "micro-batches (as with trim_padding).")
    trim_padding: bool = opt(False, "Every actor, reference, critic and reward forward drops the columns that are "
                             "padding in all of its rows (left prompt padding, right response padding); the "
                             "experience forwards then run in training micro-batches (per_device_training_batch_size "
                             "rows, not experience_micro_batch_size) so that experience and training see identical "
                             "tensors. Numbers at real tokens are unchanged up to kernel rounding. Off by default: "
                             "measured no faster (bench/README.md, padding trimming).")
    generation_backend: str = opt("lean", "What generates the rollouts (rlhf_engine/engine/generation/): lean = our "
                                  "own decoding loop over the actor's forward and KV cache (the default; the same "
                                  "distribution and stop rules as hf, faster); hf = Hugging Face generate on the "
                                  "actor (the reference); both follow generation_gather_once under ZeRO-3; hybrid = "
                                  "DeepSpeed's Hybrid Engine (GPU only, DeepSpeed-inference architectures only, no "
                                  "LoRA; unverified here; stops at start-up where it cannot run, unless "
                                  "hybrid_engine_fallback).")
    enable_hybrid_engine: bool = opt(False, "DeepSpeed-Chat's flag: true = --generation_backend hybrid (it wins over "
                                     "generation_backend).")
    hybrid_engine_fallback: bool = opt(False, "Where the Hybrid Engine cannot run (no CUDA, architecture without a "
                                       "DeepSpeed inference container, LoRA), log a warning and generate with "
                                       "Hugging Face instead of stopping.")
    inference_tp_size: int = opt(1, "Hybrid Engine: tensor-parallel size of generation.")
    tp_gather_partition_size: int = opt(8, "Hybrid Engine: layers gathered together when inference_tp_size > 1.")
    release_inference_cache: bool = opt(False, "Hybrid Engine: free the inference workspace after each generate.")
    unpin_actor_parameters: bool = opt(False, "Hybrid Engine: do not pin the gathered actor parameters (DeepSpeed's "
                                       "pin_parameters = not unpin_actor_parameters).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not (_number(self.ema_decay) and 0.0 <= self.ema_decay < 1.0):
            p.add(prefix + "ema_decay", self.ema_decay, "must lie in [0, 1)")
        if self.ema_dtype and self.ema_dtype not in DTYPES:
            p.add(prefix + "ema_dtype", self.ema_dtype, f"must be one of {', '.join(DTYPES)} (or '' for the actor's)")
        _choice(p, prefix, self, "generation_gather_once", GATHER_ONCE_MODES)
        _choice(p, prefix, self, "packing", ("auto", "on", "off"))
        if not isinstance(self.generation_backend, str) or not self.generation_backend:
            p.add(prefix + "generation_backend", self.generation_backend, "must name a generation backend (lean, "
                  "hf, hybrid)")  # the name itself is checked against the registry by engine/preflight.py
        _positive(p, prefix, self, "gather_once_max_bytes", allow_zero=True)
        _positive(p, prefix, self, "inference_tp_size", "tp_gather_partition_size")
        for n in ("gather_once_max_bytes", "inference_tp_size", "tp_gather_partition_size"):
            if _number(getattr(self, n)) and not isinstance(getattr(self, n), int):
                p.add(prefix + n, getattr(self, n), "must be a whole number")


def _validate_dist_timeout(p: Problems, value: Any) -> None:
    if value is not None and not (_number(value) and value > 0):
        p.add("dist_timeout_minutes", value, "must be > 0 (minutes), or None for DEEPSPEED_TIMEOUT / 10")


def _resume_field(unit: str, extra_state: str = "") -> Any:
    state = "weights, optimizers, schedules, data position, random generators" + (f", {extra_state}" if extra_state
                                                                                  else "")
    return opt("", "Resume: '' = no; 'auto' = the newest complete checkpoint under <output_dir>/checkpoints (none: "
               f"start at {unit} 0, so a requeued job can always pass it); or a path: a checkpoint folder "
               "(iter_NNNNNN, with its COMPLETE marker) or a run folder (its newest complete one). Continues exactly "
               f"where the checkpoint stopped ({state}).")


def _resume_force_field() -> Any:
    return opt(False, "Resume although world size, models, seed, data or batch arithmetic differ from the "
               "checkpoint's run (otherwise refused, naming every differing key); not an exact continuation.")


def _keep_last_field() -> Any:
    return opt(2, "Keep the newest K complete checkpoints; older complete ones are deleted after a new one is "
               "complete (0 = keep all). Incomplete folders are never deleted.")


def _save_minutes_field(unit: str) -> Any:
    return opt(0.0, f"Also save a checkpoint once M minutes have passed since the last one, at the next {unit} "
               "boundary, every rank agreeing (0 = off). For preemptible jobs: bounds the work lost to a kill that "
               "comes without a signal. Works beside save_interval.")


def _validate_checkpointing(p: Problems, cfg: Any) -> None:
    """resume / overwrite_output_dir / save_interval / keep_last, shared by PPO and the supervised steps."""
    if not isinstance(cfg.resume, str):
        p.add("resume", cfg.resume, "must be '' (no), 'auto' or a checkpoint path")
    elif cfg.resume and cfg.overwrite_output_dir is True:
        p.add("overwrite_output_dir", True, f"cannot be combined with resume ({cfg.resume!r}): resume continues "
              "the run in output_dir, overwrite_output_dir starts a new one; drop one of them")
    for n in ("save_interval", "keep_last"):
        v = getattr(cfg, n)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            p.add(n, v, "must be a whole number >= 0")
    m = cfg.save_interval_minutes
    if not isinstance(m, (int, float)) or isinstance(m, bool) or not m >= 0 or m == float("inf"):
        p.add("save_interval_minutes", m, "must be a number of minutes >= 0 (0 = off)")


def _dist_timeout_field() -> Any:
    return opt(None, "Timeout of every collective operation (and of the start-up rendezvous), in minutes: a "
               "rank that stalls or dies ends the job after this long instead of hanging. None = the "
               "DEEPSPEED_TIMEOUT environment variable, else 10 (PyTorch's default).")


PREEMPT_SIGNALS = ("USR1", "USR2", "TERM")


def _preempt_signals_field() -> Any:
    return opt("auto", "Signals that ask the run to stop at the next boundary with a complete checkpoint (exit 75), "
               "comma-separated from USR1, USR2, TERM. 'auto' = USR1, plus TERM inside a SLURM job. Outside SLURM "
               "TERM keeps its default (the launchers tear a failed job's ranks down with it); add TERM for "
               "torchrun elastic agents and Kubernetes, whose notice is a SIGTERM. The deepspeed launcher sends "
               "SIGKILL 30 s after its SIGTERM: see docs/checkpoints.md, Preemption, for the time a save needs.")


def _validate_preempt_signals(p: Problems, value: Any) -> None:
    names = [n.strip().upper().removeprefix("SIG") for n in str(value).split(",")] if value != "auto" else []
    if not isinstance(value, str) or not value.strip() or any(n not in PREEMPT_SIGNALS for n in names):
        p.add("preempt_signals", value, f"must be 'auto' or a comma-separated list of {', '.join(PREEMPT_SIGNALS)}")


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
    engine: EngineConfig = opt(None, "Engine extensions: LoRA reference, EMA, gather-once generation, Hybrid Engine.")
    env: EnvConfig = opt(None, "Multi-turn environments.")
    output_dir: str = opt("runs/ppo", "Run directory: metrics.jsonl, resolved configs, checkpoints.")
    max_steps: int = opt(10, "PPO iterations to run (one iteration = rollouts + ppo_epochs of updates).")
    num_train_epochs: int = opt(0, "Passes over the prompt data: the run stops after min(max_steps, "
                                "floor(num_train_epochs x batches_per_epoch / generation_batches)) iterations, "
                                "batches_per_epoch = floor(prompts / (per_device_generation_batch_size x world size)) "
                                "(0 = max_steps only). Raise max_steps to let the epochs decide.")
    seed: int = opt(1234, "Seed: data order depends on it; sampling uses seed + rank.")
    eval_interval: int = opt(0, "Evaluate (greedy generation on held-out prompts: eval/score, eval/eos_rate, "
                             "eval/response_length) before iteration 0, every N iterations, and after the last (0 = off).")
    eval_data_path: str = opt("", "Held-out prompts for evaluation (.jsonl etc.); '' = the eval_split of data_path.")
    reward_fn: str = opt("", "'module:function' scoring (prompts, responses) as text, one float each; replaces the "
                         "reward model (no reward engine is built) and the critic then starts from the actor.")
    reward_url: str = opt("", "A reward server instead of a reward model or function: each rank POSTs its batch as "
                          "JSON {prompts, responses, columns} and reads {scores} back (docs/rewards.md; reference "
                          "server: python -m rlhf_engine.rewards.serve). No reward engine is built.")
    reward_timeout_s: float = opt(60.0, "Seconds one reward_url request, or one reward_workers call, may take: a "
                                  "request is then retried, a worker call fails (reward_on_error).")
    reward_retries: int = opt(3, "reward_url: further attempts after a connection error, a timeout or a 5xx answer "
                              "(exponential backoff from 0.5 s); then the run stops naming the URL and the last "
                              "status.")
    reward_workers: int = opt(0, "Run reward_fn in N worker processes, one call per response, each limited to "
                              "reward_timeout_s (0 = in the trainer's process, one call per batch, no timeout). For "
                              "verifiers that run code: a hung or crashed call is contained.")
    reward_on_error: str = opt("stop", "reward_workers: what a call that raised, timed out or crashed its process "
                               "scores: 'stop' (the run stops naming the row; the default, so a broken verifier "
                               "is not mistaken for wrong answers) or a number (e.g. 0).")
    unsupervised_dataset_name: str = opt("", "PPO-ptx (InstructGPT): unsupervised text whose language-modelling loss "
                                         "is added to the actor loss: a local .txt file (one document per line), a "
                                         ".jsonl/.json/.parquet/.csv file with the column unsup_text_column, or a hub "
                                         "dataset name; '' = ptx off. Documents are cut to max_prompt_seq_len + "
                                         "max_answer_seq_len tokens.")
    unsup_text_column: str = opt("text", "Column holding the documents of a table-format unsupervised_dataset_name.")
    unsup_coef: float = opt(27.8, "ptx weight gamma: actor loss = policy loss + gamma x ptx loss, where the ptx loss "
                            "is the mean negative log-likelihood per token (nats/token) of the mini-batch's "
                            "unsupervised tokens on all ranks, as the policy loss is a per-token mean. 27.8 = "
                            "InstructGPT's and DeepSpeed-Chat's value. Used only with unsupervised_dataset_name.")
    dtype: str = opt("auto", "Default dtype of every role: auto (bf16 on GPUs that support it, fp16 on other GPUs, "
                     "fp32 on CPU; resolved at start-up, logged, and stored in the checkpoints' fingerprint), fp32, "
                     "bf16 or fp16.")
    overwrite_output_dir: bool = opt(False, "Start a new run in an output_dir that holds another run: its files "
                                     "are kept, moved aside as <name>.<timestamp>.bak (nothing is deleted or "
                                     "overwritten).")
    resume: str = _resume_field("iteration", "KL controller")
    resume_force: bool = _resume_force_field()
    save_interval: int = opt(0, "Save a checkpoint every N iterations to <output_dir>/checkpoints/iter_NNNNNN "
                             "(0 = only at the end; the end is always saved).")
    save_interval_minutes: float = _save_minutes_field("iteration")
    keep_last: int = _keep_last_field()
    export_final: bool = opt(True, "At the end, export the actor and critic (and the EMA) as Hugging Face folders "
                             "(ZeRO-3 consolidated, LoRA merged, tokenizer saved) to export_dir.")
    export_dir: str = opt("", "Where export_final writes <role>/ folders ('' = <output_dir>/final).")
    dist_timeout_minutes: Optional[float] = _dist_timeout_field()
    preempt_signals: str = _preempt_signals_field()

    def __post_init__(self) -> None:
        for name, cls in (("actor", RoleConfig), ("critic", RoleConfig), ("reference", RoleConfig),
                          ("reward", RoleConfig), ("ppo", PPOConfig), ("generation", GenerationConfig),
                          ("batch", BatchConfig), ("data", DataConfig), ("logging", LoggingConfig),
                          ("engine", EngineConfig), ("env", EnvConfig)):
            if getattr(self, name) is None:
                setattr(self, name, cls())

    @property
    def has_critic(self) -> bool:
        """Whether the advantage estimator needs a critic (rlhf_engine/estimators.py)."""
        from .estimators import ESTIMATORS

        est = ESTIMATORS.get(self.ppo.advantage_estimator)
        return est is None or est.needs_critic  # an unknown name is reported by validate()

    @property
    def scored_without_model(self) -> bool:
        """A reward function, a reward server or an environment scores the rollouts: no reward engine is built."""
        return bool(self.reward_fn or self.reward_url or self.env.on)

    @property
    def response_budget(self) -> int:
        """The most tokens after the prompt: max_answer_seq_len, or an episode's budget with an environment."""
        g = self.generation
        return self.env.episode_tokens(g.max_answer_seq_len) if self.env.on else g.max_answer_seq_len

    @property
    def reward_on_error_score(self) -> Optional[float]:
        """reward_on_error as a score, None for 'stop'."""
        return None if self.reward_on_error == "stop" else float(self.reward_on_error)

    @property
    def active_roles(self) -> tuple:
        """The roles the run has (each gets an engine, except a reference that is the actor's disabled adapter): no
        reward model when a reward function scores the rollouts, no critic when the estimator needs none. The one
        definition of the run's roles."""
        return tuple(r for r in ROLES if not (r == "reward" and self.scored_without_model)
                     and not (r == "critic" and not self.has_critic))

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
        self._validate_engine_extensions(p)
        self.ppo.validate(p)
        self.generation.validate(p)
        self.batch.validate(p)
        self.data.validate(p)
        self.logging.validate(p)
        self.env.validate(p)
        self._validate_environment(p)
        _validate_checkpointing(p, self)
        _choice(p, "", self, "dtype", DTYPES)
        _validate_dist_timeout(p, self.dist_timeout_minutes)
        _validate_preempt_signals(p, self.preempt_signals)
        _positive(p, "", self, "max_steps")
        _positive(p, "", self, "eval_interval", allow_zero=True)
        self._validate_trainer_extensions(p)
        self._validate_estimator(p)
        if self.eval_interval and not self.eval_data_path and not self.data.eval_split:
            p.add("eval_interval", self.eval_interval, "needs held-out prompts: set eval_data_path or eval_split")
        p.raise_if_any()
        return self

    def _validate_environment(self, p: Problems) -> None:
        """An environment scores its episodes itself; what shapes or cuts a single response does not apply."""
        if not self.env.on:
            return
        for name in ("reward_fn", "reward_url"):
            if getattr(self, name):
                p.add(name, getattr(self, name), f"and environment ({self.env.environment!r}) both score the "
                      "rollouts: the environment's step rewards are the episode's rewards; drop one")
        ppo, g = self.ppo, self.generation
        for name, off in (("normalize_reward", False), ("missing_eos_penalty", 0.0), ("overlong_buffer_len", 0)):
            if getattr(ppo, name) != off:
                p.add(name, getattr(ppo, name), "shapes a single response's score; with an environment the step "
                      "rewards are used as they are (shape them in the environment)")
        if _number(g.min_answer_seq_len) and g.min_answer_seq_len > 0:
            p.add("min_answer_seq_len", g.min_answer_seq_len, "counts from the response's start, which an episode's "
                  "later turns do not share: not supported with an environment")
        if self.engine.generation_backend == "hybrid":
            p.add("generation_backend", "hybrid", "sizes its inference cache for max_prompt_seq_len + "
                  "max_answer_seq_len, which an episode's later turns outgrow: use lean or hf with an environment")
        if _number(self.eval_interval) and self.eval_interval > 0:
            p.add("eval_interval", self.eval_interval, "evaluates single responses with a reward model or function; "
                  "evaluation by playing episodes is not built yet: set it to 0 with an environment")

    def _validate_estimator(self, p: Problems) -> None:
        """Group sizes, and no critic setting in a run without a critic (it would be silently ignored)."""
        from .estimators import ESTIMATORS, GROUP_ESTIMATORS

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

    def _validate_trainer_extensions(self, p: Problems) -> None:
        """ptx, epochs (the guards, reward shaping and critic warm-up fields are checked by PPOConfig)."""
        if not isinstance(self.num_train_epochs, int) or isinstance(self.num_train_epochs, bool) or \
                self.num_train_epochs < 0:
            p.add("num_train_epochs", self.num_train_epochs, "must be a whole number >= 0 (0 = max_steps only)")
        if not isinstance(self.unsupervised_dataset_name, str):
            p.add("unsupervised_dataset_name", self.unsupervised_dataset_name, "must be a path or dataset name")
        if not isinstance(self.unsup_text_column, str) or not self.unsup_text_column:
            p.add("unsup_text_column", self.unsup_text_column, "must name a column")
        _positive(p, "", self, "unsup_coef", allow_zero=True)
        if self.unsupervised_dataset_name and self.batch.max_tokens_per_micro_batch:
            p.add("max_tokens_per_micro_batch", self.batch.max_tokens_per_micro_batch, "PPO-ptx pairs each "
                  "micro-batch with gradient_accumulation_steps ptx micro-batches; token-budget micro-batches vary "
                  "in number: not with unsupervised_dataset_name")
        for name in ("tokenizer_name_or_path", "use_chat_template"):
            if getattr(self.reward, name) and self.scored_without_model:
                by = "reward_fn" if self.reward_fn else "reward_url"
                p.add(f"reward_{name}", getattr(self.reward, name), f"is for a reward model; {by} "
                      f"({getattr(self, by)!r}) replaces it: drop one")
        self._validate_reward_sources(p)
        for role in ("actor", "critic", "reference"):
            if getattr(self, role).use_chat_template:
                p.add(f"{role}_use_chat_template", True, "is for the reward role only (reward_use_chat_template); "
                      "the actor's prompts follow use_chat_template")

    def _validate_reward_sources(self, p: Problems) -> None:
        """reward_fn, reward_url and their settings: one source, settings that fit it."""
        if self.reward_fn and self.reward_url:
            p.add("reward_url", self.reward_url, f"and reward_fn ({self.reward_fn!r}) both score the rollouts: drop "
                  "one")
        if self.reward_url and not str(self.reward_url).startswith(("http://", "https://")):
            p.add("reward_url", self.reward_url, "must be an http:// or https:// URL")
        if not (_number(self.reward_timeout_s) and self.reward_timeout_s > 0):
            p.add("reward_timeout_s", self.reward_timeout_s, "must be > 0 (seconds)")
        if not (isinstance(self.reward_retries, int) and self.reward_retries >= 0):
            p.add("reward_retries", self.reward_retries, "must be a whole number >= 0")
        if not (isinstance(self.reward_workers, int) and self.reward_workers >= 0):
            p.add("reward_workers", self.reward_workers, "must be a whole number >= 0 (0 = in-process)")
        elif self.reward_workers and not self.reward_fn:
            p.add("reward_workers", self.reward_workers, "runs a reward_fn in worker processes: set reward_fn (a "
                  "reward_url server runs its own workers)")
        on_error = self.reward_on_error
        try:
            ok = on_error == "stop" or math.isfinite(float(on_error))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            p.add("reward_on_error", on_error, "must be 'stop' or a finite score, e.g. 0")
        elif on_error != "stop" and not self.reward_workers:
            p.add("reward_on_error", on_error, "scores failed worker calls: it needs reward_workers >= 1 (in-process "
                  "a failing reward function stops the run)")

    def _validate_engine_extensions(self, p: Problems) -> None:
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
            if rc.lora_dim and _number(rc.lora_dropout) and rc.lora_dropout != 0:
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


# ---- flat keys (flags, config files, config.json) ---------------------------------------------------------------
def flat_fields(cfg: Any) -> dict[str, tuple[Any, dataclasses.Field, str, str]]:
    """flat key -> (owner object, field, help-group title, help-group text) for every leaf field of the config.

    The flat key is the flag and config-file key: a nested section's fields are prefixed by its field's
    `flag_prefix` metadata (default `<field>_` for a `RoleConfig`, nothing otherwise); `skip_flags` leaves fields
    out."""
    out: dict[str, tuple[Any, dataclasses.Field, str, str]] = {}

    def put(key: str, owner: Any, f: dataclasses.Field, title: str, doc: str) -> None:
        if key in out:  # two sections with the same field name would silently share one flag
            raise RuntimeError(f"config key {key!r} is defined twice; rename one of the fields")
        out[key] = (owner, f, title, doc)

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(value):
            put(f.name, cfg, f, type(cfg).__name__, (type(cfg).__doc__ or "").strip())
            continue
        is_role = isinstance(value, RoleConfig)
        prefix = f.metadata.get("flag_prefix", f"{f.name}_" if is_role else "")
        skip = set(f.metadata.get("skip_flags", ()))
        if is_role:  # one group per role, not one "RoleConfig" group holding all four
            title = f"{f.name} role" if prefix else f.name
            doc = f"{f.metadata.get('help', '')} Flags: --{prefix}<field>."
        else:
            title, doc = type(value).__name__, (type(value).__doc__ or "").strip()
        for g in dataclasses.fields(value):
            if g.name not in skip:
                put(f"{prefix}{g.name}", value, g, title, doc)
    return out


def flat_dict(cfg: Any) -> dict:
    """The resolved config as flat keys (what a config file, config.json and wandb's config hold)."""
    return {k: getattr(owner, f.name) for k, (owner, f, _, _) in flat_fields(cfg).items()}


# ---- steps 1 and 2: supervised fine-tuning and reward-model training ------------------------------------------------
LONG_RESPONSE_POLICIES = ("error", "skip", "truncate")


@dataclass
class SupervisedConfig:
    """Training loop of steps 1 and 2 (SFT and reward model): epochs, batches, sequence lengths."""

    num_train_epochs: int = opt(1, "Passes over the training data.")
    max_steps: int = opt(0, "Stop after this many optimizer steps (0 = run every epoch).")
    per_device_training_batch_size: int = opt(8, "Samples (SFT) or pairs (reward model) per rank in one "
                                              "forward/backward (micro-batch).")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step: a mini-batch is "
                                           "per_device_training_batch_size x gradient_accumulation_steps per rank.")
    per_device_eval_batch_size: int = opt(8, "Samples or pairs per rank in one evaluation forward.")
    max_prompt_seq_len: int = opt(256, "Longest prompt in tokens after templates (the PPO flag of the same name; "
                                  "longer prompts follow long_prompt_policy).")
    max_answer_seq_len: int = opt(256, "Longest response in tokens, its appended EOS included (the PPO flag of the "
                                  "same name: PPO generates at most this many tokens); longer ones follow "
                                  "long_response_policy.")
    long_response_policy: str = opt("error", "Responses longer than max_answer_seq_len tokens (EOS included): "
                                    "'error' (stop, naming them), 'skip' (drop the row and count it) or 'truncate' "
                                    "(keep the first max_answer_seq_len tokens, no EOS, like a PPO response cut at "
                                    "the length limit).")

    def validate(self, p: Problems, prefix: str = "") -> None:
        names = ("num_train_epochs", "per_device_training_batch_size", "gradient_accumulation_steps",
                 "per_device_eval_batch_size", "max_prompt_seq_len", "max_answer_seq_len")
        _positive(p, prefix, self, *names)
        _positive(p, prefix, self, "max_steps", allow_zero=True)
        for n in names + ("max_steps",):
            if _number(getattr(self, n)) and not isinstance(getattr(self, n), int):
                p.add(prefix + n, getattr(self, n), "must be a whole number")
        _choice(p, prefix, self, "long_response_policy", LONG_RESPONSE_POLICIES)

    @property
    def mini_batch_size(self) -> int:
        """Samples (or pairs) per rank per optimizer step."""
        return self.per_device_training_batch_size * self.gradient_accumulation_steps


@dataclass
class _SupervisedRun:
    """Fields shared by SFTConfig and RewardTrainConfig (their flags are flat: --model_name_or_path, --zero_stage)."""

    # `flag_prefix=""`: the one model's fields are flat flags; `critic_init_from` means nothing here
    model: RoleConfig = opt(None, "The model trained (its RoleConfig fields as flat flags; zero_stage None = 0).",
                            flag_prefix="", skip_flags=("init_from", "use_chat_template"))
    train: SupervisedConfig = opt(None, "Epochs, batches, lengths.")
    data: DataConfig = opt(None, "Training data.")
    logging: LoggingConfig = opt(None, "Metrics sinks besides metrics.jsonl.")
    output_dir: str = opt("runs/step", "Run directory: metrics.jsonl, resolved configs; the trained model goes to "
                          "<output_dir>/model (Hugging Face format).")
    seed: int = opt(1234, "Seed: data order (seed + epoch) and any new weights (a new score head).")
    overwrite_output_dir: bool = opt(False, "Start a new run in an output_dir that holds another run: its files "
                                     "are kept, moved aside as <name>.<timestamp>.bak.")
    save_interval: int = opt(0, "Save a checkpoint every N optimizer steps to <output_dir>/checkpoints/iter_NNNNNN, "
                             "and one at the end (0 = no checkpoints: the result is the exported model).")
    save_interval_minutes: float = _save_minutes_field("optimizer-step")
    keep_last: int = _keep_last_field()
    resume: str = _resume_field("step")
    resume_force: bool = _resume_force_field()
    dist_timeout_minutes: Optional[float] = _dist_timeout_field()
    preempt_signals: str = _preempt_signals_field()

    def __post_init__(self) -> None:
        # the one model: dtype auto unless told otherwise (no run-level dtype here), a fine-tuning learning rate
        for name, make in (("model", lambda: RoleConfig(dtype="auto", learning_rate=1e-5)), ("train", SupervisedConfig),
                           ("data", DataConfig), ("logging", LoggingConfig)):
            if getattr(self, name) is None:
                setattr(self, name, make())

    def _validate_common(self, p: Problems) -> None:
        self.model.validate(p)
        if not self.model.model_name_or_path:
            p.add("model_name_or_path", "", "give a local model folder or hub id")
        if not self.model.dtype:
            p.add("dtype", "", f"must be one of {', '.join(DTYPES)}")
        if self.model.offload_params is True and self.model.zero_stage is None:
            p.add("offload_params", True, "parameter offload needs ZeRO stage 3 and zero_stage defaults to 0: set "
                  "zero_stage 3 (or drop offload_params)")
        self.train.validate(p)
        self.data.validate(p)
        self.logging.validate(p)
        if not self.data.data_path:
            p.add("data_path", self.data.data_path, "give a .jsonl/.json/.parquet/.csv file (or a blend)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            p.add("seed", self.seed, "must be an integer")
        _validate_checkpointing(p, self)
        _validate_dist_timeout(p, self.dist_timeout_minutes)
        _validate_preempt_signals(p, self.preempt_signals)

    def validate(self):
        p = Problems()
        self._validate_common(p)
        self._validate_own(p)
        p.raise_if_any()
        return self

    def _validate_own(self, p: Problems) -> None:
        pass

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _column(p: Problems, obj: Any, name: str) -> None:
    v = getattr(obj, name)
    if not isinstance(v, str) or not v:
        p.add(name, v, "must name a column")


@dataclass
class SFTConfig(_SupervisedRun):
    """Step 1: supervised fine-tuning of a causal LM on (prompt, response) rows; the loss is on response tokens
    (and their EOS) only."""

    response_column: str = opt("response", "Column holding the response the model learns to write after the prompt "
                               "(the tokenizer's EOS is appended, as PPO responses end with it).")
    output_dir: str = opt("runs/sft", "Run directory: metrics.jsonl, resolved configs; the trained causal LM goes to "
                          "<output_dir>/model (Hugging Face format; train_ppo.py's --actor_model_name_or_path).")

    def _validate_own(self, p: Problems) -> None:
        _column(p, self, "response_column")
        if self.response_column == self.data.prompt_column:
            p.add("response_column", self.response_column, "must differ from prompt_column")


@dataclass
class RewardTrainConfig(_SupervisedRun):
    """Step 2: a pairwise reward model on (prompt, chosen, rejected) rows: loss = mean over pairs of
    -log sigmoid(score(chosen) - score(rejected) - margin), each score read at the response's EOS."""

    chosen_column: str = opt("chosen", "Column holding the preferred response.")
    rejected_column: str = opt("rejected", "Column holding the dispreferred response.")
    margin: float = opt(0.0, "Margin m of the loss -log sigmoid(s_chosen - s_rejected - m): > 0 asks for a score gap "
                        "of at least about m (0 = the plain Bradley-Terry loss).")
    output_dir: str = opt("runs/reward", "Run directory: metrics.jsonl, resolved configs; the reward model goes to "
                          "<output_dir>/model as a *ForSequenceClassification (one label; train_ppo.py's "
                          "--reward_model_name_or_path, and the critic's start).")

    def _validate_own(self, p: Problems) -> None:
        _column(p, self, "chosen_column")
        _column(p, self, "rejected_column")
        cols = [self.data.prompt_column, self.chosen_column, self.rejected_column]
        if len(set(cols)) < 3:
            p.add("rejected_column" if self.chosen_column != self.rejected_column else "chosen_column",
                  cols, "prompt_column, chosen_column and rejected_column must be three different columns")
        if not _number(self.margin) or self.margin < 0:
            p.add("margin", self.margin, "must be >= 0")
