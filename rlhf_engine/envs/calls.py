"""Environment calls of one turn, in parallel across rows, each bounded by a timeout.

Environments are stateful Python objects, so they run in threads of this process (not worker processes). Threads
are daemons: a call that hangs past its timeout is abandoned (it cannot be killed) and a fresh thread takes its
place, so the pool keeps its width and a hung call never blocks the run's exit. An abandoned thread whose call
returns at last leaves (the pool stays at its width). Abandoned threads still running are bounded: past
`max_abandoned` of them (`--env_max_abandoned_calls`) `run` raises, since a run that keeps leaking threads to a
hanging environment would otherwise go on until the process runs out of them.

`abandoned` counts every call abandoned so far (each left its thread running; the trainer's `env/abandoned_calls` is
its increase over a batch); `abandoned_alive` counts, at read time, the abandoned threads still running their call
(what the limit bounds: a thread that came back costs nothing).
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


class TooManyAbandonedCalls(RuntimeError):
    """More abandoned environment threads still running than --env_max_abandoned_calls allows."""


class EnvCalls:
    def __init__(self, workers: int, timeout_s: float, max_abandoned: int):  # the default: --env_max_abandoned_calls
        self.timeout_s, self.max_abandoned = float(timeout_s), int(max_abandoned)
        self.abandoned = 0  # calls abandoned so far
        self._stuck: set[threading.Thread] = set()  # abandoned threads still running their call
        self._lock = threading.Lock()  # a call's completion against its abandonment
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._workers = 0
        for _ in range(int(workers)):
            self._spawn()

    @property
    def abandoned_alive(self) -> int:
        """Abandoned threads still running their call, now."""
        with self._lock:
            return len(self._stuck)

    def _spawn(self) -> None:
        self._workers += 1
        threading.Thread(target=self._work, name=f"env-call-{self._workers}", daemon=True).start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            if not self._work_one(me, *self._jobs.get()):
                return

    def _work_one(self, me: threading.Thread, fn: Callable[[], Any], fut: Future, started: list) -> bool:
        """One call; False when this thread was replaced while it ran (it leaves, so the pool keeps its width). A
        function of its own so that an idle thread's frame holds nothing of its last call (its environment, and
        through it the trainer)."""
        if not fut.set_running_or_notify_cancel():
            return True
        started.append((time.monotonic(), me))
        try:
            result, error = fn(), None
        except BaseException as e:  # noqa: BLE001  (reported as the row's error)
            result, error = None, e
        with self._lock:  # done and abandoned exclude each other: `run` checks done() under the same lock
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            if me in self._stuck:
                self._stuck.discard(me)
                return False
        return True

    def run(self, calls: Sequence[Callable[[], Any]]) -> list[Outcome]:
        """Run every call; each may take `timeout_s` from the moment a thread starts it. Raises
        TooManyAbandonedCalls when more than `max_abandoned` abandoned threads are still running."""
        self._check_abandoned()
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
                if not fut.done() and started and now - started[0][0] > self.timeout_s and self._abandon(fut, started):
                    out[i] = Outcome(error=f"timed out after {self.timeout_s:g} s (env_timeout_s)")
                    pending.discard(i)
                elif fut.done():
                    e = fut.exception()
                    out[i] = Outcome(fut.result()) if e is None else Outcome(error=f"{type(e).__name__}: {e}")
                    pending.discard(i)
            if self.abandoned_alive > self.max_abandoned:
                for i in pending:  # queued calls are dropped; the ones running finish in their threads
                    jobs[i][0].cancel()
                self._check_abandoned()
        return out  # type: ignore[return-value]

    def _abandon(self, fut: Future, started: list) -> bool:
        """Give up on a running call whose time is up: its thread is left running and a fresh one takes its place.
        False when the call completed meanwhile."""
        with self._lock:
            if fut.done():
                return False
            self._stuck.add(started[0][1])
            self.abandoned += 1
        self._spawn()
        return True

    def _check_abandoned(self) -> None:
        n = self.abandoned_alive
        if n > self.max_abandoned:
            raise TooManyAbandonedCalls(
                f"{n} environment calls that ran past --env_timeout_s ({self.timeout_s:g} s) are still running in "
                f"abandoned threads, more than --env_max_abandoned_calls ({self.max_abandoned}): the environment "
                "hangs. Fix what its reset() or step() waits on, raise --env_timeout_s if its calls are merely slow, "
                "or raise --env_max_abandoned_calls")
