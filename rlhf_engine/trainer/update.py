"""The PPO update's pieces: a mini-batch's micro-batch plan, and the actor and critic steps that run over it.

    plan = planner.plan(exp, mini, m)       # MiniBatchPlan: global counts, micro-batches (token budget, dummies)
    for micro in plan.micro_batches:
        actor_step.accumulate(micro, plan.counts, stats)    # forward, ONE backward (policy + KL + entropy + ptx)
        critic_step.accumulate(micro, plan.counts, stats)   # forward, backward
        guard.step(...)                                    # both engines step together, or neither

`PPOTrainer.train_phase` is that loop. A micro-batch of weight 0 is a dummy: under a token budget another rank has
more micro-batches, and every backward is collective, so this rank runs one row with its loss times 0. The actor's
and critic's gradients do not depend on each other; they share a micro-batch loop so that their training forwards
draw from the random stream in the same order as always (dropout), and the guard steps them together. Test hooks
wrap the step objects (`TestHooks.wrap_update_step`); nothing here consults them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..comm import all_reduce
from ..rollout import Experience, Rollout
from .metric_sums import MetricSums
from .objectives import Counts
from .ppo_metrics import add_on_policy_stats, add_policy_stats, add_value_stats
from .ptx import ptx_loss

RATIO_TRACE = "ratio_trace/"  # MetricSums keys of the per-mini-batch max |log-ratio| (popped into ratio_trace)


@dataclass
class MicroBatch:
    rows: Experience  # the micro-batch's rows (a dummy's: the mini-batch's row 0)
    weight: float  # 1.0, or 0.0 for a dummy
    ptx: Optional[Any]  # its ptx batch (PPO-ptx while the actor trains), else None
    last: bool  # the mini-batch's last: the gradient-accumulation boundary
    index: Any = None  # its rows in the experience (a slice or a list of indices)
    # before any optimizer step of the iteration with old log-probs left to it (PPOConfig.defers_old_logprobs): its
    # own forward's log-probs, detached, are its old log-probs (and its experience metrics: entropy, rollout check)
    on_policy: bool = False
    # role -> its training forward's outputs, run before the experience was complete (`experience_from_update`)
    outputs: Optional[dict] = None


@dataclass
class MiniBatchPlan:
    counts: Counts  # the mini-batch's counts on ALL ranks: every micro-batch's loss is normalised by them
    micro_batches: list  # [MicroBatch]


def global_counts(mini: Experience, ptx_batches: Optional[list], device: torch.device) -> torch.Tensor:
    """[4] float64 (tokens, policy tokens, policy responses, ptx tokens) of this rank's mini-batch."""
    mask = mini.rollout.action_mask
    pmask = mini.policy_mask if mini.policy_mask is not None else mask
    return torch.stack([mask.sum().double(), pmask.sum().double(), (pmask.sum(-1) > 0).sum().double(),
                        sum(x.num_tokens for x in ptx_batches).double() if ptx_batches
                        else torch.zeros((), dtype=torch.float64, device=device)])


def ran(micro: MicroBatch, role: str) -> Any:
    """The outputs of `role`'s training forward of `micro` if it already ran, else None."""
    return micro.outputs.get(role) if micro.outputs else None


class MicroBatchPlanner:
    """Built once per run: how a mini-batch splits into micro-batches (`per_device_training_batch_size` rows, or the
    engine's token-budget plan over the experience, `max_tokens_per_micro_batch`), and its global counts.
    `reduce_counts(local [4]) -> global [4]` is the all-reduce (a test's negative control passes another)."""

    def __init__(self, engine, micro_batch_size: int, by_tokens: bool,
                 reduce_counts: Callable[[torch.Tensor], torch.Tensor] = lambda x: all_reduce(x.clone())):
        self.engine, self.micro_batch_size, self.by_tokens = engine, micro_batch_size, by_tokens
        self.reduce_counts = reduce_counts
        self._budget_plan: Optional[list] = None

    def start_phase(self, exp: Experience) -> None:
        """The experience's token-budget plan (the same micro-batches as its experience forwards), once a phase."""
        self._budget_plan = self.engine.micro_batches(exp.rollout) if self.by_tokens else None

    def plan(self, exp: Experience, mini: Experience, m: int, ptx_batches: Optional[list], stats: MetricSums,
             start: int = 0, on_policy: bool = False) -> MiniBatchPlan:
        """Mini-batch `m` of `exp` (`mini`, its rows from `start` on) with its ptx batches -> its plan; counts its
        micro-batches in `stats`. `on_policy`: its micro-batches take their old log-probs from their own forward.
        Collective (the counts' all-reduce)."""
        tokens, policy, seqs, ptx = self.reduce_counts(global_counts(mini, ptx_batches, self.engine.device)
                                                       ).float().unbind()
        counts = Counts(tokens, policy.clamp(min=1.0), seqs.clamp(min=1.0), ptx)
        n, size = mini.batch_size, self.micro_batch_size
        index = ([slice(start + i, start + min(i + size, n)) for i in range(0, n, size)]
                 if self._budget_plan is None else self._budget_plan[m])
        rows = [None if r is None else exp.select(r) for r in index]
        stats.add("micro_batches", torch.tensor(float(len(rows))))
        stats.add("empty_micro_batches", torch.tensor(float(sum(r is None for r in rows))))
        micros = [MicroBatch(r if r is not None else mini.select([0]), 1.0 if r is not None else 0.0,
                             ptx_batches[k] if ptx_batches and r is not None else None, k == len(rows) - 1,
                             index=index[k], on_policy=on_policy)
                  for k, r in enumerate(rows)]
        return MiniBatchPlan(counts, micros)


