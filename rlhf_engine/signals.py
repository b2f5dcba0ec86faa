"""Preemption signals noted from the first moment of a rank process: SIGUSR1 only sets a flag (its default action
would kill the rank), and so does SIGTERM inside a SLURM job (SLURM_JOB_ID set), where it is the scheduler's notice
of a time limit or a preemption. Outside SLURM, SIGTERM keeps its default: launchers (deepspeed, torchrun) send it to
tear the ranks of a failed job down, and a rank stuck in a collective must die of it at once. `install()` runs at
the start of every launch script (cli.run_main); the trainers read `received()` at their boundaries
(trainer/preemption.py)."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any, Optional

_state: dict = {"received": None, "previous": {}}


def _note(signum: int, frame: Any) -> None:
    if _state["received"] is None:
        _state["received"] = signal.Signals(signum).name


def handled() -> tuple:
    """The signals noted here: SIGUSR1, and SIGTERM under SLURM (module docstring)."""
    return (signal.SIGUSR1, signal.SIGTERM) if os.environ.get("SLURM_JOB_ID") else (signal.SIGUSR1,)


def install() -> None:
    """Note the preemption signals (`handled()`) instead of dying (main thread only; idempotent)."""
    if threading.current_thread() is not threading.main_thread() or _state["previous"]:
        return
    _state["previous"] = {sig: signal.signal(sig, _note) for sig in handled()}


def uninstall() -> None:
    for sig, handler in _state["previous"].items():
        signal.signal(sig, handler)
    _state["previous"] = {}


def received() -> Optional[str]:
    """The name of the first preemption signal this process got, None before one."""
    return _state["received"]


def reset() -> None:
    """Forget a noted signal (tests that run several trainers in one process)."""
    _state["received"] = None
