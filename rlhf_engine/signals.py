"""Preemption signals noted from the first moment of a rank process: the handled signals only set a flag (SIGUSR1's
default action would kill the rank). Which ones: `--preempt_signals`, 'auto' by default = SIGUSR1, plus SIGTERM
inside a SLURM job (SLURM_JOB_ID set), where it is the scheduler's notice of a time limit or a preemption. Outside
SLURM, 'auto' leaves SIGTERM its default: launchers (deepspeed, torchrun) send it to tear the ranks of a failed job
down, and a rank stuck in a collective must die of it at once; torchrun elastic agents and Kubernetes users opt in
with `--preempt_signals USR1,TERM`. `install()` runs at the start of every launch script (cli.run_main) with 'auto'
and again with the run's setting once it is parsed; the trainers read `received()` at their boundaries
(trainer/preemption.py) and `received_at()` (wall clock, comparable across ranks) to log how long a preemption
checkpoint took.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Optional

_state: dict = {"received": None, "wall": None, "previous": {}}


def _note(signum: int, frame: Any) -> None:
    if _state["received"] is None:
        _state["received"] = signal.Signals(signum).name
        _state["wall"] = time.time()


def handled(spec: str = "auto") -> tuple:
    """The signals `spec` names: 'auto' = SIGUSR1, and SIGTERM under SLURM; or a comma-separated list of names
    (USR1, USR2, TERM, with or without the SIG prefix; config/run.py validates them)."""
    if spec == "auto":
        return (signal.SIGUSR1, signal.SIGTERM) if os.environ.get("SLURM_JOB_ID") else (signal.SIGUSR1,)
    names = [n.strip().upper().removeprefix("SIG") for n in spec.split(",") if n.strip()]
    return tuple(signal.Signals["SIG" + n] for n in dict.fromkeys(names))


def install(spec: str = "auto") -> None:
    """Note the signals `spec` names instead of dying (main thread only). Installing again replaces the previous
    set: a signal no longer named gets its original handler back."""
    if threading.current_thread() is not threading.main_thread():
        return
    wanted = handled(spec)
    previous = _state["previous"]
    for sig in [s for s in previous if s not in wanted]:
        signal.signal(sig, previous.pop(sig))
    for sig in wanted:
        if sig not in previous:
            previous[sig] = signal.signal(sig, _note)


def uninstall() -> None:
    for sig, handler in _state["previous"].items():
        signal.signal(sig, handler)
    _state["previous"] = {}


def installed() -> tuple:
    """The signals noted now."""
    return tuple(_state["previous"])


def received() -> Optional[str]:
    """The name of the first preemption signal this process got, None before one."""
    return _state["received"]


def received_at() -> Optional[float]:
    """Wall-clock time (time.time()) of that signal, None before one: comparable across the ranks of a job."""
    return _state["wall"]


def reset() -> None:
    """Forget a noted signal (tests that run several trainers in one process)."""
    _state["received"] = _state["wall"] = None
