"""TEST HOOKS of the PPO loop, in one opt-in object the trainer consults at named points; never set in a real run.

    hooks = TestHooks.from_env(rank, actor_steps)      # the trainer's; inactive unless a variable below is set
    hooks.at(phase, iteration)                         # rollout / experience / train: kill or stall this rank here
    hooks.after_step(iteration)                        # train_step: after the iteration's first actor optimizer step
    hooks.scores(reward_fn, iteration)                 # the reward function, or one that returns a NaN in row 0
    hooks.advantages(advantages, iteration)            # advantage [0, 0] set to NaN
    hooks.loss(role, loss, iteration)                  # the role's loss, or NaN
    hooks.grad(role, x, iteration)                     # 0, or a term of value 0 whose gradient is NaN

Kill / stall points: `RLHF_ENGINE_TEST_KILL` / `RLHF_ENGINE_TEST_STALL` (rlhf_engine/faults.py; the `checkpoint` point
is consulted by the checkpointer itself). Non-finite injection: `RLHF_ENGINE_TEST_INJECT_NONFINITE` (JSON, see
`Injection`) read when the trainer is built, or `trainer.inject_nonfinite = spec`. When nothing is set every call
returns its argument (or 0) at once.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import torch

from . import faults

INJECT_ENV = "RLHF_ENGINE_TEST_INJECT_NONFINITE"


def injection_from_env() -> Optional[dict]:
    """TEST HOOK: `RLHF_ENGINE_TEST_INJECT_NONFINITE` (JSON, see `Injection`) -> the injection spec, or None."""
    raw = os.environ.get(INJECT_ENV, "").strip()
    return json.loads(raw) if raw else None


class Injection:
    """TEST HOOK (never set in a real run): inject a non-finite number to exercise the guards.

    spec: {"what": "score" | "advantage" | "loss" | "grad", "role": "actor" | "critic" (loss, grad; default actor),
           "rank": r (default: every rank), "iteration": first iteration (default 0),
           "iterations": how many iterations in a row (default 1; 0 = every iteration from then on)}.
    * score: row 0 of the rank's scores becomes NaN (as if the reward model / function returned it);
    * advantage: advantage [0, 0] of the rank becomes NaN;
    * loss: the role's loss of every micro-batch becomes NaN;
    * grad: a term with value 0 and a NaN gradient is added to the role's loss (the loss stays finite, every
      gradient of the role becomes NaN: what an fp16 overflow in backward looks like to the guard).
    Set it as `trainer.inject_nonfinite = spec` or through the environment variable RLHF_ENGINE_TEST_INJECT_NONFINITE
    (JSON), read when the trainer is built.
    """

    WHAT = ("score", "advantage", "loss", "grad")

    def __init__(self, spec: dict):
        self.what = spec["what"]
        if self.what not in self.WHAT:
            raise ValueError(f"inject_nonfinite: 'what' must be one of {self.WHAT}, got {self.what!r}")
        self.role = spec.get("role", "actor")
        self.rank = spec.get("rank")
        self.first = int(spec.get("iteration", 0))
        self.count = int(spec.get("iterations", 1))

    def active(self, what: str, rank: int, iteration: int, role: Optional[str] = None) -> bool:
        if what != self.what or (self.rank is not None and rank != self.rank):
            return False
        if role is not None and role != self.role:
            return False
        return iteration >= self.first and (self.count == 0 or iteration < self.first + self.count)

    @staticmethod
    def nan_gradient_term(x: torch.Tensor) -> torch.Tensor:
        """0 in value, NaN in gradient w.r.t. x: d sqrt(u)/du = inf at u = 0, times du/dx = 0."""
        return (x.sum() * 0.0).abs().sqrt()


class TestHooks:
    __test__ = False  # not a pytest class

    def __init__(self, rank: int, actor_steps: Callable[[], int], nonfinite: Optional[dict] = None):
        self.rank, self.actor_steps = rank, actor_steps
        self.faults = faults.active()
        self.nonfinite = nonfinite
        self._steps_before: Optional[int] = None

    @classmethod
    def from_env(cls, rank: int, actor_steps: Callable[[], int]) -> "TestHooks":
        return cls(rank, actor_steps, injection_from_env())

    @property
    def nonfinite(self) -> Optional[dict]:
        return self._spec

    @nonfinite.setter
    def nonfinite(self, spec: Optional[dict]) -> None:
        self._spec = spec
        self._injection = Injection(spec) if spec else None

    def _active(self, what: str, iteration: int, role: Optional[str] = None) -> bool:
        inj = self._injection
        return inj is not None and inj.active(what, self.rank, iteration, role)

    # ---- kill / stall ----------------------------------------------------------------------------------------------
    def at(self, phase: str, iteration: int) -> None:
        if self.faults:
            faults.fault_point(phase, iteration, self.rank)
            if phase == "train":
                self._steps_before = self.actor_steps()

    def after_step(self, iteration: int) -> None:
        """After a guarded step: the `train_step` point once the actor's optimizer has really stepped (not a
        micro-step of gradient accumulation)."""
        if self.faults and self._steps_before is not None and self.actor_steps() != self._steps_before:
            self._steps_before = None
            faults.fault_point("train_step", iteration, self.rank)

    # ---- non-finite values -----------------------------------------------------------------------------------------
    def scores(self, reward_fn: Any, iteration: int, default: Callable) -> Any:
        """`reward_fn` (None: the reward model), or a scorer whose row 0 is NaN."""
        if not self._active("score", iteration):
            return reward_fn
        base = reward_fn or default

        def nan_row_0(prompt_ids, rollout):
            out = torch.as_tensor(base(prompt_ids, rollout)).float().clone()
            out[0] = float("nan")
            return out

        return nan_row_0

    def advantages(self, advantages: torch.Tensor, iteration: int) -> None:
        if self._active("advantage", iteration):
            advantages[0, 0] = float("nan")

    def loss(self, role: str, loss: torch.Tensor, iteration: int) -> torch.Tensor:
        return loss * float("nan") if self._active("loss", iteration, role) else loss

    def grad(self, role: str, x: torch.Tensor, iteration: int):
        return Injection.nan_gradient_term(x) if self._active("grad", iteration, role) else 0.0
