"""Update guards of the PPO loop: both trained engines step together or neither does, and a non-finite number on any
rank stops every rank at the same point.

* **Gradients.** A hook on every trainable parameter of the actor and the critic records (on device, no host sync)
  whether a gradient of this rank was non-finite (`grad.sum(dtype=float32)` is not finite: an inf or NaN element, or an
  fp16 loss-scale overflow, which shows as inf in the scaled gradients). At each accumulation boundary, after both
  engines' backward and BEFORE either optimizer step, `StepGuard.step` all-reduces one small table (ranks x flags).
  If any rank saw a non-finite gradient in either engine, BOTH engines skip the step: `engine.step()` still runs (so
  DeepSpeed clears the accumulated gradients, its partitions and buffers, and advances its micro-step counter) but
  the wrapped torch optimizer's own `step` is replaced by a no-op for that call and the LR scheduler is detached, so
  neither the weights, the Adam moments (`exp_avg`, `exp_avg_sq`, `step`) nor the schedule move. DeepSpeed's own
  fp16/ZeRO overflow detection may also skip an engine; either way the engine's `skipped_steps` counts it once and
  `RLHFEngine.optimizer_steps` (global minus skipped) counts applied steps only (so the EMA does not move either).
  Skips are counted by the guard itself (`system/skipped_steps`: every boundary at which the trained engines did not
  update, by this guard's decision or by DeepSpeed's own overflow check; a checkpoint state provider, "step_guard",
  so a resumed run reports what an uninterrupted one does) and warned about; `max_consecutive_skips` skips in a
  row raise `TooManySkippedSteps` (exit code 3).
* **Losses.** `watch(name, loss)` records a non-finite loss of this rank; the same boundary collective sees it and
  every rank raises `NonFiniteError` before anything steps, naming the rank(s), the iteration and the tensor.
* **Scores and advantages.** `agree(...)` (used by the experience phase) shares this rank's failure (an exception
  while scoring, or a non-finite tensor) in one collective, so every rank raises together instead of one rank dying
  while the others wait in their next collective until the timeout.

* **The rollouts' policy.** `LogprobDiffGuard` reads each iteration's `rollout/logprob_diff_max` (the largest
  |generation-time - recomputed| log-prob of a real token, reduced over every rank, so every rank decides alike):
  past `max_rollout_logprob_diff` it warns once per run, and after `LOGPROB_DIFF_PATIENCE` such iterations in a row it
  raises `RolloutPolicyMismatch`; an iteration within the limit starts the count again.

Known limit: a gradient that becomes non-finite only in the cross-rank reduction (an fp16 sum overflowing while every
rank's own gradient is finite) is not seen by the hooks; DeepSpeed's fp16 optimizer then skips that engine alone.

Exit codes of launch/train_ppo.py: 3 = `TooManySkippedSteps`, 4 = `NonFiniteError` (2 = a configuration error, 1 =
anything else). The deepspeed launcher exits with the code of the first rank that failed; torchrun reports 1.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch

from ..comm import all_reduce
from ..errors import EXIT_NON_FINITE, EXIT_SKIPPED_STEPS, TrainingStopped

log = logging.getLogger(__name__)

# the losses watched between two boundaries (fixed order: every rank builds the same table)
LOSSES = ("policy loss", "ptx loss", "value loss")


class NonFiniteError(TrainingStopped):
    """A non-finite score, loss or advantage: training cannot continue with a silent wrong number."""

    exit_code = EXIT_NON_FINITE


class TooManySkippedSteps(TrainingStopped):
    """`max_consecutive_skips` updates in a row were skipped (non-finite gradients / fp16 overflow)."""

    exit_code = EXIT_SKIPPED_STEPS


def base_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO, fp16, bf16): the object whose `step` moves weights and
    Adam moments."""
    opt = optimizer
    for _ in range(8):
        if isinstance(opt, torch.optim.Optimizer) or not hasattr(opt, "optimizer"):
            break
        opt = opt.optimizer
    return opt


def _ranks(xs: list[int]) -> str:
    return f"rank {xs[0]}" if len(xs) == 1 else f"ranks {xs}"


