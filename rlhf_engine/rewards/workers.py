"""A Python reward function run in worker processes, one call per response, each with a timeout.

    --reward_fn my_checks:run_tests --reward_workers 4 --reward_timeout_s 10 --reward_on_error 0

Verifiers that execute code hang and crash. Each response is scored by its own call `fn([prompt], [response],
**{column: [value]})` in one of `workers` processes (started with `spawn`, each importing the function by its
'module:function' spec once). A call that runs past `timeout_s` has its process killed; one whose process dies
(a segfault, `os.abort()`) is lost with it; one that raises is reported. Such a failed call gets `on_error`: None
stops the run with an error naming the row and why, a number is the failed row's score. A lost process is replaced
before the next call. The scores come back in the order of the responses, and equal the serial call's wherever the
function scores each response on its own (the calling rule asks that of any reward function).
"""
from __future__ import annotations

import inspect
import multiprocessing as mp
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Sequence

from .loader import RewardFunctionError, call_reward_fn, load_reward_fn


def _serve(spec: str, conn: Connection) -> None:
    """A worker: load the function, then answer (prompts, responses, columns) calls until told to stop (None)."""
    fn = load_reward_fn(spec)
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if task is None:
            return
        try:
            conn.send(("ok", call_reward_fn(fn, *task)[0]))
        except Exception as e:  # noqa: BLE001  (any failure of the function is the row's, reported to the parent)
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx: Any, spec: str):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(spec, child), daemon=True)
        self.process.start()
        child.close()
        self.row: Optional[int] = None  # the row it is scoring
        self.deadline = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class ParallelReward:
    """`spec`'s reward function in `workers` processes (module docstring); a reward function itself, with the
    wrapped function's signature (so the data columns it asks for are the same)."""

    def __init__(self, spec: str, workers: int, timeout_s: float = 60.0, on_error: Optional[float] = None):
        fn = load_reward_fn(spec)  # here first: a bad spec is a start-up error, before any process
        self.spec, self.workers, self.timeout_s, self.on_error = spec, int(workers), float(timeout_s), on_error
        self.__signature__ = inspect.signature(fn)
        self.__rlhf_spec__ = f"{spec} (in {self.workers} worker processes)"
        self._ctx = mp.get_context("spawn")  # no fork of a process holding process groups and threads
        self._pool: list[_Worker] = []

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Sequence[Any]) -> list[float]:
        rows = [([prompts[i]], [responses[i]], {k: [v[i]] for k, v in columns.items()}) for i in range(len(responses))]
        scores: list[Optional[float]] = [None] * len(rows)
        failures: dict[int, str] = {}
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self._ctx, self.spec))
        pending = list(range(len(rows)))[::-1]
        busy: list[_Worker] = []
        idle = list(self._pool)
        while pending or busy:
            while pending and idle:
                w = idle.pop()
                if not w.process.is_alive():  # died between calls: replaced before it gets one
                    w = self._replace(w)
                w.row, w.deadline = pending.pop(), time.monotonic() + self.timeout_s
                w.conn.send(rows[w.row])
                busy.append(w)
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = wait([w.conn for w in busy], timeout)
            now = time.monotonic()
            for w in list(busy):
                if w.conn in ready:
                    try:
                        status, value = w.conn.recv()
                    except (EOFError, OSError):  # the process died with the call
                        w.process.join(5)
                        status, value = "lost", f"its worker process died (exit code {w.process.exitcode})"
                elif now >= w.deadline:
                    status, value = "lost", f"timed out after {self.timeout_s:g} s (--reward_timeout_s)"
                else:
                    continue
                busy.remove(w)
                if status == "ok":
                    scores[w.row] = value
                else:
                    failures[w.row] = value
                idle.append(self._replace(w) if status == "lost" else w)  # a lost process gets a successor
        if failures and self.on_error is None:
            first = min(failures)
            raise RewardFunctionError(
                f"reward function {self.spec} failed on {len(failures)} of {len(rows)} responses; row {first} of "
                f"this rank's batch ({_excerpt(prompts[first])!r} -> {_excerpt(responses[first])!r}): "
                f"{failures[first]}. Fix the function, raise --reward_timeout_s, or score failed calls with "
                "--reward_on_error <score>")
        return [self.on_error if i in failures else s for i, s in enumerate(scores)]

    def _replace(self, w: _Worker) -> _Worker:
        i = self._pool.index(w)
        w.kill()
        self._pool[i] = _Worker(self._ctx, self.spec)
        return self._pool[i]

    def close(self) -> None:
        for w in self._pool:
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.process.join(2)
            w.kill()
        self._pool = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown: the daemon processes end with it anyway)
            pass


def _excerpt(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."
