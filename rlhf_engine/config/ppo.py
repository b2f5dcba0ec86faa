"""PPO's hyperparameters and each estimator family's defaults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import Problems
from .fields import check_choice, check_positive, is_number, opt


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

# Likewise per policy loss, applied after the estimator's (a loss's own aggregation wins over the family's): GSPO's
# ratio is already a per-response mean, so a token mean over the batch would weight long responses again; verl runs
# GSPO with seq-mean-token-mean.
POLICY_LOSS_DEFAULTS = {"gspo": {"loss_agg_mode": "seq_mean_token_mean"}}

# Likewise per generation backend: an inference engine's kernels are not the trainer's, so its samples come from a
# slightly different policy; a capped per-token weight (truncated importance sampling) corrects for it at no risk
# when the two agree (docs/rollout-engines.md says why this and not TRL's or verl's choice).
BACKEND_DEFAULTS = {"vllm": {"rollout_correction": "token_truncate"}}
# the rollout corrections that leave the policy mask (and so every token count) as it is: their weights scale the
# loss only, so the first mini-batch's forward may compute them for its own rows (PPOConfig.defers_old_logprobs)
DEFERRABLE_CORRECTIONS = ("none", "token_truncate", "sequence_truncate")


# Rollouts generated ahead of training (max_staleness >= 1) come from an older policy: AReaL's decoupled objective
# weights them by the trainer's over the behaviour policy's probability; capped, as above. Their log-prob difference
# is the policy's own change over the versions in between, not an engine's error: the mismatch guard is off.
AHEAD_DEFAULTS = {"rollout_correction": "token_truncate", "max_rollout_logprob_diff": 0.0}


# The default of max_rollout_logprob_diff (nats): far above what an engine that holds the actor's weights gives
# (fp32: 1e-6; bf16: 0.13-0.34 measured on SmolLM2-135M, a few nats published for large bf16 MoE pairs), below what
# a broken one gives (docs/rollout-engines.md, "A push that proves itself", has the measurements).
MAX_ROLLOUT_LOGPROB_DIFF = 10.0


def run_defaults(ppo: Any, backend: str = "", ahead: bool = False) -> dict:
    """The defaults the run's estimator family, policy loss, generation backend and rollouts ahead of training ask
    for (`ESTIMATOR_DEFAULTS`, `POLICY_LOSS_DEFAULTS`, `BACKEND_DEFAULTS`, then `AHEAD_DEFAULTS`), by PPO field."""
    return {**ESTIMATOR_DEFAULTS.get(ppo.advantage_estimator, {}), **POLICY_LOSS_DEFAULTS.get(ppo.policy_loss, {}),
            **BACKEND_DEFAULTS.get(backend, {}), **(AHEAD_DEFAULTS if ahead else {})}


def rollouts_ahead_of_training(cfg: Any) -> bool:
    return cfg.rollout.ahead


def experience_from_update(cfg: Any) -> bool:
    """Whether an iteration whose actor trains takes its actor's and critic's experience forwards from its training
    forwards (`old_logprobs_from_update`; trainer/ppo_trainer.py): the rank's rows are one micro-batch of the one
    mini-batch of the one epoch, so the first training forwards see exactly the experience forwards' rows, layout
    and weights, and nothing else would read them. The reference and reward forwards stay in the experience phase.
    Not where the reference replays the actor's kept frozen prefix (`reuse_frozen_prefix`): without the actor's
    experience forward the prefix would run twice, in the reference's and the training forward. `cfg`: a
    TrainConfig."""
    ppo, b = cfg.ppo, cfg.batch
    # one training micro-batch, and the reference's and reward's forwards over the same rows in one chunk (the
    # KL's two log-probs from equal tensors: 0 at lr 0)
    one_micro_batch = b.gradient_accumulation_steps == 1 and b.per_device_training_batch_size >= b.rollout_size \
        and not b.max_tokens_per_micro_batch and (b.experience_micro_batch_size or b.generation_rollouts) >= \
        b.rollout_size
    prefix_for_reference = ppo.reads_reference and bool(cfg.actor.trainable_layers) and \
        cfg.engine.reuse_frozen_prefix and cfg.actor.zero_stage != 3
    return ppo.old_logprobs_from_update is True and ppo.ppo_epochs == 1 and one_micro_batch and \
        not prefix_for_reference


def apply_estimator_defaults(cfg: Any, explicit: set) -> dict:
    """Set the estimator family's, the policy loss's and the generation backend's defaults (`run_defaults`) on the
    PPO fields of `cfg` (a TrainConfig) that are not in `explicit` (the flat keys a run gave); returns what was
    set."""
    applied = {}
    for key, value in run_defaults(cfg.ppo, cfg.engine.requested_backend[0], rollouts_ahead_of_training(cfg)).items():
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
    monitor_reference_kl: bool = opt(False, "Build the reference and log objective/kl even where no KL term reads "
                                     "it (kl_coef 0, kl_loss_coef 0, no adaptive_kl): a reference forward per "
                                     "iteration for a monitor. Off, such a run builds no reference engine (memory "
                                     "and time) and logs no objective/kl; with a KL term the KL is always logged.")
    old_logprobs_from_update: bool = opt(True, "Where nothing reads the old log-probs before training (no "
                                         "reference; rollout_correction none or a truncate mode, whose weights the "
                                         "training forward computes for its own rows) and ppo_epochs is 1, the "
                                         "first mini-batch's old log-probs are its own training forward's, "
                                         "detached: the policy has not moved yet, so its ratios are exactly 1 (as "
                                         "TRL does); the experience forward runs only on the later mini-batches' "
                                         "rows. Where an iteration's rows are one micro-batch of one mini-batch "
                                         "(ppo_epochs 1), the actor's and critic's experience forwards are the "
                                         "update's training forwards, with a reference too: the rewards and "
                                         "advantages are computed between those forwards and their losses (both "
                                         "graphs held at once). false = every row's old log-probs and values from "
                                         "the experience forwards.")
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
    max_rollout_logprob_diff: float = opt(MAX_ROLLOUT_LOGPROB_DIFF, "Stop the run when rollout/logprob_diff_max (the "
                                          "largest |generation-time - trainer| log-prob of a sampled token in an "
                                          "iteration, nats) exceeds this for 3 iterations in a row (warned the "
                                          "first time): the generation backend samples from another policy (a "
                                          "missed weight push, other kernels, a dtype mismatch). fp32 measures "
                                          "1e-6, bf16 up to a few nats on large models; 0 = off, and off by "
                                          "default with rollouts ahead of training (their difference is the "
                                          "policy's own change).")
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

    @property
    def reads_reference(self) -> bool:
        """Whether anything of the run reads reference log-probs: a KL term (the reward's penalty, the adaptive
        controller, the KL loss) or the monitor. Without it no reference engine is built."""
        kl_term = (is_number(self.kl_coef) and self.kl_coef > 0) or bool(self.adaptive_kl) or \
            (is_number(self.kl_loss_coef) and self.kl_loss_coef > 0)
        return kl_term or self.monitor_reference_kl is True

    @property
    def defers_old_logprobs(self) -> bool:
        """Whether the first mini-batch takes its old log-probs from its own training forward
        (`old_logprobs_from_update`): only where nothing reads them before training (no reference: KL terms and the
        monitor; no rollout correction that masks tokens, which changes the mini-batch's token counts before its
        first forward: a truncate mode's weights scale the loss only, and the forward computes them for its rows)
        and one epoch reads them once (a later epoch would recompute the rows' frozen prefix, which the experience
        forward keeps)."""
        return self.old_logprobs_from_update is True and self.ppo_epochs == 1 and not self.reads_reference and \
            self.rollout_correction in DEFERRABLE_CORRECTIONS

    def validate(self, p: Problems, prefix: str = "") -> None:
        check_positive(p, prefix, self, "ppo_epochs", "kl_horizon")
        check_positive(p, prefix, self, "missing_eos_penalty", allow_zero=True)
        for n in ("critic_warmup_iterations", "max_consecutive_skips"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                p.add(prefix + n, v, "must be a whole number >= 0")
        if not isinstance(self.normalize_reward, bool):
            p.add(prefix + "normalize_reward", self.normalize_reward, "must be true or false")
        check_positive(p, prefix, self, "kl_coef", "kl_target", "clip_eps", "value_clip", "reward_clip", "entropy_coef",
                  allow_zero=True)
        from ..estimators import ESTIMATORS
        from ..ppo_math import KL_ESTIMATORS, LOSS_AGG_MODES, RENAMED_CORRECTIONS, ROLLOUT_CORRECTIONS

        if self.rollout_correction in RENAMED_CORRECTIONS:
            p.add(prefix + "rollout_correction", self.rollout_correction, f"was renamed: use "
                  f"{RENAMED_CORRECTIONS[self.rollout_correction]} (docs/sampling.md: the four modes)")
        else:
            check_choice(p, prefix, self, "rollout_correction", ROLLOUT_CORRECTIONS)
        from ..policy_losses import POLICY_LOSSES

        check_choice(p, prefix, self, "policy_loss", tuple(POLICY_LOSSES))
        if self.dual_clip is not None and self.policy_loss != "ppo_clip":
            p.add(prefix + "dual_clip", self.dual_clip, f"is a ppo_clip setting; policy_loss {self.policy_loss} has "
                  "no dual clip: drop it")
        check_choice(p, prefix, self, "kl_loss_estimator", KL_ESTIMATORS)
        check_choice(p, prefix, self, "loss_agg_mode", LOSS_AGG_MODES)
        for n in ("monitor_reference_kl", "old_logprobs_from_update"):
            if not isinstance(getattr(self, n), bool):
                p.add(prefix + n, getattr(self, n), "must be true or false")
        check_positive(p, prefix, self, "kl_loss_coef", "overlong_buffer_len", "overlong_penalty_factor", allow_zero=True)
        if self.clip_eps_high is not None and not (is_number(self.clip_eps_high) and self.clip_eps_high >= 0):
            p.add(prefix + "clip_eps_high", self.clip_eps_high, "must be >= 0 (or None for clip_eps)")
        if self.advantage_estimator != "gae" and self.whiten_advantages is not None:
            p.add(prefix + "whiten_advantages", self.whiten_advantages, f"applies to gae only; "
                  f"{self.advantage_estimator} normalizes its own advantages: drop it")
        check_positive(p, prefix, self, "max_rollout_logprob_diff", allow_zero=True)
        if not (is_number(self.rollout_correction_cap) and self.rollout_correction_cap > 1.0):
            p.add(prefix + "rollout_correction_cap", self.rollout_correction_cap, "must be > 1")
        check_choice(p, prefix, self, "kl_estimator", KL_ESTIMATORS)
        check_choice(p, prefix, self, "advantage_estimator", tuple(ESTIMATORS))
        for n in ("gamma", "lam"):
            v = getattr(self, n)
            if not is_number(v) or not 0.0 <= v <= 1.0:
                p.add(prefix + n, v, "must lie in [0, 1]")
        if self.dual_clip is not None and not (is_number(self.dual_clip) and self.dual_clip > 1.0):
            p.add(prefix + "dual_clip", self.dual_clip, "must be > 1 (or None to disable dual clipping)")
        if self.adaptive_kl is True and is_number(self.kl_target) and self.kl_target <= 0:
            p.add(prefix + "kl_target", self.kl_target, "must be > 0 with adaptive_kl (the controller divides by it)")


    @property
    def whitens(self) -> bool:
        """Whether GAE advantages are whitened (whiten_advantages; None = on for gae)."""
        return self.advantage_estimator == "gae" and self.whiten_advantages is not False

    @property
    def upper_clip(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