# ---- the guard ------------------------------------------------------------------------------------------------------
class StepGuard:
    """Steps the trained engines (`roles`, the run's: the critic only when the run has one) together (see the module
    docstring). Call `watch` for every loss, then `step(roles)` after every micro-batch's backwards (all ranks, same
    order). Its `state_dict` is the skip count."""

    def __init__(self, engine: Any, roles: tuple, max_consecutive_skips: int):
        self.engine, self.roles = engine, tuple(roles)
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.consecutive = 0  # skipped updates in a row (not saved: a resumed run starts at 0)
        self.skipped = 0  # skipped updates of the run (saved with checkpoints)
        device = engine.device
        self._loss_bad = {n: torch.zeros((), dtype=torch.bool, device=device) for n in LOSSES}
        self._grad_bad = {r: torch.zeros((), dtype=torch.bool, device=device) for r in self.roles}
        self._hooks = []
        for role in self.roles:
            flag = self._grad_bad[role]
            for p in engine.engines[role].module.parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_hook(self._hook(flag)))

    @staticmethod
    def _hook(flag: torch.Tensor):
        def hook(grad: torch.Tensor) -> None:
            g = grad.detach()
            # fp16 sums could overflow where every element is finite: summed in fp32. bf16 and fp32 share fp32's
            # range and sum as they are (an fp32 request would copy every bf16 gradient first on CPU)
            flag.logical_or_(~torch.isfinite(g.sum(dtype=torch.float32) if g.dtype == torch.float16 else g.sum()))

        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def watch(self, name: str, loss: torch.Tensor) -> None:
        """Record whether `loss` (one of LOSSES) is non-finite on this rank (no host sync)."""
        self._loss_bad[name].logical_or_(~torch.isfinite(loss.detach()).all())

    def skipped_steps(self) -> int:
        """Skipped updates so far, this run and before a resume."""
        return self.skipped

    def state_dict(self) -> dict:
        return {"skipped": int(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state["skipped"])

    def _ds_skips(self, roles: tuple) -> int:
        return sum(int(getattr(self.engine.engines[r], "skipped_steps", 0)) for r in roles)

    def step(self, roles: tuple, iteration: int, where: str = "") -> bool:
        """Step `roles` after a micro-batch. At an accumulation boundary: one collective decides; raises
        `NonFiniteError` for a non-finite loss on any rank, skips every role for a non-finite gradient on any rank
        (raising `TooManySkippedSteps` after max_consecutive_skips in a row). Returns whether an update was applied
        (True between boundaries)."""
        engine = self.engine
        if not engine.is_boundary(roles[0]):
            for role in roles:
                engine.step(role)  # DeepSpeed only counts the micro-step here
            return True
        dist = engine.dist
        names = list(LOSSES) + [f"{r} gradient" for r in self.roles]
        local = torch.stack([self._loss_bad[n] for n in LOSSES] + [self._grad_bad[r] for r in self.roles]).float()
        table = torch.zeros((dist.world_size, len(names)), dtype=torch.float32, device=engine.device)
        table[dist.rank] = local
        all_reduce(table)
        for flag in list(self._loss_bad.values()) + list(self._grad_bad.values()):
            flag.zero_()
        rows = table.tolist()  # the boundary's one host sync (indexing the tensor would sync per rank and flag)
        bad = {n: [r for r in range(dist.world_size) if rows[r][j] > 0] for j, n in enumerate(names)}
        at = f" ({where})" if where else ""
        for n in LOSSES:
            if bad[n]:
                raise NonFiniteError(f"rank {dist.rank}, iteration {iteration}: non-finite {n} on {_ranks(bad[n])}"
                                     f"{at}; every rank stops before the update")
        grads = [f"{r} gradient on {_ranks(bad[f'{r} gradient'])}" for r in self.roles if bad[f"{r} gradient"]]
        if not grads:
            before = self._ds_skips(roles)
            for role in roles:
                engine.step(role)
            if self._ds_skips(roles) != before:  # DeepSpeed's own overflow check skipped (fp16 loss scaling)
                self.skipped += 1
            self.consecutive = 0
            return True
        for role in roles:
            self._skip(role)
        self.skipped += 1
        self.consecutive += 1
        if dist.is_main:
            log.warning("iteration %d%s: non-finite %s: skipped the update of %s (%d in a row; %d skipped in all; "
                        "max_consecutive_skips %d)", iteration, at, ", ".join(grads), " and ".join(roles),
                        self.consecutive, self.skipped_steps(), self.max_consecutive_skips)
        if self.max_consecutive_skips and self.consecutive >= self.max_consecutive_skips:
            raise TooManySkippedSteps(f"rank {dist.rank}, iteration {iteration}: {self.consecutive} updates in a row "
                                      f"were skipped (last: non-finite {', '.join(grads)}); stopping "
                                      f"(max_consecutive_skips {self.max_consecutive_skips}). Lower the learning "
                                      "rate, check the reward scale, or use bf16/fp32 instead of fp16")
        return False

    def _skip(self, role: str) -> None:
        """`engine.step()` at a boundary without moving anything: DeepSpeed clears the gradients and counts the
        micro-step; the torch optimizer's step is a no-op for this call and the LR schedule does not advance."""
        ds = self.engine.engines[role]
        opt = base_optimizer(ds.optimizer)
        sched = ds.lr_scheduler
        opt.step = lambda *args, **kwargs: None  # instance attribute shadows the class method for this call
        ds.lr_scheduler = None
        try:
            self.engine.step(role)
        finally:
            del opt.step
            ds.lr_scheduler = sched
        if getattr(ds, "_step_applied", True):  # DeepSpeed did not see an overflow itself: count the skip here
            ds.skipped_steps += 1
            ds._step_applied = False

    # ---- experience phase ---------------------------------------------------------------------------------------
    def agree(self, iteration: int, errors: Optional[dict] = None, tensors: Optional[dict] = None) -> None:
        """One collective: if any rank failed (an exception in `errors`, name -> exception or None; or a non-finite
        value in `tensors`, name -> (tensor, mask or None)), every rank raises. The failing rank re-raises its own
        exception (prefixed with rank and iteration); the others raise `NonFiniteError` (a non-finite tensor) or
        `TrainingStopped` naming the failing rank(s)."""
        dist, device = self.engine.dist, self.engine.device
        errors, tensors = errors or {}, tensors or {}
        names = list(errors) + list(tensors)
        # 2 = a non-finite value reported as an exception (NonFiniteError), 1 = another exception
        flags = [0.0 if errors[n] is None else 2.0 if isinstance(errors[n], NonFiniteError) else 1.0 for n in errors]
        bad = {}
        for n, (x, mask) in tensors.items():
            bad[n] = ~torch.isfinite(x.detach())
            if mask is not None:
                bad[n] = bad[n] & mask.bool()
        table = torch.zeros((dist.world_size, len(names)), dtype=torch.float32, device=device)
        # the tensors' flags stay on the device until the collective: one host sync in all (rows below)
        table[dist.rank] = torch.cat([torch.tensor(flags, dtype=torch.float32, device=device)]
                                     + [b.any().float().reshape(1) for b in bad.values()])
        all_reduce(table)
        rows = table.tolist()
        failed = {n: [r for r in range(dist.world_size) if rows[r][j] > 0] for j, n in enumerate(names)}
        prefix = f"rank {dist.rank}, iteration {iteration}: "
        for n in errors:
            e = errors[n]
            if e is not None:
                try:
                    err = type(e)(prefix + str(e))
                except Exception:  # noqa: BLE001  (an exception type that takes other arguments)
                    raise e
                raise err from e
        for n in tensors:
            if dist.rank in failed[n]:
                b = bad[n]  # the details cost host syncs, paid only on the way out
                detail = f"at {min(int(b.sum()), 10**9)} position(s), first {torch.nonzero(b)[0].tolist()}"
                raise NonFiniteError(f"{prefix}non-finite {n} on {_ranks(failed[n])} ({detail} on this rank); "
                                     "every rank stops")
        for j, n in enumerate(names):
            if failed[n]:
                non_finite = n in tensors or any(row[j] == 2 for row in rows)
                what = f"non-finite {n}" if non_finite else f"{n} failed"
                raise (NonFiniteError if non_finite else TrainingStopped)(
                    f"{prefix}stopping: {what} on {_ranks(failed[n])} (see that rank's error); every rank stops")


# ---- the rollouts' policy -------------------------------------------------------------------------------------------
# Iterations in a row past max_rollout_logprob_diff before the run stops. A broken engine (a missed push, weights
# left at their dummy values, a head packed from an old embedding) is past the limit at every iteration from then on;
# a legitimate run reaches the maximum over its tokens only through a rare token whose probability the two sides'
# rounding puts on either side of a cliff (bf16), which does not recur every iteration. Three in a row separates
# the two and costs at most two iterations trained on another policy's samples (with rollout_correction capping
# their weights).
LOGPROB_DIFF_PATIENCE = 3


class RolloutPolicyMismatch(TrainingStopped):
    """The generation backend's log-probs were off the trainer's by more than max_rollout_logprob_diff for
    LOGPROB_DIFF_PATIENCE iterations in a row: its rollouts come from another policy."""


class LogprobDiffGuard:
    """Counts the iterations in a row whose `rollout/logprob_diff_max` exceeds `limit` (a non-finite value counts;
    None, an iteration without generation-time log-probs, changes nothing); warns the first time (once per run) and
    raises `RolloutPolicyMismatch` at the `patience`-th in a row, naming `backend` and the likely causes. Every rank
    holds the same reduced value, so every rank raises at the same iteration without a collective."""

    def __init__(self, limit: float, backend: str, patience: int = LOGPROB_DIFF_PATIENCE, is_main: bool = True):
        self.limit, self.backend, self.patience, self.is_main = float(limit), backend, int(patience), is_main
        self.streak = 0  # iterations in a row past the limit (not saved: a resumed run starts at 0)
        self.warned = False

    def observe(self, iteration: int, diff_max: Optional[float]) -> None:
        if diff_max is None:
            return
        if math.isfinite(diff_max) and diff_max <= self.limit:
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= self.patience:
            raise RolloutPolicyMismatch(
                f"iteration {iteration}: rollout/logprob_diff_max {diff_max:.4g} > max_rollout_logprob_diff "
                f"{self.limit:g} for {self.streak} iterations in a row: the {self.backend} generation backend samples "
                "from another policy than the actor's. Likely causes: a weight push that missed (the engine holds "
                "old or dummy weights: a layer the push did not reach, a stale prefix cache or packed head), other "
                "kernels or precision on the engine's side (its dtype against the trainer's, a quantized engine), "
                "sampling that differs (temperature, top-k/top-p), or another model or tokenizer. Raise the limit "
                "(0 = off) for a run that is knowingly off-policy")
        if not self.warned and self.is_main:
            log.warning("iteration %d: rollout/logprob_diff_max %.4g > max_rollout_logprob_diff %g: the %s backend's "
                        "log-probs are far from the trainer's (warned once; the run stops after %d iterations in a "
                        "row past the limit)", iteration, diff_max, self.limit, self.backend, self.patience)
        self.warned = True
