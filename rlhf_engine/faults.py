"""Fault injection for the reliability tests: documented test hooks, no-ops unless their variables are set.

    RLHF_ENGINE_TEST_KILL="RANK:ITERATION:PHASE"    that rank sends itself SIGKILL at that point (a crash, an OOM
                                                   kill, a node lost: nothing runs after it, no handler, no flush)
    RLHF_ENGINE_TEST_STALL="RANK:ITERATION:PHASE"   that rank sleeps forever there (alive, but it never joins the
                                                   next collective: a hung rank)

Several points may be joined with ','. ITERATION is the 0-based PPO iteration (for `checkpoint`: the tag's number,
i.e. iterations completed). PHASE:

    rollout      start of the rollout phase (generation) of the iteration
    experience   start of the experience phase (old / reference log-probs, values, scores)
    train        start of the train phase (PPO updates)
    train_step   right after the iteration's first actor optimizer step (not a micro-step of gradient
                 accumulation): the weights in memory have moved, nothing of this iteration is on disk
    checkpoint   inside the save of checkpoint iter_ITERATION: after the DeepSpeed engine files were written,
                 before the per-rank state files and the COMPLETE marker (a save cut short)

Both variables are read here only (`fault_point`). The trainer phases are hooked by `install(trainer)` (called when
the trainer's Checkpointer is built, trainer/state.py), which wraps the trainer's phase methods and its engine's
`step` on that instance only when a point is set; `checkpoint` is called directly by `Checkpointer.save`. Used by
tests/distributed/test_faults.py.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

KILL_VAR = "RLHF_ENGINE_TEST_KILL"
STALL_VAR = "RLHF_ENGINE_TEST_STALL"
PHASES = ("rollout", "experience", "train", "train_step", "checkpoint")


def _points(var: str) -> set[tuple[int, int, str]]:
    spec = os.environ.get(var, "").strip()
    out = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            rank, iteration, phase = item.split(":")
            point = (int(rank), int(iteration), phase)
        except ValueError:
            raise ValueError(f"{var}={spec!r}: expected RANK:ITERATION:PHASE[,...], e.g. 1:3:train_step") from None
        if phase not in PHASES:
            raise ValueError(f"{var}={spec!r}: expected RANK:ITERATION:PHASE[,...]; phase {phase!r} is not one of "
                             f"{', '.join(PHASES)}")
        out.add(point)
    return out


def active() -> bool:
    """True when any fault point is set (the hooks are installed only then)."""
    return bool(_points(KILL_VAR) or _points(STALL_VAR))


def fault_point(phase: str, iteration: int, rank: int) -> None:
    """Kill or stall this process when (rank, iteration, phase) is one of the points set; otherwise return."""
    point = (int(rank), int(iteration), phase)
    if point in _points(KILL_VAR):
        _say(f"rank {rank} (pid {os.getpid()}) kills itself with SIGKILL at iteration {iteration}, phase {phase}")
        os.kill(os.getpid(), signal.SIGKILL)
    if point in _points(STALL_VAR):
        _say(f"rank {rank} (pid {os.getpid()}) stalls forever at iteration {iteration}, phase {phase}")
        while True:
            time.sleep(3600)


def _say(msg: str) -> None:
    sys.stdout.flush()
    print(f"[fault injection] {msg} (unix time {time.time():.3f})", file=sys.stderr, flush=True)


def install(trainer: Any) -> None:
    """Hook the phases of a PPO trainer (this instance only) when a fault point is set; a no-op otherwise."""
    if not active():
        return

    def rank() -> int:
        return int(trainer.engine.dist.rank)

    for phase in ("rollout", "experience", "train"):
        method = getattr(trainer, f"{phase}_phase")

        def hooked(*args, _method=method, _phase=phase, **kwargs):
            fault_point(_phase, trainer.iteration, rank())
            return _method(*args, **kwargs)

        setattr(trainer, f"{phase}_phase", hooked)
    engine = trainer.engine
    step = engine.step

    def hooked_step(role, *args, **kwargs):
        if role != "actor":
            return step(role, *args, **kwargs)
        counter = getattr(engine, "optimizer_steps", None)
        before = counter("actor") if counter else None
        out = step(role, *args, **kwargs)
        if counter is None or counter("actor") != before:  # an optimizer step, not a micro-step of accumulation
            fault_point("train_step", trainer.iteration, rank())
        return out

    engine.step = hooked_step
