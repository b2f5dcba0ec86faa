"""TEST HOOKS: every test-only switch of the library, in one object the caller passes in; never set in a real run.

    hooks = TestHooks.from_env()            # what the launch scripts pass (launch/*.py); TestHooks() = all off
    build_trainer(cfg, hooks=hooks)         # the engine, the trainer and the checkpointer consult the same object
    hooks.attach(rank, actor_steps)         # by the trainer that runs the loop: who is asking, and the step count

Points the loop consults (each returns its argument, or 0, at once when nothing is set):

    hooks.at(phase, iteration)              # rollout / experience / train / checkpoint: kill or stall this rank here
    hooks.wrap_generator(backend)           # generate: a fault point inside every generate call (wraps the object)
    hooks.wrap_planner(planner, world)      # loss_token_mean="local": each rank's own token counts
    hooks.wrap_update_step(step)            # an actor / critic step whose loss or gradient is made NaN
    hooks.wrap_guard(guard)                 # train_step: the fault point after each guarded step
    hooks.after_step(iteration)             # train_step: after the iteration's first actor optimizer step
    hooks.scores(source, iteration)         # the reward source, or one that returns a NaN in row 0
    hooks.advantages(advantages, iteration) # advantage [0, 0] set to NaN
    hooks.loss(role, loss, iteration)       # the role's loss, or NaN
    hooks.grad(role, x, iteration)          # 0, or a term of value 0 whose gradient is NaN

Negative controls (plain fields): `use_position_ids=False` (the engine withholds position ids: trlx's left-padding
bug), `loss_token_mean="local"` (each rank's own token mean), `skip_on_resume={"rng", ...}` (state providers a resume
leaves alone). From the environment (`from_env`): the kill / stall / signal points of rlhf_engine/faults.py,
`RLHF_ENGINE_TEST_INJECT_NONFINITE` (JSON, see `Injection`) and `RLHF_ENGINE_TEST_SKIP_ON_RESUME` (comma-separated).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Optional

import torch

from . import faults

INJECT_ENV = "RLHF_ENGINE_TEST_INJECT_NONFINITE"
SKIP_ON_RESUME_ENV = "RLHF_ENGINE_TEST_SKIP_ON_RESUME"
LOSS_TOKEN_MEANS = ("global", "local")


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
    """The switches (all off by default) and the points the loop consults; see the module docstring."""

    __test__ = False  # not a pytest class

    def __init__(self, nonfinite: Optional[dict] = None, faults_on: bool = False, use_position_ids: bool = True,
                 loss_token_mean: str = "global", skip_on_resume: Iterable[str] = ()):
        if loss_token_mean not in LOSS_TOKEN_MEANS:
            raise ValueError(f"loss_token_mean must be one of {LOSS_TOKEN_MEANS}, got {loss_token_mean!r}")
        self.faults = faults_on
        self._steps: list = []  # the update steps (wrap_update_step), injected into once an injection is set
        self._injected: list = []
        self.nonfinite = nonfinite
        self.use_position_ids = use_position_ids
        self.loss_token_mean = loss_token_mean
        self.skip_on_resume = frozenset(skip_on_resume)
        self.rank, self.actor_steps = 0, (lambda: 0)
        self._steps_before: Optional[int] = None
        self._iteration, self._phase = 0, ""  # the last phase point (the wrapped objects' points act within it)

    @classmethod
    def from_env(cls, **switches: Any) -> "TestHooks":
        """The switches the environment sets; `switches` (constructor arguments) override them."""
        skip = os.environ.get(SKIP_ON_RESUME_ENV, "")
        read = dict(nonfinite=injection_from_env(), faults_on=faults.active(),
                    skip_on_resume=[s.strip() for s in skip.split(",") if s.strip()])
        return cls(**{**read, **switches})

    def attach(self, rank: int, actor_steps: Callable[[], int]) -> "TestHooks":
        """The rank the points compare against and the optimizer-step count `after_step` watches."""
        self.rank, self.actor_steps = rank, actor_steps
        return self

    @property
    def nonfinite(self) -> Optional[dict]:
        return self._spec

    @nonfinite.setter
    def nonfinite(self, spec: Optional[dict]) -> None:
        self._spec = spec
        self._injection = Injection(spec) if spec else None
        for step in self._steps if spec else ():
            self._inject_into(step)

    def _active(self, what: str, iteration: int, role: Optional[str] = None) -> bool:
        inj = self._injection
        return inj is not None and inj.active(what, self.rank, iteration, role)

    # ---- kill / stall ----------------------------------------------------------------------------------------------
    def at(self, phase: str, iteration: int) -> None:
        self._iteration, self._phase = iteration, phase  # the wrapped objects' points: at the last phase point
        if self.faults:
            faults.fault_point(phase, iteration, self.rank)
            if phase == "train":
                self._steps_before = self.actor_steps()

    def wrap_generator(self, backend: Any) -> Any:
        """The generation backend, with the `generate` fault point (at the iteration of the last `rollout` point)
        inside its every call; unchanged unless a fault point is set."""
        if not self.faults:
            return backend
        real, hooks = backend.generate, self

        def generate(*args, **kwargs):
            if hooks._phase == "rollout":  # not the evaluation's calls (they come before the iteration's points)
                faults.fault_point("generate", hooks._iteration, hooks.rank)
            return real(*args, **kwargs)

        backend.generate = generate
        return backend

    def wrap_planner(self, planner: Any, world_size: int) -> Any:
        """The micro-batch planner (trainer/update.py); with `loss_token_mean="local"` its token counts are this
        rank's own times the world size instead of the all-reduced ones (the negative control of the global token
        mean); unchanged otherwise."""
        if self.loss_token_mean == "local":
            planner.reduce_counts = lambda local: local * world_size
        return planner

    def wrap_update_step(self, step: Any) -> Any:
        """An actor or critic step (trainer/update.py) whose loss and gradient carry the non-finite injections of
        its role; unchanged until an injection is set (now, or later through `nonfinite`)."""
        self._steps.append(step)
        if self._injection is not None:
            self._inject_into(step)
        return step

    def _inject_into(self, step: Any) -> None:
        if step in self._injected:
            return
        self._injected.append(step)
        base, hooks = step.objective_loss, self

        def objective_loss(micro, counts):
            loss, stats = base(micro, counts)
            return hooks.loss(step.role, loss, hooks._iteration), stats

        step.objective_loss = objective_loss
        step.extra_gradient = lambda loss: hooks.grad(step.role, loss, hooks._iteration)

    def wrap_guard(self, guard: Any) -> Any:
        """The step guard, with the `train_step` fault point after each of its steps; unchanged unless a fault
        point is set."""
        if not self.faults:
            return guard
        real, hooks = guard.step, self

        def step(*args, **kwargs):
            out = real(*args, **kwargs)
            hooks.after_step(hooks._iteration)
            return out

        guard.step = step
        return guard

    def after_step(self, iteration: int) -> None:
        """After a guarded step: the `train_step` point once the actor's optimizer has really stepped (not a
        micro-step of gradient accumulation)."""
        if self.faults and self._steps_before is not None and self.actor_steps() != self._steps_before:
            self._steps_before = None
            faults.fault_point("train_step", iteration, self.rank)

    # ---- non-finite values -----------------------------------------------------------------------------------------
    def scores(self, source: Any, iteration: int) -> Any:
        """The reward source (a RewardFn), or a scorer whose row 0 is NaN."""
        if not self._active("score", iteration):
            return source

        def nan_row_0(prompt_ids, rollout):
            out = torch.as_tensor(source(prompt_ids, rollout)).float().clone()
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
