"""Environment calls of one turn, in parallel across rows, each bounded by a timeout.

Environments are stateful Python objects, so they run in threads of this process (not worker processes). Threads
are daemons: a call that hangs past its timeout is abandoned (it cannot be killed) and a fresh thread takes its
place, so the pool keeps its width and a hung call never blocks the run's exit.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Optional, Sequence


class Outcome:
    """What one call gave: `value`, or `error` (a message) when it raised or timed out."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: Optional[str] = None):
        self.value, self.error = value, error


class EnvCalls:
    def __init__(self, workers: int, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._workers = 0
        for _ in range(int(workers)):
            self._spawn()

    def _spawn(self) -> None:
        self._workers += 1
        threading.Thread(target=self._work, name=f"env-call-{self._workers}", daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, fut, started = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            started.append(time.monotonic())
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001  (reported as the row's error)
                fut.set_exception(e)

    def run(self, calls: Sequence[Callable[[], Any]]) -> list[Outcome]:
        """Run every call; each may take `timeout_s` from the moment a thread starts it."""
        jobs = []
        for fn in calls:
            fut, started = Future(), []
            self._jobs.put((fn, fut, started))
            jobs.append((fut, started))
        out: list[Optional[Outcome]] = [None] * len(jobs)
        pending = set(range(len(jobs)))
        while pending:
            wait([jobs[i][0] for i in pending], timeout=min(0.05, self.timeout_s), return_when=FIRST_COMPLETED)
            now = time.monotonic()
            for i in list(pending):
                fut, started = jobs[i]
                if fut.done():
                    e = fut.exception()
                    out[i] = Outcome(fut.result()) if e is None else Outcome(error=f"{type(e).__name__}: {e}")
                    pending.discard(i)
                elif started and now - started[0] > self.timeout_s:
                    fut.cancel()  # a running call cannot be cancelled: its thread is abandoned and replaced
                    out[i] = Outcome(error=f"timed out after {self.timeout_s:g} s (env_timeout_s)")
                    pending.discard(i)
                    self._spawn()
        return out  # type: ignore[return-value]
