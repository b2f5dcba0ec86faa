"""Fault injection for the reliability tests: documented test hooks, no-ops unless their variables are set.

    RLHF_ENGINE_TEST_KILL="RANK:ITERATION:PHASE"    that rank sends itself SIGKILL at that point (a crash, an OOM
                                                   kill, a node lost: nothing runs after it, no handler, no flush)
    RLHF_ENGINE_TEST_STALL="RANK:ITERATION:PHASE"   that rank sleeps forever there (alive, but it never joins the
                                                   next collective: a hung rank)
    RLHF_ENGINE_TEST_SIGNAL="RANK:ITERATION:PHASE"  that rank sends itself SIGUSR1 there (a preemption notice that
                                                   arrives at a chosen moment; trainer/preemption.py answers it)
    RLHF_ENGINE_TEST_RAISE="RANK:ITERATION:PHASE"   that rank raises InjectedFailure there (a bug or an error inside
                                                   a step, while its peers go on into the next collective)

Several points may be joined with ','. ITERATION is the 0-based PPO iteration (for `checkpoint`: the tag's number,
i.e. iterations completed). PHASE:

    rollout      start of the rollout phase (generation) of the iteration
    experience   start of the experience phase (old / reference log-probs, values, scores)
    train        start of the train phase (PPO updates)
    train_step   right after the iteration's first actor optimizer step (not a micro-step of gradient
                 accumulation): the weights in memory have moved, nothing of this iteration is on disk
    checkpoint   inside the save of checkpoint iter_ITERATION: after the DeepSpeed engine files were written,
                 before the per-rank state files and the COMPLETE marker (a save cut short)
    generate     inside each generate call of the iteration's rollouts (the generation backend wrapped by the
                 hooks), before it decodes: under ZeRO-3 the peers are then inside the call's collectives

The variables are read here only (`fault_point`). The trainer consults its points through its `TestHooks`
(rlhf_engine/hooks.py) at the start of each phase and after each guarded step; `checkpoint` is called directly by
`Checkpointer.save`. Used by tests/distributed/test_faults.py.
"""
from __future__ import annotations

import os
import signal
import sys
import time

KILL_VAR = "RLHF_ENGINE_TEST_KILL"
STALL_VAR = "RLHF_ENGINE_TEST_STALL"
SIGNAL_VAR = "RLHF_ENGINE_TEST_SIGNAL"
RAISE_VAR = "RLHF_ENGINE_TEST_RAISE"
PHASES = ("rollout", "experience", "train", "train_step", "checkpoint", "generate")


class InjectedFailure(RuntimeError):
    """The error `RLHF_ENGINE_TEST_RAISE` raises."""


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
    return bool(_points(KILL_VAR) or _points(STALL_VAR) or _points(SIGNAL_VAR) or _points(RAISE_VAR))


def fault_point(phase: str, iteration: int, rank: int) -> None:
    """Kill or stall this process when (rank, iteration, phase) is one of the points set; otherwise return."""
    point = (int(rank), int(iteration), phase)
    if point in _points(KILL_VAR):
        _say(f"rank {rank} (pid {os.getpid()}) kills itself with SIGKILL at iteration {iteration}, phase {phase}")
        os.kill(os.getpid(), signal.SIGKILL)
    if point in _points(SIGNAL_VAR):
        _say(f"rank {rank} (pid {os.getpid()}) sends itself SIGUSR1 at iteration {iteration}, phase {phase}")
        os.kill(os.getpid(), signal.SIGUSR1)
    if point in _points(RAISE_VAR):
        _say(f"rank {rank} (pid {os.getpid()}) raises InjectedFailure at iteration {iteration}, phase {phase}")
        raise InjectedFailure(f"injected failure on rank {rank} at iteration {iteration}, phase {phase}")
    if point in _points(STALL_VAR):
        _say(f"rank {rank} (pid {os.getpid()}) stalls forever at iteration {iteration}, phase {phase}")
        while True:
            time.sleep(3600)


def _say(msg: str) -> None:
    sys.stdout.flush()
    print(f"[fault injection] {msg} (unix time {time.time():.3f})", file=sys.stderr, flush=True)
