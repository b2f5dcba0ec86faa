"""The PPO loop: sharded rollouts -> experience -> ppo_epochs x mini-batches x micro-batches of actor then critic.

One iteration:
  1. `generation_batches` rollout batches per rank (prompts from this rank's shard, left-padded to the batch maximum);
  2. the batches concatenated into one buffer (re-padded to one width), then experience on it (eval-mode forwards, in
     experience micro-batches), advantages whitened with global statistics;
  3. for each PPO epoch, for each mini-batch (`per_device_training_batch_size x gradient_accumulation_steps` samples in
     rollout order), for each micro-batch: actor forward/backward/step, then critic forward/backward/step. Losses are
     divided by the mini-batch's GLOBAL token count, so any micro-batch split and any number of ranks give the same
     gradient (ppo_math module docstring);
  4. metrics (token-weighted over every rank) to metrics.jsonl.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import TrainConfig
from ..data.prompts import PromptDataset, PromptSampler, collate_prompts
from ..engine import all_reduce
from ..outputs.metrics import MetricsWriter
from ..ppo_math import AdaptiveKLController, FixedKLController, policy_loss, value_loss
from ..rollout import Experience, Rollout
from .state import Checkpointer, DataCursor
from .experience import (NonFiniteError, RewardFn, decode_rollout, global_moments, make_experience,
                         whiten_advantages)

log = logging.getLogger(__name__)


def updates_per_iteration(cfg: TrainConfig) -> int:
    """Optimizer steps per trained engine per iteration (for the LR schedule)."""
    return cfg.ppo.ppo_epochs * (cfg.batch.rollout_size // cfg.batch.mini_batch_size)


@dataclass
class _Sums:
    """Token- or sample-weighted sums for one iteration, all-reduced once at the end (no host sync in the loop)."""

    device: torch.device = torch.device("cpu")
    sums: dict = field(default_factory=dict)
    maxes: dict = field(default_factory=dict)
    mins: dict = field(default_factory=dict)

    def add(self, key: str, value: torch.Tensor) -> None:
        v = torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(())
        self.sums[key] = self.sums[key] + v if key in self.sums else v

    def max(self, key: str, value: torch.Tensor) -> None:
        v = torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(())
        self.maxes[key] = torch.maximum(self.maxes[key], v) if key in self.maxes else v

    def min(self, key: str, value: torch.Tensor) -> None:
        v = torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(())
        self.mins[key] = torch.minimum(self.mins[key], v) if key in self.mins else v

    def reduce(self) -> dict[str, float]:
        out = {}
        for table, op in ((self.sums, "sum"), (self.maxes, "max"), (self.mins, "min")):
            if table:
                keys = sorted(table)
                vals = all_reduce(torch.stack([table[k] for k in keys]), op).tolist()
                out.update(zip(keys, vals))
        return out


class PPOTrainer:
    def __init__(self, cfg: TrainConfig, engine, dataset: PromptDataset, metrics: Optional[MetricsWriter] = None):
        self.cfg, self.engine, self.dataset = cfg, engine, dataset
        dist = engine.dist
        self.sampler = PromptSampler(len(dataset), cfg.batch.per_device_generation_batch_size, dist.rank,
                                     dist.world_size, cfg.seed)
        self._batches = DataCursor(self.sampler)  # (epoch, k, indices) like sampler.iter_from, with a position
        ppo = cfg.ppo
        self.kl_ctl = (AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon) if ppo.adaptive_kl
                       else FixedKLController(ppo.kl_coef))
        self.metrics = metrics or MetricsWriter(cfg.output_dir, enabled=dist.is_main)
        # What a checkpoint saves besides the engines, per rank (trainer/state.py; "trainer" and "rng" are added
        # there): name -> object with state_dict() / load_state_dict(). A ptx data cursor or a reward normalizer
        # registers here too.
        self.state_providers = {"data": self._batches, "kl_controller": self.kl_ctl}
        self.checkpointer = Checkpointer(self)  # save_interval / keep_last / export_final; build_trainer resumes
        self.iteration = 0
        self.last_experience: Optional[Experience] = None  # kept for tests and debugging
        self.ratio_trace: list[float] = []  # max |log-ratio| per mini-batch (cheap, used by tests and guards)
        # Optional programmatic reward replacing the reward model: reward_fn(prompt_ids [B, P], rollout) -> [B]
        # scores (see experience.make_experience). To become `--reward_fn module:function`.
        self.reward_fn: Optional[RewardFn] = None
        self.evaluator = None  # trainer.evaluation.Evaluator when eval_interval > 0
        self.samples_per_iteration = 4  # prompt / response / score rows logged per iteration (samples.jsonl, wandb)
        # TEST HOOK (negative control of the token aggregation): "global" (the only correct setting) divides each
        # mini-batch's loss by its global token count; "local" reproduces the naive per-rank token mean (each rank's
        # mean, averaged over ranks), which depends on how tokens fall on ranks.
        self.loss_token_mean = "global"
        # Sampling differs per rank, data order does not (the sampler depends on seed and epoch only).
        torch.manual_seed(cfg.seed + dist.rank)
        if dist.is_main:
            log.info(cfg.batch.describe(dist.world_size) + f"; {self.sampler.dropped_per_epoch} prompts per epoch "
                     "dropped (short last global batch)")

    # ---- phases ----------------------------------------------------------------------------------------------
    def rollout_phase(self):
        rollouts = []
        for _ in range(self.cfg.batch.generation_batches):
            _, _, idx = next(self._batches)
            ids, mask = collate_prompts(self.dataset, idx, self.engine.pad_token_id)
            rollouts.append(self.engine.generate(ids, mask))
        return rollouts

    def experience_phase(self, rollouts, stats: _Sums) -> Experience:
        # The generation batches are concatenated (re-padded to one width) BEFORE the experience forwards, so the old
        # log-probs, reference log-probs and values are computed on exactly the tensors the training forwards see.
        # Position ids already make the result independent of the padding mathematically; computing both on one
        # layout also removes the fp32 kernel noise of a different row width (a few ulps, ~1e-6 in log-prob), so at
        # lr = 0 every PPO ratio is exactly 1.
        rollout = rollouts[0] if len(rollouts) == 1 else Rollout.cat(rollouts, self.engine.pad_token_id)
        exp, entropy = make_experience(self.engine, rollout, self.cfg.ppo, self.kl_ctl.value,
                                       reward_fn=self.reward_fn)
        mask = rollout.action_mask
        stats.add("entropy_sum", (entropy * mask).sum())
        stats.add("tokens", mask.sum())
        mask = mask.float()
        stats.add("sequences", torch.tensor(float(exp.batch_size)))
        stats.add("score_sum", exp.scores.sum())
        k1 = ((exp.old_logprobs - exp.ref_logprobs) * mask).sum(-1)  # objective/kl is always the k1 sequence sum
        stats.add("kl_sum", k1.sum())
        stats.add("rlhf_reward_sum", (exp.rewards * mask).sum())
        stats.add("response_length_sum", exp.rollout.response_lengths.sum())
        stats.add("eos_sum", exp.rollout.ended_with_eos.sum())
        # explained variance of the rollout values w.r.t. the returns, from global moments
        _, _, var_ret = global_moments(exp.returns, mask)
        _, _, var_res = global_moments(exp.returns - exp.values, mask)
        self._explained_var = (1.0 - var_res / var_ret).item() if var_ret.item() > 0 else None
        if self.cfg.ppo.whiten_advantages:
            exp = whiten_advantages(exp)
        return exp

    def train_phase(self, exp: Experience, stats: _Sums) -> None:
        b, ppo, engine = self.cfg.batch, self.cfg.ppo, self.engine
        with_entropy = ppo.entropy_coef > 0
        trace = []
        for _epoch in range(ppo.ppo_epochs):
            for mini in exp.split(b.mini_batch_size):
                local_tokens = mini.rollout.action_mask.sum().double()
                if self.loss_token_mean == "global":
                    global_tokens = all_reduce(local_tokens.clone()).float()
                elif self.loss_token_mean == "local":  # test hook only: the naive per-rank mean
                    global_tokens = (local_tokens * engine.dist.world_size).float()
                else:
                    raise ValueError(f"loss_token_mean must be 'global' or 'local', got {self.loss_token_mean!r}")
                max_abs_log_ratio = torch.zeros((), dtype=torch.float64, device=engine.device)
                for micro in mini.split(b.per_device_training_batch_size):
                    r = micro.rollout
                    logprobs, entropy = engine.actor_forward(r, with_entropy=with_entropy)
                    loss, ps = policy_loss(logprobs=logprobs, old_logprobs=micro.old_logprobs,
                                           advantages=micro.advantages, action_mask=r.action_mask,
                                           clip_eps=ppo.clip_eps, dual_clip=ppo.dual_clip, num_tokens=global_tokens)
                    if with_entropy:
                        loss = loss - ppo.entropy_coef * (entropy * r.action_mask).sum() / global_tokens
                    engine.backward("actor", loss)
                    engine.step("actor")
                    engine.update_ema()  # acts only when the actor's optimizer just stepped (and EMA is on)
                    values = engine.critic_forward(r)
                    vloss, vs = value_loss(values=values, old_values=micro.values, returns=micro.returns,
                                           action_mask=r.action_mask, clip_range=ppo.value_clip,
                                           num_tokens=global_tokens)
                    engine.backward("critic", vloss)
                    engine.step("critic")
                    t = ps["tokens"]
                    stats.add("policy_loss", loss.detach())
                    stats.add("value_loss", vloss.detach())
                    stats.add("approx_kl_sum", ps["approx_kl"] * t)
                    stats.add("clipfrac_sum", ps["clipfrac"] * t)
                    stats.add("ratio_sum", ps["ratio_mean"] * t)
                    stats.add("value_clipfrac_sum", vs["clipfrac"] * t)
                    stats.add("train_tokens", t)
                    # a micro-batch without real tokens must not contribute its neutral ratio 1
                    stats.max("ratio_max", torch.where(t > 0, ps["ratio_max"], -torch.inf))
                    stats.min("ratio_min", torch.where(t > 0, ps["ratio_min"], torch.inf))
                    with torch.no_grad():
                        lr = ((logprobs.detach() - micro.old_logprobs) * r.action_mask).abs().max()
                    max_abs_log_ratio = torch.maximum(max_abs_log_ratio, lr.double())
                trace.append(max_abs_log_ratio)
                stats.add("minibatches", torch.tensor(1.0))
        # one collective for the whole phase: max |log-ratio| of every mini-batch over all ranks
        self.ratio_trace.extend(all_reduce(torch.stack(trace), "max").tolist())

    # ---- loop ------------------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One iteration; returns the metrics record (also written to metrics.jsonl on rank 0)."""
        stats = _Sums(self.engine.device)
        evaluated = self.evaluate() if self.evaluator and self.iteration % self.cfg.eval_interval == 0 else {}
        t0 = time.perf_counter()
        rollouts = self.rollout_phase()
        t1 = time.perf_counter()
        exp = self.experience_phase(rollouts, stats)
        self.last_experience = exp
        t2 = time.perf_counter()
        self.train_phase(exp, stats)
        t3 = time.perf_counter()
        s = stats.reduce()
        world = self.engine.dist.world_size
        n_seq, tokens, train_tokens = s["sequences"], s["tokens"], s["train_tokens"]
        kl_seq = s["kl_sum"] / n_seq
        minibatches = s["minibatches"] / world  # every rank counted each mini-batch
        rec = {
            "iteration": self.iteration,
            "objective/score": s["score_sum"] / n_seq,
            "objective/kl": kl_seq,
            "objective/rlhf_reward": s["rlhf_reward_sum"] / n_seq,
            "objective/entropy": s["entropy_sum"] / tokens if tokens else None,
            # losses: each micro loss is a share of its mini-batch's global token mean; sum -> per-mini-batch mean
            "policy/loss": s["policy_loss"] / minibatches,
            "policy/approx_kl": s["approx_kl_sum"] / train_tokens if train_tokens else None,
            "policy/clipfrac": s["clipfrac_sum"] / train_tokens if train_tokens else None,
            "policy/ratio_mean": s["ratio_sum"] / train_tokens if train_tokens else None,
            "policy/ratio_max": s.get("ratio_max"),
            "policy/ratio_min": s.get("ratio_min"),
            "value/loss": s["value_loss"] / minibatches,
            "value/clipfrac": s["value_clipfrac_sum"] / train_tokens if train_tokens else None,
            "value/explained_var": self._explained_var,
            "rollout/response_length": s["response_length_sum"] / n_seq,
            "rollout/eos_rate": s["eos_sum"] / n_seq,
            "rollout/truncated_rate": 1.0 - s["eos_sum"] / n_seq,
            "time/generate": t1 - t0,
            "time/experience": t2 - t1,
            "time/train": t3 - t2,
            "throughput/samples_per_s": n_seq / (t3 - t0),
            "throughput/tokens_per_s": tokens / (t3 - t0),
            "system/optimizer_steps": self.engine.optimizer_steps("actor"),
            "system/kl_coef": self.kl_ctl.value,
        }
        rec.update(evaluated)
        self.kl_ctl.update(kl_seq, int(n_seq))
        self.metrics.write(rec)
        if self.engine.dist.is_main and hasattr(self.metrics, "log_samples"):
            # a few of rank 0's samples (decoding every row of every rank would cost a gather for a table)
            few = exp.select(slice(0, self.samples_per_iteration))
            prompts, responses = decode_rollout(self.engine.tokenizer, few.rollout)
            self.metrics.log_samples(self.iteration, prompts, responses, few.scores.tolist())
        self.iteration += 1
        return rec

    def evaluate(self) -> dict:
        """Greedy generation on the held-out prompts -> eval/* metrics; rank 0 appends samples to eval_samples.jsonl."""
        from .evaluation import write_eval_samples

        metrics, samples = self.evaluator.run(self.engine, self.reward_fn)
        if self.engine.dist.is_main:
            write_eval_samples(self.cfg.output_dir, self.iteration, samples)
        return metrics

    def train(self) -> list[dict]:
        records = []
        try:
            for _ in range(self.iteration, self.cfg.max_steps):
                try:
                    rec = self.step()
                except NonFiniteError as e:
                    raise NonFiniteError(f"rank {self.engine.dist.rank}, iteration {self.iteration}: {e}") from e
                records.append(rec)
                if self.engine.dist.is_main:
                    log.info("iteration %d/%d  score %.4f  kl %.4f  len %.1f  %.1fs", rec["iteration"] + 1,
                             self.cfg.max_steps, rec["objective/score"], rec["objective/kl"],
                             rec["rollout/response_length"], rec["time/generate"] + rec["time/experience"]
                             + rec["time/train"])
                self.checkpointer.after_iteration()  # every save_interval iterations
            if self.evaluator and self.iteration == self.cfg.max_steps:  # "after": one record of eval/* keys only
                rec = {"iteration": self.iteration, **self.evaluate()}
                self.metrics.write(rec)
                records.append(rec)
            self.checkpointer.finish()  # the final checkpoint and the export (export_final)
        finally:
            self.metrics.close()  # also when a step fails: what was written stays flushed and the file is closed
        return records
