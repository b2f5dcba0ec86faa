"""A Python reward function run in worker processes, one call per response, each with a timeout.

    --reward_fn my_checks:run_tests --reward_workers 4 --reward_timeout_s 10 --reward_on_error 0

Verifiers that execute code hang and crash. Each response is scored by its own call `fn([prompt], [response],
**{column: [value]})` in one of `workers` processes (started with `spawn`, each importing the function by its
'module:function' spec once). A call that runs past `timeout_s` has its process killed; one whose process dies
(a segfault, `os.abort()`) is lost with it; one that raises is reported. Such a failed call gets `on_error`: None
stops the run with an error naming the row and why, a number is the failed row's score. The scores come back in the
order of the responses, and equal the serial call's wherever the function scores each response on its own (the
calling rule asks that of any reward function).

Start-up is never a call's time: a worker is *warm* once it has imported the function and said so (a handshake),
and only a warm, idle worker is handed a row; the row's clock starts then. Every worker is warm before the first row
of a call is handed out, and a lost process's successor starts at once but gets no row before its handshake (it
warms while the other workers score). `timeouts` and `restarts` count what happened (`take_counts`: the trainer's
`reward/worker_timeouts` and `reward/worker_restarts`).
"""
from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Sequence

from .loader import RewardFunctionError, call_reward_fn, load_reward_fn

log = logging.getLogger("rlhf_engine.rewards.workers")


