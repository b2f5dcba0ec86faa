"""Preemption signals noted from the first moment of a rank process: SIGUSR1 and SIGTERM only set a flag (the
default action of SIGUSR1 would kill the rank). `install()` runs at the start of every launch script
(cli.run_main); the trainers read `received()` at their boundaries (trainer/preemption.py)."""
from __future__ import annotations

import signal
import threading
from typing import Any, Optional

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_state: dict = {"received": None, "previous": {}}


def _note(signum: int, frame: Any) -> None:
    if _state["received"] is None:
        _state["received"] = signal.Signals(signum).name


def install() -> None:
    """Note SIGUSR1 / SIGTERM instead of dying (main thread only; idempotent)."""
    if threading.current_thread() is not threading.main_thread() or _state["previous"]:
        return
    _state["previous"] = {sig: signal.signal(sig, _note) for sig in SIGNALS}


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
