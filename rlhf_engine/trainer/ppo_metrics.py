"""The PPO iteration's metrics beside the math they describe: what each phase adds to the iteration's `MetricSums`
(on device, no host sync), and the record built from the all-reduced sums (the keys of docs/metrics.md).

Per-token means are token-weighted over every rank; losses are each micro-batch's share of its mini-batch's global
token mean, so their sum over an iteration divided by the mini-batches is the per-mini-batch mean.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..rollout import Experience
from .experience import moments_from_sums
from .metric_sums import MetricSums


def add_experience_stats(stats: MetricSums, exp: Experience, entropy: torch.Tensor, raw_scores: torch.Tensor,
                         shaped: bool) -> None:
    """objective/*, rollout/*: one rollout buffer."""
    mask = exp.rollout.action_mask
    stats.add("entropy_sum", (entropy * mask).sum())
    stats.add("tokens", mask.sum())
    mask = mask.float()
    stats.add("sequences", torch.tensor(float(exp.batch_size)))
    stats.add("score_sum", raw_scores.sum())
    if shaped:
        stats.add("shaped_score_sum", exp.scores.sum())
    if exp.ref_logprobs is not None:  # no reference (nothing reads it): no objective/kl
        k1 = ((exp.old_logprobs - exp.ref_logprobs) * mask).sum(-1)  # objective/kl is always the k1 sequence sum
        stats.add("kl_sum", k1.sum())
    stats.add("rlhf_reward_sum", (exp.rewards * mask).sum())
    stats.add("response_length_sum", exp.rollout.response_lengths.sum())
    stats.add("eos_sum", exp.rollout.ended_with_eos.sum())


def add_value_moments(stats: MetricSums, exp: Experience) -> None:
    """The sums `explained_var` needs (count, sum and sum of squares of the returns and of returns - values), reduced
    with the iteration's other metrics instead of two collectives of their own."""
    mask = exp.rollout.action_mask.double()  # float64 from the first product: the sum of squares cancels later
    ret = exp.returns.double() * mask
    res = (exp.returns.double() - exp.values.double()) * mask
    stats.add("ev_n", mask.sum())
    for name, x in (("ret", ret), ("res", res)):
        stats.add(f"ev_{name}_s", x.sum())
        stats.add(f"ev_{name}_ss", (x * x).sum())


def explained_var(s: dict) -> Optional[float]:
    """value/explained_var from the reduced sums of `add_value_moments`: 1 - Var[returns - values] / Var[returns]
    (unbiased variances over every rank's real tokens; None when Var[returns] is 0 or the run has no critic)."""
    if "ev_n" not in s:
        return None
    def var(name: str) -> float:
        sums = torch.tensor([s["ev_n"], s[f"ev_{name}_s"], s[f"ev_{name}_ss"]], dtype=torch.float64)
        return float(moments_from_sums(*sums)[1])

    var_ret = var("ret")
    return 1.0 - var("res") / var_ret if var_ret > 0 else None


def add_rollout_check(stats: MetricSums, rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      mask: torch.Tensor) -> None:
    """rollout/logprob_diff_*, rollout/seq_logratio_max: generation-time vs recomputed old log-probs over real
    tokens (about 0 for an exact backend in fp32; the alarm for a fast or approximate one)."""
    d = (old_logprobs - rollout_logprobs) * mask
    stats.add("gen_lp_absdiff_sum", d.abs().sum())
    stats.max("gen_lp_absdiff_max", d.abs().max())
    stats.max("seq_logratio_max", d.sum(-1).abs().max())


def add_on_policy_stats(stats: MetricSums, rows: Experience, old_logprobs: torch.Tensor,
                        entropy: torch.Tensor, correction: Optional[tuple] = None) -> None:
    """The experience metrics of rows whose old log-probs came from their first training forward
    (`PPOConfig.defers_old_logprobs`): their entropy, rollout check and rollout correction (`correction`: (mode,
    weights, its stats) or None), added where the experience left them out (its `tokens` counted them already)."""
    mask = rows.rollout.action_mask
    stats.add("entropy_sum", (entropy * mask).sum())
    if rows.rollout_logprobs is not None:
        add_rollout_check(stats, rows.rollout_logprobs, old_logprobs, mask)
    if correction is not None:
        add_correction_stats(stats, correction[0], correction[2])


def add_correction_stats(stats: MetricSums, mode: str, cs: dict) -> None:
    """rollout/correction_capped_frac (truncate modes: share of real tokens whose weight was cut to the cap),
    rollout/correction_masked_frac (mask modes: share of real tokens masked out of the policy loss),
    rollout/correction_masked_seq_frac (sequence_mask: share of responses masked out), rollout/correction_weight_dev_max
    (the largest |weight - 1| of a kept token: 0 when nothing was corrected)."""
    stats.max("correction_weight_dev_max", cs["weight_dev_max"])
    if mode.endswith("truncate"):
        stats.add("correction_capped", cs["capped"])
        return
    stats.add("correction_masked", cs["masked"])
    if mode == "sequence_mask":
        stats.add("correction_masked_seqs", cs["masked_seqs"])


def add_policy_stats(stats: MetricSums, loss: torch.Tensor, ps: dict) -> None:
    """policy/*, actor/loss: one actor micro-batch (`loss`: the actor's whole loss; `ps`: its stats, with the policy
    term alone in `policy_term`)."""
    t = ps["tokens"]
    stats.add("actor_loss", loss.detach())
    stats.add("policy_loss", ps["policy_term"])
    if "kl_loss" in ps:
        stats.add("kl_loss", ps["kl_loss"])
    stats.add("approx_kl_sum", ps["approx_kl"] * t)
    stats.add("clipfrac_sum", ps["clipfrac"] * t)
    stats.add("ratio_sum", ps["ratio_mean"] * t)
    stats.add("train_tokens", t)
    # a micro-batch without real tokens must not contribute its neutral ratio 1
    stats.max("ratio_max", torch.where(t > 0, ps["ratio_max"], -torch.inf))
    stats.min("ratio_min", torch.where(t > 0, ps["ratio_min"], torch.inf))


def add_value_stats(stats: MetricSums, vloss: torch.Tensor, vs: dict) -> None:
    """value/*: one critic micro-batch (`vs`: value_loss's stats)."""
    stats.add("value_loss", vloss.detach())
    stats.add("value_clipfrac_sum", vs["clipfrac"] * vs["tokens"])
    stats.add("value_tokens", vs["tokens"])


@torch.no_grad()
def max_abs_diff(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max |log-ratio| over real tokens, fp64 (the ratio trace the tests and guards read)."""
    return ((logprobs.detach() - old_logprobs) * mask).abs().max().double()


def iteration_record(s: dict, world_size: int) -> dict:
    """The objective/, policy/, actor/, ptx/, value/, rollout/, env/ and reward/ keys from the reduced sums `s` of
    one iteration."""
    n_seq, tokens = s["sequences"], s["tokens"]
    train_tokens = s.get("train_tokens", 0.0)
    minibatches = s["minibatches"] / world_size  # every rank counted each mini-batch
    rec = {
        "objective/score": s["score_sum"] / n_seq,
        "objective/rlhf_reward": s["rlhf_reward_sum"] / n_seq,
        "objective/entropy": s["entropy_sum"] / tokens if tokens else None,
    }
    if "kl_sum" in s:  # a run with a reference
        rec["objective/kl"] = s["kl_sum"] / n_seq
    if "shaped_score_sum" in s:
        rec["objective/shaped_score"] = s["shaped_score_sum"] / n_seq
    if "policy_loss" in s:  # the actor trained (not a critic warm-up iteration)
        rec.update({
            "policy/loss": s["policy_loss"] / minibatches,  # the policy term alone
            "actor/loss": s["actor_loss"] / minibatches,  # what the actor's backward saw: + KL loss - entropy term
            "policy/approx_kl": s["approx_kl_sum"] / train_tokens if train_tokens else None,
            "policy/clipfrac": s["clipfrac_sum"] / train_tokens if train_tokens else None,
            "policy/ratio_mean": s["ratio_sum"] / train_tokens if train_tokens else None,
            "policy/ratio_max": s.get("ratio_max"),
            "policy/ratio_min": s.get("ratio_min"),
        })
    if "kl_loss" in s:
        rec["policy/kl_loss"] = s["kl_loss"] / minibatches  # per mini-batch, without kl_loss_coef
    if "uniform_rows" in s:
        rec["rollout/uniform_group_rate"] = s["uniform_rows"] / n_seq  # groups of equal size: rows = groups share
    if "ptx_loss" in s:
        rec["ptx/loss"] = s["ptx_loss"] / minibatches  # token mean per mini-batch, without unsup_coef
        rec["ptx/tokens"] = s["ptx_tokens"]
    if "value_loss" in s:  # a run with a critic
        value_tokens = s["value_tokens"]
        rec.update({
            "value/loss": s["value_loss"] / minibatches,
            "value/clipfrac": s["value_clipfrac_sum"] / value_tokens if value_tokens else None,
            "value/explained_var": explained_var(s),
        })
    if "gen_lp_absdiff_sum" in s:
        rec.update({"rollout/logprob_diff_mean": s["gen_lp_absdiff_sum"] / tokens if tokens else None,
                    "rollout/logprob_diff_max": s["gen_lp_absdiff_max"],
                    "rollout/seq_logratio_max": s["seq_logratio_max"]})
    if "correction_capped" in s:
        rec["rollout/correction_capped_frac"] = s["correction_capped"] / tokens if tokens else None
    if "correction_masked" in s:
        rec["rollout/correction_masked_frac"] = s["correction_masked"] / tokens if tokens else None
    if "correction_weight_dev_max" in s:
        rec["rollout/correction_weight_dev_max"] = s["correction_weight_dev_max"]
    if "correction_masked_seqs" in s:
        rec["rollout/correction_masked_seq_frac"] = s["correction_masked_seqs"] / n_seq
    for key in ("peak_rss_mib", "peak_device_mib"):  # the largest rank's peak so far
        if key in s:
            rec[f"memory/{key}"] = s[key]
    if s.get("slots_padded"):  # the experience and training forwards' slots (rlhf_engine/packing.py)
        rec["batch/padding_fraction"] = 1.0 - s["slots_real"] / s["slots_padded"]
        if s.get("slots_packed"):
            rec["batch/packed_padding_fraction"] = 1.0 - s["slots_real"] / s["slots_packed"]
    if "prefix_hits" in s:  # the frozen prefix (engine/frozen_prefix.py): share of the later forwards that reused it
        later = s["prefix_hits"] + s["prefix_misses"]
        rec["batch/frozen_prefix_reused"] = s["prefix_hits"] / later if later else None
        rec["memory/frozen_prefix_mib"] = s["prefix_mib"]  # the largest rank's kept outputs
    if "micro_batches" in s:
        rec["batch/micro_batches"] = s["micro_batches"] / world_size
        rec["batch/empty_micro_batches"] = s["empty_micro_batches"] / world_size
    if "env_episodes" in s:
        rec.update(episode_record(s))
    if "reward_worker_timeouts" in s:  # --reward_workers: calls killed at --reward_timeout_s, processes replaced
        rec["reward/worker_timeouts"] = int(s["reward_worker_timeouts"])
        rec["reward/worker_restarts"] = int(s["reward_worker_restarts"])
    rec.update({
        "rollout/response_length": s["response_length_sum"] / n_seq,
        "rollout/eos_rate": s["eos_sum"] / n_seq,
        "rollout/truncated_rate": 1.0 - s["eos_sum"] / n_seq,
    })
    return rec


def episode_record(s: dict) -> dict:
    """env/*: multi-turn episodes (rlhf_engine/envs), over every rank's episodes of the iteration."""
    n = max(s["env_episodes"], 1.0)
    rec = {"env/turns_mean": s["env_turns"] / n, "env/observation_tokens_mean": s["env_observation_tokens"] / n,
           "env/truncated_rate": s["env_truncated"] / n, "env/errors": s["env_errors"]}
    if "env_abandoned_calls" in s:  # calls given up on at env_timeout_s whose threads were left running (a sum)
        rec["env/abandoned_calls"] = int(s["env_abandoned_calls"])
    k = 1
    while f"env_turn{k}_count" in s:
        count = s[f"env_turn{k}_count"]
        rec[f"env/turn{k}_reward_mean"] = s[f"env_turn{k}_reward_sum"] / count if count else None
        k += 1
    return rec
