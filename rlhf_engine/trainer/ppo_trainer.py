"""The PPO loop: sharded rollouts -> experience -> ppo_epochs x mini-batches x micro-batches of actor then critic.

One iteration:
  1. `generation_batches` rollout batches per rank (prompts from this rank's shard, left-padded to the batch maximum);
  2. the batches concatenated into one buffer (re-padded to one width), then experience on it (eval-mode forwards, in
     experience micro-batches), advantages from the run's estimator (rlhf_engine/estimators.py; GAE by default),
     whitened with global statistics. Where a rank's rows are the update's one micro-batch (`experience_from_update`,
     config/ppo.py), the actor's and critic's experience forwards are step 3's training forwards instead: this phase
     runs the reference's and reward's, and step 3 completes the experience from the detached training outputs
     before their losses;
  3. for each PPO epoch, for each mini-batch (`per_device_training_batch_size x gradient_accumulation_steps` samples in
     rollout order), for each micro-batch: actor forward (+ the ptx forward) and ONE actor backward, critic forward
     and backward, then both engines' `step` through the `StepGuard` (trainer/guards.py): at the accumulation boundary
     one collective checks every rank's losses and gradients, and both engines update or neither does. Losses are
     divided by the mini-batch's GLOBAL token count, so any micro-batch split and any number of ranks give the same
     gradient (ppo_math module docstring). The two models are independent, so stepping the actor after the critic's
     backward (instead of before the critic's forward) changes no number;
  4. metrics (token-weighted over every rank, trainer/ppo_metrics.py) to metrics.jsonl.

The critic's forward, backward, step, value metrics, checkpoint and export happen only when the run has one (an
estimator that needs no critic builds none: `TrainConfig.active_roles`). Test hooks (rlhf_engine/hooks.py) are
consulted at named points and do nothing unless a test sets them.

Scores may be normalized and penalized before they enter the reward (trainer/reward_shaping.py); a non-finite score,
advantage or loss on any rank stops every rank (NonFiniteError, exit code 4); `max_consecutive_skips` skipped updates
in a row stop the run (TooManySkippedSteps, exit code 3); generation-time log-probs past `max_rollout_logprob_diff`
for 3 iterations in a row stop it too (RolloutPolicyMismatch, trainer/guards.py). The first
`critic_warmup_iterations` iterations train only the critic. The run lasts `plan.iterations` iterations
(trainer/plan.py: max_steps, or fewer with num_train_epochs).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Optional

import torch

from ..data.prompts import collate_prompts
from ..engine.generation import Generated
from ..envs import EnvironmentFailure
from ..config.ppo import experience_from_update
from ..errors import RolloutServersLost
from ..hooks import TestHooks
from ..data.sampler import DataCursor
from ..outputs.metrics import MetricsWriter
from ..rollout import Experience, Rollout
from .clock import IterationClock
from .experience import (NonFiniteError, PendingExperience, build_experience, decode_rollout,
                         experience_forwards, global_mean_var, group_ids_of, whiten_advantages)
from .memory import peak_device_mib, peak_rss_mib
from .metric_sums import MetricSums
from .objectives import experience_steps
from .ppo_metrics import add_experience_stats, add_rollout_check, add_value_moments, iteration_record
from .ptx import build_ptx
from . import ppo_setup as setup
from .update import RATIO_TRACE
from .plan import RunPlan
from .state import providers_of

log = logging.getLogger(__name__)


def reuse_forward_outputs(plan, exp: Experience, outputs: dict) -> None:
    """Hand `outputs` (role -> its training forward's outputs on every row of `exp`) to the plan's micro-batch, which
    must be exactly those rows: `experience_from_update` allows no other plan (a RuntimeError names a broken one)."""
    micros = plan.micro_batches
    if len(micros) != 1 or micros[0].weight != 1.0 or micros[0].rows.batch_size != exp.batch_size:
        raise RuntimeError(f"experience_from_update: the update's first mini-batch has {len(micros)} micro-batches "
                           f"of {[m.rows.batch_size for m in micros]} rows, the experience {exp.batch_size}: the "
                           "training forwards' outputs cannot be reused")
    micros[0].outputs = outputs


def cat_generated(gens: list, pad_token_id: int) -> tuple[Rollout, Optional[torch.Tensor]]:
    """The generation batches of an iteration as one rollout buffer (re-padded to one width) and their
    generation-time log-probs [B, R] (right-padded with 0; None when the backend gives none)."""
    if len(gens) == 1:
        return gens[0].rollout, gens[0].logprobs
    rollout = Rollout.cat([g.rollout for g in gens], pad_token_id)
    if any(g.logprobs is None for g in gens):
        return rollout, None
    R = rollout.response_width
    return rollout, torch.cat([torch.nn.functional.pad(g.logprobs, (0, R - g.logprobs.shape[1])) for g in gens])


class PPOTrainer:
    """Built from the run plan (trainer/plan.py) and the engine built from it; `metrics` is the run's logger. With
    `plan.resume_path` the checkpoint is loaded last, right before training continues."""

    def __init__(self, plan: RunPlan, engine, metrics: Optional[MetricsWriter] = None,
                 hooks: Optional[TestHooks] = None):
        cfg = plan.cfg
        self.plan, self.cfg, self.engine, self.dataset = plan, cfg, engine, plan.prompts
        dist = engine.dist
        # TEST HOOKS (rlhf_engine/hooks.py), given by the caller: all off unless a test sets one; they wrap the
        # objects below, never sit in the loop
        self.hooks = (hooks or TestHooks()).attach(dist.rank, lambda: engine.optimizer_steps("actor"))
        self.sampler = plan.sampler
        self._batches = DataCursor(self.sampler)  # (epoch, k, indices) like sampler.iter_from, with a position
        self.episodes = setup.episode_runner(plan, engine)
        # max_staleness >= 1: the next iterations are generated while this one trains (trainer/ahead.py)
        self.ahead = setup.rollouts_ahead(plan, engine, self._batches, plan.iterations, self.episodes)
        self.kl_ctl = setup.kl_controller(cfg.ppo)
        self.metrics = metrics or MetricsWriter(cfg.run.output_dir, enabled=dist.is_main)
        self.total_iterations = plan.iterations
        self.ptx = build_ptx(cfg, engine, plan.ptx)  # PPO-ptx: this rank's unsupervised stream (data/ptx.py)
        self.shaper = setup.score_shaper(cfg.ppo, cfg.generation.max_answer_seq_len)
        self.roles = engine.trained_roles  # ("actor", "critic"), or ("actor",) in a run without a critic
        self.guard = setup.step_guard(engine, cfg.ppo, self.hooks)
        self.logprob_guard = setup.logprob_guard(engine, cfg.ppo)  # the rollouts come from the actor's policy
        # the update (trainer/update.py): micro-batch plans, and the actor and critic steps over them
        self.planner = setup.micro_batch_planner(engine, cfg.batch, self.hooks)
        self.actor_step = setup.actor_step(engine, cfg, self.guard, self.ptx, self.hooks)
        self.critic_step = setup.critic_step(engine, cfg.ppo, self.guard, self.hooks)
        self.experience_steps = experience_steps(cfg.ppo, cfg.batch.n_samples_per_prompt)  # correction, filter
        self.defers_old = cfg.ppo.defers_old_logprobs  # the first mini-batch's old log-probs from its own forward
        # every row's old log-probs and values from the update's own forwards (config/ppo.py)
        self.from_update = experience_from_update(cfg)
        self.reward_source = setup.reward_source(plan, engine)  # what scores the rollouts (trainer/reward_sources)
        self.evaluator = setup.evaluator(plan, engine)
        self.iteration = 0
        self.clock = IterationClock()  # time/iteration split into named parts (trainer/clock.py)
        self.last_experience: Optional[Experience] = None  # kept for tests and debugging
        self.ratio_trace: list[float] = []  # max |log-ratio| per mini-batch (cheap, used by tests and guards)
        self.samples_per_iteration = 4  # prompt / response / score rows logged per iteration (samples.jsonl, wandb)
        # What a checkpoint saves besides the engines, per rank, in restore order (trainer/state.py adds "trainer"
        # first and "rng" last): name -> object with state_dict() / load_state_dict()
        self.state_providers = {name: obj for name, obj in (
            ("data", self.ahead or self._batches), ("kl_controller", self.kl_ctl),
            ("ptx_data", self.ptx.cursor if self.ptx is not None else None),
            ("reward_normalizer", self.shaper.normalizer), ("step_guard", self.guard)) if obj is not None}
        self.checkpointer = setup.checkpointer(plan, engine, providers_of(self), self.hooks)
        # Sampling differs per rank, data order does not (the sampler depends on seed and epoch only).
        torch.manual_seed(cfg.seed + dist.rank)
        if dist.is_main:
            log.info(cfg.batch.describe(dist.world_size) + f"; {self.sampler.dropped_per_epoch} prompts per epoch "
                     "dropped (short last global batch)")
        if plan.resume_path:  # last: the random generators are restored right before training continues
            self.checkpointer.load(plan.resume_path, force=cfg.run.resume_force)

    # ---- phases ----------------------------------------------------------------------------------------------
    def rollout_phase(self):
        self.hooks.at("rollout", self.iteration)
        if self.ahead is not None:
            gens = self.ahead.take(self.iteration)
            if self.episodes is not None:  # every rank learns whether an environment failed on any rank
                self.guard.agree(self.iteration, errors={"environment": next(
                    (EnvironmentFailure(g.failure) for g in gens if g.failure is not None), None)})
            return gens
        n = self.cfg.batch.n_samples_per_prompt
        rollouts = []
        for _ in range(self.cfg.batch.generation_batches):
            _, _, idx = next(self._batches)
            ids, mask = collate_prompts(self.dataset, idx, self.engine.pad_token_id)
            if n > 1:  # each prompt n times in a row: a group is contiguous, on this rank (no collective for it)
                ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
            rows = self.dataset.rows(idx, repeat=n)
            if self.episodes is not None:  # every rank learns whether an environment failed on any rank
                rollout, logprobs, episode_stats, failure = self.episodes.run(ids, mask, rows)
                self.guard.agree(self.iteration, errors={"environment": failure})
                gen = Generated(rollout, logprobs, episode_stats)
            else:
                gen = self.engine.sample(ids, mask)  # Generated: the rollout and its generation log-probs
            # each sample keeps its data row (prompt text, the reward function's columns) for the scoring
            rollouts.append(dataclasses.replace(gen, rollout=gen.rollout.with_rows(rows)))
        return rollouts

    def experience_phase(self, rollouts, stats: MetricSums):
        """The rollouts -> their Experience; in an iteration whose actor's and critic's experience forwards are its
        training forwards (`experience_from_update`), a `PendingExperience` that `train_phase` completes."""
        self.hooks.at("experience", self.iteration)
        # The generation batches are concatenated (re-padded to one width) BEFORE the experience forwards, so the old
        # log-probs, reference log-probs and values are computed on exactly the tensors the training forwards see.
        # Position ids already make the result independent of the padding mathematically; computing both on one
        # layout also removes the fp32 kernel noise of a different row width (a few ulps, ~1e-6 in log-prob), so at
        # lr = 0 every PPO ratio is exactly 1.
        rollout, rollout_logprobs = cat_generated(rollouts, self.engine.pad_token_id)
        for gen in rollouts:
            if gen.episode_stats is not None:
                gen.episode_stats.add_to(stats)
        reward_fn = self.hooks.scores(self.reward_source, self.iteration)
        from_update = self.from_update and self._actor_trains()
        # the first mini-batch's old log-probs left to its own training forward (PPOConfig.defers_old_logprobs), or
        # every row's with its values (experience_from_update)
        k = rollout.batch_size if from_update else self._on_policy_rows(rollout.batch_size)
        fw = experience_forwards(self.engine, rollout, reward_fn, on_policy_rows=k, values=not from_update)
        # every rank learns whether any rank's scoring failed before the next collective (normalizer, whitening)
        self.guard.agree(self.iteration, errors={"score": fw.error})
        raw_scores = fw.scores
        scores = self.shaper(raw_scores, rollout) if self.shaper.active else raw_scores
        pending = PendingExperience(rollout, rollout_logprobs, fw, raw_scores, scores)
        return pending if from_update else self.complete_experience(pending, stats, k)

    def complete_experience(self, pending: PendingExperience, stats: MetricSums, k: int) -> Experience:
        """Rewards, advantages, the corrections and filters, their metrics and the whitening, from the experience
        forwards (`pending.fw`; rows [0, k) without old log-probs yet: `_on_policy_rows`). Collective."""
        rollout, fw, raw_scores, scores = pending.rollout, pending.fw, pending.raw_scores, pending.scores
        rollout_logprobs = pending.rollout_logprobs
        group_ids = group_ids_of(rollout.batch_size, self.cfg.batch.n_samples_per_prompt, rollout.sequences.device)
        exp = build_experience(rollout, fw, scores, self.cfg.ppo, self.kl_ctl.value, group_ids=group_ids,
                               moments=global_mean_var)
        exp.rollout_logprobs = rollout_logprobs
        if rollout_logprobs is not None and k < rollout.batch_size:  # the live check: does the backend sample what
            # PPO scores? (rows [0, k): after their training forward, ActorStep)
            add_rollout_check(stats, rollout_logprobs[k:], exp.old_logprobs[k:], rollout.action_mask[k:])
        for step in self.experience_steps:  # rollout correction, then the uniform-group filter
            exp = step(exp, stats, k)
        self.hooks.advantages(exp.advantages, self.iteration)
        self.guard.agree(self.iteration, tensors={"advantage": (exp.advantages, rollout.action_mask)})
        add_experience_stats(stats, exp, fw.entropy, raw_scores, shaped=self.shaper.active)
        if exp.values is not None:
            add_value_moments(stats, exp)
        if self.cfg.ppo.whitens:
            exp = whiten_advantages(exp)
        return exp

    def _on_policy_rows(self, batch_size: int) -> int:
        """Rows whose old log-probs this iteration's first training forward gives (the first mini-batch's, where the
        actor trains and the run defers them: PPOConfig.defers_old_logprobs), else 0. The same on every rank. 0 too
        where the whole experience comes from the update (`experience_from_update`): it is complete, every metric
        counted, before the first loss."""
        if self.from_update or not self.defers_old or not self._actor_trains():
            return 0
        return min(self.cfg.batch.mini_batch_size, batch_size)

    def _actor_trains(self) -> bool:
        return self.iteration >= self.cfg.ppo.critic_warmup_iterations  # critic warm-up: the actor does not train

    def train_phase(self, exp, stats: MetricSums) -> Experience:
        """ppo_epochs x mini-batches x micro-batches of the actor and critic steps (trainer/update.py). `exp`: the
        Experience, or a PendingExperience: then the actor's and critic's training forwards of the one micro-batch
        run first, the experience is completed from their detached outputs, and their losses follow from the same
        outputs (`experience_from_update`). Returns the Experience."""
        it = self.iteration
        self.hooks.at("train", it)
        train_actor = self._actor_trains()
        steps = [s for s in (self.actor_step if train_actor else None, self.critic_step) if s is not None]
        roles = tuple(s.role for s in steps)
        ptx = self.ptx if train_actor else None
        outputs = None
        if isinstance(exp, PendingExperience):  # the same forwards, in the same order (actor, critic) as below
            outputs = {step.role: step.forward(exp.rollout) for step in steps}
            exp = self.complete_experience(exp.with_forwards(*outputs["actor"], outputs.get("critic")), stats, 0)
        self.planner.start_phase(exp)
        actor_minibatches = 0  # they name the ratio-trace metrics in order
        on_policy_rows = self._on_policy_rows(exp.batch_size)
        mbs = self.cfg.batch.mini_batch_size
        for epoch in range(self.cfg.ppo.ppo_epochs):
            for m, mini in enumerate(exp.split(mbs)):
                ptx_batches = ptx.next_mini_batch(self.engine.device) if ptx is not None else None
                plan = self.planner.plan(exp, mini, m, ptx_batches, stats, start=m * mbs,
                                         on_policy=bool(on_policy_rows) and epoch == 0 and m == 0)
                if outputs is not None and epoch == 0 and m == 0:
                    reuse_forward_outputs(plan, exp, outputs)
                for step in steps:
                    step.start_mini_batch()
                for micro in plan.micro_batches:
                    if self.planner.by_tokens:
                        self.engine.set_boundary(roles, micro.last)
                    for step in steps:
                        step.accumulate(micro, plan.counts, stats)
                    # the trained engines step together (boundary: one collective; non-finite gradient: all skip)
                    self.guard.step(roles, it, where=f"PPO epoch {epoch}, mini-batch {m}")
                    self.engine.update_ema()  # acts only when the actor's optimizer just stepped (and EMA is on)
                if train_actor:
                    self.actor_step.end_mini_batch(stats, actor_minibatches)
                    actor_minibatches += 1
                    for index, old, weights in self.actor_step.take_fresh_old():  # the experience complete, as
                        exp.old_logprobs[index] = old  # if computed before training
                        if weights is not None:
                            exp.advantage_weights[index] = weights
                stats.add("minibatches", torch.tensor(1.0))
        return exp

    # ---- loop ------------------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One iteration; returns the metrics record (also written to metrics.jsonl on rank 0)."""
        stats = MetricSums(self.engine.device)
        te = time.perf_counter()
        evaluated = self.evaluate() if self.evaluator and self.iteration % self.cfg.eval_interval == 0 else {}
        t0 = time.perf_counter()
        rollouts = self.rollout_phase()
        self.engine.generator.release()  # a backend with its own engine may free its memory for training (GPU)
        t1 = time.perf_counter()
        exp = self.experience_phase(rollouts, stats)
        t2 = time.perf_counter()
        exp = self.train_phase(exp, stats)
        self.last_experience = exp
        t3 = time.perf_counter()
        for key, n in self.engine.take_slot_counts().items():  # the forwards' tokens and slots, padded and packed
            stats.add(f"slots_{key}", torch.tensor(float(n)))
        prefix = self.engine.take_prefix_stats()  # --reuse_frozen_prefix: forwards that started from the kept output
        if prefix:
            stats.add("prefix_hits", torch.tensor(float(prefix["hits"])))
            stats.add("prefix_misses", torch.tensor(float(prefix["misses"])))
            stats.max("prefix_mib", torch.tensor(prefix["bytes"] / 2 ** 20))
        for key, n in self.reward_source.take_counts().items():  # --reward_workers: timeouts, restarts
            stats.add(f"reward_{key}", torch.tensor(float(n)))
        stats.max("peak_rss_mib", torch.tensor(peak_rss_mib()))  # the largest rank's, in the same collective
        device_peak = peak_device_mib(self.engine.device)
        if device_peak is not None:
            stats.max("peak_device_mib", torch.tensor(device_peak))
        s = stats.reduce()
        self.ratio_trace.extend(s.pop(k) for k in sorted(k for k in s if k.startswith(RATIO_TRACE)))
        n_seq, tokens = s["sequences"], s["tokens"]
        rec = {"iteration": self.iteration,
               **iteration_record(s, self.engine.dist.world_size),
               "time/generate": t1 - t0,
               "time/experience": t2 - t1,
               "time/train": t3 - t2,
               "time/eval": t0 - te,
               "throughput/samples_per_s": n_seq / (t3 - t0),
               "throughput/tokens_per_s": tokens / (t3 - t0),
               "system/optimizer_steps": self.engine.optimizer_steps("actor"),
               "system/skipped_steps": self.guard.skipped_steps(),
               "system/kl_coef": self.kl_ctl.value}
        sync = self.engine.generator.take_sync_seconds()  # weights loaded into the backend's own engine (vllm)
        if sync is not None:
            rec["time/weight_sync"] = sync
        rec.update(self.engine.generator.take_async_stats())  # rollout servers: the wait, servers up, async/*
        if self.ahead is not None:
            st = self.ahead.staleness
            rec.update({"async/staleness_mean": sum(st) / len(st), "async/staleness_max": max(st),
                        **self.ahead.take_counts()})
        rec.update(evaluated)
        if "objective/kl" in rec:  # without a reference the coefficient is 0 and stays so (reads_reference)
            self.kl_ctl.update(rec["objective/kl"], int(n_seq))
        rec.update(self.clock.close(rec, metrics=time.perf_counter() - t3))
        with self.clock.timed("log"):  # falls in the next iteration's window (see IterationClock)
            self.metrics.write(rec)
            if self.engine.dist.is_main and hasattr(self.metrics, "log_samples"):
                # a few of rank 0's samples (decoding every row of every rank would cost a gather for a table)
                few = exp.select(slice(0, self.samples_per_iteration))
                prompts, responses = decode_rollout(self.engine.tokenizer, few.rollout)
                self.metrics.log_samples(self.iteration, prompts, responses, few.scores.tolist())
        if self.logprob_guard is not None:  # after the record is written: the iteration that stops the run is in it
            self.logprob_guard.observe(self.iteration, rec.get("rollout/logprob_diff_max"))
        self.iteration += 1
        return rec

    def _save_before(self, start: dict) -> None:
        """The rollout servers were lost during this iteration's generation (before its update), or during the final
        evaluation: the checkpoint of the completed iterations, with the data position and random generators of
        the iteration's start (`start`: provider name -> its state then)."""
        if self.iteration in (0, self.checkpointer.last_saved):
            return  # nothing completed, or already saved: the last checkpoint stays as it is
        for name, state in start.items():
            self.checkpointer.providers[name].load_state_dict(state)
        path = self.checkpointer.save(self.iteration)
        log.warning("the rollout servers were lost: checkpoint %s written (iterations 0-%d)", path, self.iteration - 1)

    def evaluate(self) -> dict:
        """Greedy generation on the held-out prompts -> eval/* metrics; rank 0 appends samples to eval_samples.jsonl."""
        from .evaluation import write_eval_samples

        metrics, samples = self.evaluator.run(self.engine, self.reward_source)
        if self.engine.dist.is_main:
            write_eval_samples(self.cfg.run.output_dir, self.iteration, samples)
        return metrics

    def train(self) -> list[dict]:
        records = []
        try:
            self.checkpointer.before_first(self.iteration)  # a preemption during start-up: exit 75, nothing saved
            for _ in range(self.iteration, self.total_iterations):
                # where this iteration starts: lost rollout servers are noticed before its update
                start = ({n: copy.deepcopy(self.checkpointer.providers[n].state_dict()) for n in ("data", "rng")}
                         if self.cfg.rollout.servers_on else None)
                try:
                    rec = self.step()
                except RolloutServersLost:
                    self._save_before(start)
                    raise
                except NonFiniteError as e:
                    if str(e).startswith("rank "):  # the guards name rank and iteration themselves
                        raise
                    raise NonFiniteError(f"rank {self.engine.dist.rank}, iteration {self.iteration}: {e}") from e
                records.append(rec)
                if self.engine.dist.is_main:
                    with self.clock.timed("log"):
                        kl = f"  kl {rec['objective/kl']:.4f}" if "objective/kl" in rec else ""
                        log.info("iteration %d/%d  score %.4f%s  len %.1f  %.1fs", rec["iteration"] + 1,
                                 self.total_iterations, rec["objective/score"], kl,
                                 rec["rollout/response_length"], rec["time/generate"] + rec["time/experience"]
                                 + rec["time/train"])
                # save_interval / save_interval_minutes / a preemption request (exit 75 after saving)
                with self.clock.timed("checkpoint"):
                    self.checkpointer.after_iteration(self.iteration, last=self.iteration == self.total_iterations)
            if self.evaluator and self.iteration == self.total_iterations:  # "after": one record of eval/* keys only
                try:
                    evaluated = self.evaluate()
                except RolloutServersLost:
                    self._save_before({})  # every iteration is done: their checkpoint, then the named error
                    raise
                rec = {"iteration": self.iteration, **evaluated}
                self.metrics.write(rec)
                records.append(rec)
            self.checkpointer.finish(self.iteration)  # the final checkpoint and the export (export_final)
        finally:
            self.metrics.close()  # also when a step fails: what was written stays flushed and the file is closed
            self.reward_source.close()  # reward worker processes end with the run
        return records