def _serve(spec: str, conn: Connection) -> None:
    """A worker: load the function, say so ("ready"), then answer (prompts, responses, columns) calls until told to
    stop (None)."""
    try:
        fn = load_reward_fn(spec)
    except BaseException as e:  # noqa: BLE001  (the parent names it in its start-up error)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
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
    """One process: starting (`ready` False until its handshake), idle (`row` None) or scoring `row`. `deadline` is
    the handshake's limit while starting, the call's while scoring."""

    def __init__(self, ctx: Any, spec: str, startup_timeout_s: float):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(spec, child), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.row: Optional[int] = None
        self.deadline = time.monotonic() + startup_timeout_s

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class ParallelReward:
    """`spec`'s reward function in `workers` processes (module docstring); a reward function itself, with the
    wrapped function's signature (so the data columns it asks for are the same). `startup_timeout_s` bounds a
    worker's spawn and import (its handshake), which no call's `timeout_s` includes."""

    def __init__(self, spec: str, workers: int, timeout_s: float = 60.0, on_error: Optional[float] = None,
                 startup_timeout_s: float = 600.0):
        fn = load_reward_fn(spec)  # here first: a bad spec is a start-up error, before any process
        self.spec, self.workers, self.timeout_s, self.on_error = spec, int(workers), float(timeout_s), on_error
        self.startup_timeout_s = float(startup_timeout_s)
        self.__signature__ = inspect.signature(fn)
        self.__rlhf_spec__ = f"{spec} (in {self.workers} worker processes)"
        self._ctx = mp.get_context("spawn")  # no fork of a process holding process groups and threads
        self._pool: list[_Worker] = []
        self.timeouts = 0  # calls killed at timeout_s, since construction
        self.restarts = 0  # processes replaced (after a timeout, or a death during or between calls)
        self._taken = (0, 0)

    def take_counts(self) -> dict[str, int]:
        """Timeouts and restarts since the previous take (the trainer's per-iteration reward/* counts)."""
        now = (self.timeouts, self.restarts)
        (t0, r0), self._taken = self._taken, now
        return {"worker_timeouts": now[0] - t0, "worker_restarts": now[1] - r0}

    def warm(self) -> None:
        """Start the missing workers and wait until every one has imported the function (its handshake)."""
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self._ctx, self.spec, self.startup_timeout_s))
        while any(not w.ready for w in self._pool):
            for w, status, value in self._wait():
                self._handshake(w, status, value)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Sequence[Any]) -> list[float]:
        try:
            return self._score(prompts, responses, columns)
        except BaseException:
            if any(w.row is not None for w in self._pool):  # a half-finished call leaves answers in the pipes
                self.close()
            raise

    def _score(self, prompts: Sequence[str], responses: Sequence[str], columns: dict) -> list[float]:
        rows = [([prompts[i]], [responses[i]], {k: [v[i]] for k, v in columns.items()}) for i in range(len(responses))]
        scores: list[Optional[float]] = [None] * len(rows)
        failures: dict[int, str] = {}
        self.warm()  # before the first row: no call's clock runs during a spawn or an import
        pending = list(range(len(rows)))[::-1]
        while pending or any(w.row is not None for w in self._pool):
            for i, w in enumerate(self._pool):
                if not (pending and w.ready and w.row is None):
                    continue
                try:
                    if not w.process.is_alive():
                        raise BrokenPipeError
                    w.conn.send(rows[pending[-1]])
                except OSError:  # died between calls: the row waits for a warm worker, as this one's successor
                    w.process.join(5)
                    log.warning("reward function %s: an idle worker process died (exit code %s); it is replaced "
                                "(reward/worker_restarts)", self.spec, w.process.exitcode)
                    self._replace(i)
                    continue
                row = pending.pop()
                w.row, w.deadline = row, time.monotonic() + self.timeout_s  # the clock starts as a warm worker gets it
            for w, status, value in self._wait():
                if not w.ready:  # a successor's handshake
                    self._handshake(w, status, value)
                    continue
                row, w.row = w.row, None
                if status == "ok":
                    scores[row] = value
                    continue
                if status == "timeout":
                    self.timeouts += 1
                    value = f"timed out after {self.timeout_s:g} s (--reward_timeout_s)"
                failures[row] = value
                if status != "error":  # lost with its process: log it, and start a successor at once
                    log.warning("reward function %s: row %d of this rank's batch (%r -> %r) %s; its worker is "
                                "replaced (reward/worker_timeouts, reward/worker_restarts)", self.spec, row,
                                _excerpt(prompts[row]), _excerpt(responses[row]), value)
                    self._replace(self._pool.index(w))
        if failures and self.on_error is None:
            first = min(failures)
            raise RewardFunctionError(
                f"reward function {self.spec} failed on {len(failures)} of {len(rows)} responses; row {first} of "
                f"this rank's batch ({_excerpt(prompts[first])!r} -> {_excerpt(responses[first])!r}): "
                f"{failures[first]}. Fix the function, raise --reward_timeout_s, or score failed calls with "
                "--reward_on_error <score>")
        return [self.on_error if i in failures else s for i, s in enumerate(scores)]

    def _wait(self) -> list[tuple[_Worker, str, Any]]:
        """Wait for a message from a starting or scoring worker, or for the nearest deadline -> (worker, status,
        value) of each that answered ("ready", "ok", "error"), died ("died") or ran out of time ("timeout")."""
        watched = [w for w in self._pool if not w.ready or w.row is not None]
        answered = wait([w.conn for w in watched], max(0.0, min(w.deadline for w in watched) - time.monotonic()))
        now, out = time.monotonic(), []
        for w in watched:
            if w.conn in answered:
                try:
                    status, value = w.conn.recv()
                except (EOFError, OSError):
                    w.process.join(5)
                    status, value = "died", f"its worker process died (exit code {w.process.exitcode})"
            elif now >= w.deadline:
                status, value = "timeout", None
            else:
                continue
            out.append((w, status, value))
        return out

    def _handshake(self, w: _Worker, status: str, value: Any) -> None:
        if status == "ready":
            w.ready = True
            return
        why = (f"did not finish importing it within {self.startup_timeout_s:g} s" if status == "timeout"
               else f"failed while importing it: {value}" if status == "error" else f"died while importing it: {value}")
        self.close()
        raise RewardFunctionError(
            f"reward function {self.spec}: a worker process (--reward_workers) {why}. It loaded in the trainer's "
            "process: check what a fresh spawned process lacks (the working directory, sys.path, environment "
            "variables), or run it in-process with --reward_workers 0")

    def _replace(self, i: int) -> None:
        """Kill the pool's i-th worker and start its successor, which warms before it is handed a row."""
        self._pool[i].kill()
        self._pool[i] = _Worker(self._ctx, self.spec, self.startup_timeout_s)
        self.restarts += 1

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