class UpdateStep:
    """One trained role's part of a micro-batch: its loss (`objective_loss`, weighted), its backward, its stats.
    `extra_gradient(loss)` is a term of value 0 added to the backward (0.0; a test hook's NaN gradient)."""

    role = ""

    def __init__(self, engine, objective, guard):
        self.engine, self.objective, self.guard = engine, objective, guard

    def objective_loss(self, micro: MicroBatch, counts: Counts) -> tuple[torch.Tensor, dict]:
        return self.objective(micro.rows, counts, outputs=ran(micro, self.role))

    def forward(self, rollout: Rollout) -> Any:
        """The training forward of `rollout`'s rows (with grad), for an experience completed from it: the outputs
        go back in through `MicroBatch.outputs`."""
        return self.objective.forward(rollout)

    def extra_gradient(self, loss: torch.Tensor) -> Any:
        return 0.0

    def start_mini_batch(self) -> None:
        pass

    def end_mini_batch(self, stats: MetricSums, index: int) -> None:
        pass


class ActorStep(UpdateStep):
    """The policy loss (+ KL loss, entropy) and the ptx term of a micro-batch in ONE actor backward; per mini-batch
    the largest |log-ratio| (the ratio trace, index = the phase's actor mini-batches in order)."""

    role = "actor"

    def __init__(self, engine, objective, guard, unsup_coef: float = 0.0):
        super().__init__(engine, objective, guard)
        self.unsup_coef = unsup_coef
        self.max_abs_log_ratio: Optional[torch.Tensor] = None
        # (index, [b, R] old log-probs, [b, R] correction weights or None) of on-policy micro-batches, for the
        # experience
        self.fresh_old: list = []

    def start_mini_batch(self) -> None:
        self.max_abs_log_ratio = torch.zeros((), dtype=torch.float64, device=self.engine.device)

    def objective_loss(self, micro: MicroBatch, counts: Counts) -> tuple[torch.Tensor, dict]:
        return self.objective(micro.rows, counts, on_policy=micro.on_policy, outputs=ran(micro, self.role))

    def forward(self, rollout: Rollout) -> Any:
        """([b, R] log-probs, [b, R] entropy): the entropy too, for the experience's metrics."""
        return self.objective.forward(rollout, on_policy=True)

    def accumulate(self, micro: MicroBatch, counts: Counts, stats: MetricSums) -> None:
        loss, ps = self.objective_loss(micro, counts)
        loss = loss * micro.weight
        self.guard.watch("policy loss", loss)
        ptx_term = self._ptx_term(micro.ptx, counts, stats) if micro.ptx is not None else 0.0
        self.engine.backward("actor", loss + ptx_term + self.extra_gradient(loss))
        if micro.weight:
            add_policy_stats(stats, loss, ps)
            self.max_abs_log_ratio = torch.maximum(self.max_abs_log_ratio, ps["max_abs_log_ratio"])
            if micro.on_policy:  # what the experience forward would have measured on these rows
                add_on_policy_stats(stats, micro.rows, ps["old_logprobs"], ps["entropy"], ps["correction"])
                weights = ps["correction"][1] if ps["correction"] else None
                self.fresh_old.append((micro.index, ps["old_logprobs"], weights))

    def take_fresh_old(self) -> list:
        """The on-policy micro-batches' (index, old log-probs, correction weights or None) since the last call."""
        out, self.fresh_old = self.fresh_old, []
        return out

    def _ptx_term(self, batch, counts: Counts, stats: MetricSums) -> torch.Tensor:
        """unsup_coef x the ptx loss of one micro-batch (its own forward), watched by the guard."""
        lm_loss, lm = ptx_loss(self.engine, batch, counts.ptx_tokens)
        self.guard.watch("ptx loss", lm_loss)
        stats.add("ptx_loss", lm_loss.detach())
        stats.add("ptx_tokens", lm["tokens"])
        return self.unsup_coef * lm_loss

    def end_mini_batch(self, stats: MetricSums, index: int) -> None:
        stats.max(f"{RATIO_TRACE}{index:06d}", self.max_abs_log_ratio)  # over every rank, with the metrics


class CriticStep(UpdateStep):
    """The clipped value loss of a micro-batch and its backward."""

    role = "critic"

    def accumulate(self, micro: MicroBatch, counts: Counts, stats: MetricSums) -> None:
        vloss, vs = self.objective_loss(micro, counts)
        vloss = vloss * micro.weight
        self.guard.watch("value loss", vloss)
        self.engine.backward("critic", vloss + self.extra_gradient(vloss))
        if micro.weight:
            add_value_stats(stats, vloss, vs)
