"""The PPO loop: sharded rollouts -> experience -> ppo_epochs x mini-batches x micro-batches of actor then critic.

One iteration:
  1. `generation_batches` rollout batches per rank (prompts from this rank's shard, left-padded to the batch maximum);
  2. the batches concatenated into one buffer (re-padded to one width), then experience on it (eval-mode forwards, in
     experience micro-batches), advantages whitened with global statistics;
  3. for each PPO epoch, for each mini-batch (`per_device_training_batch_size x gradient_accumulation_steps` samples in
     rollout order), for each micro-batch: actor forward (+ the ptx forward) and ONE actor backward, critic forward
     and backward, then both engines' `step` through the `StepGuard` (trainer/guards.py): at the accumulation boundary
     one collective checks every rank's losses and gradients, and both engines update or neither does. Losses are
     divided by the mini-batch's GLOBAL token count, so any micro-batch split and any number of ranks give the same
     gradient (ppo_math module docstring). The two models are independent, so stepping the actor after the critic's
     backward (instead of before the critic's forward) changes no number;
  4. metrics (token-weighted over every rank) to metrics.jsonl.

Scores may be normalized and penalized before they enter the reward (trainer/reward_shaping.py); a non-finite score,
advantage or loss on any rank stops every rank (NonFiniteError, exit code 4); `max_consecutive_skips` skipped updates
in a row stop the run (TooManySkippedSteps, exit code 3). The first `critic_warmup_iterations` iterations train only
the critic. The run lasts `plan.iterations` iterations (trainer/plan.py: max_steps, or fewer with
num_train_epochs).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from .. import faults
from ..data.prompts import collate_prompts
from ..data.sampler import DataCursor
from ..comm import all_reduce
from ..outputs.metrics import MetricsWriter
from ..ppo_math import AdaptiveKLController, FixedKLController, policy_loss, value_loss
from ..rollout import Experience, Rollout
from .evaluation import Evaluator
from .experience import (NonFiniteError, RewardFn, build_experience, decode_rollout, experience_forwards,
                         global_moments, text_reward, whiten_advantages)
from .guards import Injection, StepGuard, injection_from_env
from .metric_sums import MetricSums
from .ptx import build_ptx, ptx_loss
from .reward_shaping import ScoreShaper, reward_model_scorer
from .plan import RunPlan
from .state import Checkpointer, providers_of

log = logging.getLogger(__name__)


class PPOTrainer:
    """Built from the run plan (trainer/plan.py) and the engine built from it; `metrics` is the run's logger. With
    `plan.resume_path` the checkpoint is loaded last, right before training continues."""

    def __init__(self, plan: RunPlan, engine, metrics: Optional[MetricsWriter] = None):
        cfg = plan.cfg
        self.plan, self.cfg, self.engine, self.dataset = plan, cfg, engine, plan.prompts
        dist = engine.dist
        self.sampler = plan.sampler
        self._batches = DataCursor(self.sampler)  # (epoch, k, indices) like sampler.iter_from, with a position
        ppo = cfg.ppo
        self.kl_ctl = (AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon) if ppo.adaptive_kl
                       else FixedKLController(ppo.kl_coef))
        self.metrics = metrics or MetricsWriter(cfg.output_dir, enabled=dist.is_main)
        # What a checkpoint saves besides the engines, per rank (trainer/state.py; "trainer" and "rng" are added
        # there): name -> object with state_dict() / load_state_dict(); "ptx_data" and "reward_normalizer" below.
        self.state_providers = {"data": self._batches, "kl_controller": self.kl_ctl}
        self.total_iterations = plan.iterations
        # PPO-ptx: the unsupervised stream of this rank (data/ptx.py), its position saved with checkpoints
        self.ptx = build_ptx(cfg, engine, plan.ptx)
        if self.ptx is not None:
            self.state_providers["ptx_data"] = self.ptx.cursor
        # scores -> (normalized, missing-EOS penalty) -> reward (trainer/reward_shaping.py)
        self.shaper = ScoreShaper(ppo.normalize_reward, ppo.missing_eos_penalty)
        if self.shaper.normalizer is not None:
            self.state_providers["reward_normalizer"] = self.shaper.normalizer
        # both engines step together or neither; non-finite losses stop every rank (trainer/guards.py)
        self.guard = StepGuard(engine, ppo.max_consecutive_skips)
        # TEST HOOK (guards.Injection): inject a non-finite score/advantage/loss/gradient; also from the environment
        # variable RLHF_ENGINE_TEST_INJECT_NONFINITE (JSON). Never set in a real run.
        self.inject_nonfinite: Optional[dict] = injection_from_env()
        self.iteration = 0
        self.last_experience: Optional[Experience] = None  # kept for tests and debugging
        self.ratio_trace: list[float] = []  # max |log-ratio| per mini-batch (cheap, used by tests and guards)
        # Optional programmatic reward replacing the reward model: reward_fn(prompt_ids [B, P], rollout) -> [B]
        # scores (see experience.experience_forwards): `--reward_fn module:function` (loaded by the plan). A reward
        # model with its own tokenizer (reward_tokenizer_name_or_path) scores through a re-tokenizing one.
        self.reward_fn: Optional[RewardFn] = (text_reward(plan.reward_fn, engine.tokenizer) if plan.reward_fn
                                              else reward_model_scorer(engine, cfg))
        self.evaluator = (Evaluator(plan.eval_prompts, cfg.batch.per_device_generation_batch_size, dist.rank,
                                    dist.world_size) if plan.eval_prompts is not None else None)
        self.samples_per_iteration = 4  # prompt / response / score rows logged per iteration (samples.jsonl, wandb)
        # TEST HOOK (negative control of the token aggregation): "global" (the only correct setting) divides each
        # mini-batch's loss by its global token count; "local" reproduces the naive per-rank token mean (each rank's
        # mean, averaged over ranks), which depends on how tokens fall on ranks.
        self.loss_token_mean = "global"
        self.checkpointer = Checkpointer(
            engine, providers_of(self), plan.run_dir, plan.fingerprint, save_interval=cfg.save_interval,
            keep_last=cfg.keep_last, seed=cfg.seed,
            export_dir=(cfg.export_dir or plan.run_dir.final) if cfg.export_final else None)
        faults.install(self)  # TEST HOOK: RLHF_ENGINE_TEST_KILL / _STALL (rlhf_engine/faults.py); no-op unset
        # Sampling differs per rank, data order does not (the sampler depends on seed and epoch only).
        torch.manual_seed(cfg.seed + dist.rank)
        if dist.is_main:
            log.info(cfg.batch.describe(dist.world_size) + f"; {self.sampler.dropped_per_epoch} prompts per epoch "
                     "dropped (short last global batch)")
        if plan.resume_path:  # last: the random generators are restored right before training continues
            self.checkpointer.load(plan.resume_path, force=cfg.resume_force)

    # ---- phases ----------------------------------------------------------------------------------------------
    def rollout_phase(self):
        rollouts = []
        for _ in range(self.cfg.batch.generation_batches):
            _, _, idx = next(self._batches)
            ids, mask = collate_prompts(self.dataset, idx, self.engine.pad_token_id)
            rollouts.append(self.engine.generate(ids, mask))
        return rollouts

    def _injection(self, what: str, role: Optional[str] = None) -> bool:
        """TEST HOOK: whether `inject_nonfinite` asks for `what` on this rank now."""
        spec = self.inject_nonfinite
        if not spec:
            return False
        return Injection(spec).active(what, self.engine.dist.rank, self.iteration, role)

    def experience_phase(self, rollouts, stats: MetricSums) -> Experience:
        # The generation batches are concatenated (re-padded to one width) BEFORE the experience forwards, so the old
        # log-probs, reference log-probs and values are computed on exactly the tensors the training forwards see.
        # Position ids already make the result independent of the padding mathematically; computing both on one
        # layout also removes the fp32 kernel noise of a different row width (a few ulps, ~1e-6 in log-prob), so at
        # lr = 0 every PPO ratio is exactly 1.
        rollout = rollouts[0] if len(rollouts) == 1 else Rollout.cat(rollouts, self.engine.pad_token_id)
        reward_fn = self.reward_fn
        if self._injection("score"):  # TEST HOOK: row 0's score becomes NaN
            base = reward_fn or (lambda p, r: self.engine.reward_scores(r))

            def reward_fn(p, r):
                out = torch.as_tensor(base(p, r)).float().clone()
                out[0] = float("nan")
                return out

        fw = experience_forwards(self.engine, rollout, reward_fn)
        # every rank learns whether any rank's scoring failed before the next collective (normalizer, whitening)
        self.guard.agree(self.iteration, errors={"score": fw.error})
        raw_scores = fw.scores
        scores = self.shaper(raw_scores, rollout) if self.shaper.active else raw_scores
        exp = build_experience(rollout, fw, scores, self.cfg.ppo, self.kl_ctl.value)
        entropy = fw.entropy
        if self._injection("advantage"):  # TEST HOOK
            exp.advantages[0, 0] = float("nan")
        mask = rollout.action_mask
        self.guard.agree(self.iteration, tensors={"advantage": (exp.advantages, mask)})
        stats.add("entropy_sum", (entropy * mask).sum())
        stats.add("tokens", mask.sum())
        mask = mask.float()
        stats.add("sequences", torch.tensor(float(exp.batch_size)))
        stats.add("score_sum", raw_scores.sum())
        if self.shaper.active:
            stats.add("shaped_score_sum", exp.scores.sum())
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

    def train_phase(self, exp: Experience, stats: MetricSums) -> None:
        b, ppo, engine = self.cfg.batch, self.cfg.ppo, self.engine
        with_entropy = ppo.entropy_coef > 0
        train_actor = self.iteration >= ppo.critic_warmup_iterations  # critic warm-up: the actor does not train
        roles = ("actor", "critic") if train_actor else ("critic",)
        ptx = self.ptx if train_actor else None
        inject_loss = {r: self._injection("loss", r) for r in ("actor", "critic")}  # TEST HOOKS
        inject_grad = {r: self._injection("grad", r) for r in ("actor", "critic")}
        trace = []
        for epoch in range(ppo.ppo_epochs):
            for m, mini in enumerate(exp.split(b.mini_batch_size)):
                micros = mini.split(b.per_device_training_batch_size)
                ptx_batches = ptx.next_batches(len(micros), engine.device) if ptx is not None else None
                local = torch.stack([mini.rollout.action_mask.sum().double(),
                                     sum(x.num_tokens for x in ptx_batches).double() if ptx_batches
                                     else torch.zeros((), dtype=torch.float64, device=engine.device)])
                if self.loss_token_mean == "global":
                    global_tokens, global_ptx_tokens = all_reduce(local.clone()).float().unbind()
                elif self.loss_token_mean == "local":  # test hook only: the naive per-rank mean
                    global_tokens, global_ptx_tokens = (local * engine.dist.world_size).float().unbind()
                else:
                    raise ValueError(f"loss_token_mean must be 'global' or 'local', got {self.loss_token_mean!r}")
                max_abs_log_ratio = torch.zeros((), dtype=torch.float64, device=engine.device)
                for k, micro in enumerate(micros):
                    r = micro.rollout
                    # check=False: no host sync per micro-batch. Its tensors are slices of `exp`, whose response ids
                    # (experience forward) and masks (compute_rewards / compute_gae) were checked in this iteration;
                    # global_tokens is an all-reduced sum that includes its tokens. (ptx batches keep their checks.)
                    if train_actor:
                        logprobs, entropy = engine.actor_forward(r, with_entropy=with_entropy, check=False)
                        loss, ps = policy_loss(logprobs=logprobs, old_logprobs=micro.old_logprobs,
                                               advantages=micro.advantages, action_mask=r.action_mask,
                                               clip_eps=ppo.clip_eps, dual_clip=ppo.dual_clip,
                                               num_tokens=global_tokens, check=False)
                        if with_entropy:
                            loss = loss - ppo.entropy_coef * (entropy * r.action_mask).sum() / global_tokens
                        if inject_loss["actor"]:
                            loss = loss * float("nan")
                        self.guard.watch("policy loss", loss)
                        actor_loss = loss
                        if ptx_batches is not None:
                            lm_loss, lm = ptx_loss(engine, ptx_batches[k], global_ptx_tokens)
                            self.guard.watch("ptx loss", lm_loss)
                            actor_loss = actor_loss + self.cfg.unsup_coef * lm_loss
                            stats.add("ptx_loss", lm_loss.detach())
                            stats.add("ptx_tokens", lm["tokens"])
                        if inject_grad["actor"]:
                            actor_loss = actor_loss + Injection.nan_gradient_term(logprobs)
                        engine.backward("actor", actor_loss)  # ONE backward: policy (+ entropy) + ptx
                    values = engine.critic_forward(r)
                    vloss, vs = value_loss(values=values, old_values=micro.values, returns=micro.returns,
                                           action_mask=r.action_mask, clip_range=ppo.value_clip,
                                           num_tokens=global_tokens, check=False)
                    if inject_loss["critic"]:
                        vloss = vloss * float("nan")
                    self.guard.watch("value loss", vloss)
                    if inject_grad["critic"]:
                        vloss = vloss + Injection.nan_gradient_term(values)
                    engine.backward("critic", vloss)
                    # both engines step together (boundary: one collective; non-finite gradient -> both skip)
                    self.guard.step(roles, self.iteration, where=f"PPO epoch {epoch}, mini-batch {m}")
                    engine.update_ema()  # acts only when the actor's optimizer just stepped (and EMA is on)
                    stats.add("value_loss", vloss.detach())
                    stats.add("value_clipfrac_sum", vs["clipfrac"] * vs["tokens"])
                    stats.add("value_tokens", vs["tokens"])
                    if not train_actor:
                        continue
                    t = ps["tokens"]
                    stats.add("policy_loss", loss.detach())
                    stats.add("approx_kl_sum", ps["approx_kl"] * t)
                    stats.add("clipfrac_sum", ps["clipfrac"] * t)
                    stats.add("ratio_sum", ps["ratio_mean"] * t)
                    stats.add("train_tokens", t)
                    # a micro-batch without real tokens must not contribute its neutral ratio 1
                    stats.max("ratio_max", torch.where(t > 0, ps["ratio_max"], -torch.inf))
                    stats.min("ratio_min", torch.where(t > 0, ps["ratio_min"], torch.inf))
                    with torch.no_grad():
                        lr = ((logprobs.detach() - micro.old_logprobs) * r.action_mask).abs().max()
                    max_abs_log_ratio = torch.maximum(max_abs_log_ratio, lr.double())
                if train_actor:
                    trace.append(max_abs_log_ratio)
                stats.add("minibatches", torch.tensor(1.0))
        # one collective for the whole phase: max |log-ratio| of every mini-batch over all ranks (none in warm-up)
        if trace:
            self.ratio_trace.extend(all_reduce(torch.stack(trace), "max").tolist())

    # ---- loop ------------------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One iteration; returns the metrics record (also written to metrics.jsonl on rank 0)."""
        stats = MetricSums(self.engine.device)
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
        n_seq, tokens, value_tokens = s["sequences"], s["tokens"], s["value_tokens"]
        train_tokens = s.get("train_tokens", 0.0)
        kl_seq = s["kl_sum"] / n_seq
        minibatches = s["minibatches"] / world  # every rank counted each mini-batch
        rec = {
            "iteration": self.iteration,
            "objective/score": s["score_sum"] / n_seq,
            "objective/kl": kl_seq,
            "objective/rlhf_reward": s["rlhf_reward_sum"] / n_seq,
            "objective/entropy": s["entropy_sum"] / tokens if tokens else None,
        }
        if "shaped_score_sum" in s:
            rec["objective/shaped_score"] = s["shaped_score_sum"] / n_seq
        if "policy_loss" in s:  # the actor trained (not a critic warm-up iteration)
            rec.update({
                # losses: each micro loss is a share of its mini-batch's global token mean; sum -> per-mini-batch mean
                "policy/loss": s["policy_loss"] / minibatches,
                "policy/approx_kl": s["approx_kl_sum"] / train_tokens if train_tokens else None,
                "policy/clipfrac": s["clipfrac_sum"] / train_tokens if train_tokens else None,
                "policy/ratio_mean": s["ratio_sum"] / train_tokens if train_tokens else None,
                "policy/ratio_max": s.get("ratio_max"),
                "policy/ratio_min": s.get("ratio_min"),
            })
        if "ptx_loss" in s:
            rec["ptx/loss"] = s["ptx_loss"] / minibatches  # token mean per mini-batch, without unsup_coef
            rec["ptx/tokens"] = s["ptx_tokens"]
        rec.update({
            "value/loss": s["value_loss"] / minibatches,
            "value/clipfrac": s["value_clipfrac_sum"] / value_tokens if value_tokens else None,
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
            "system/skipped_steps": self.guard.skipped_steps(),
            "system/kl_coef": self.kl_ctl.value,
        })
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
            for _ in range(self.iteration, self.total_iterations):
                try:
                    rec = self.step()
                except NonFiniteError as e:
                    if str(e).startswith("rank "):  # the guards name rank and iteration themselves
                        raise
                    raise NonFiniteError(f"rank {self.engine.dist.rank}, iteration {self.iteration}: {e}") from e
                records.append(rec)
                if self.engine.dist.is_main:
                    log.info("iteration %d/%d  score %.4f  kl %.4f  len %.1f  %.1fs", rec["iteration"] + 1,
                             self.total_iterations, rec["objective/score"], rec["objective/kl"],
                             rec["rollout/response_length"], rec["time/generate"] + rec["time/experience"]
                             + rec["time/train"])
                self.checkpointer.after_iteration(self.iteration)  # every save_interval iterations
            if self.evaluator and self.iteration == self.total_iterations:  # "after": one record of eval/* keys only
                rec = {"iteration": self.iteration, **self.evaluate()}
                self.metrics.write(rec)
                records.append(rec)
            self.checkpointer.finish(self.iteration)  # the final checkpoint and the export (export_final)
        finally:
            self.metrics.close()  # also when a step fails: what was written stays flushed and the file is closed
        return records
