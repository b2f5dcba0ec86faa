"""Requests spread over the rollout servers (docs/rollout-servers.md): each request goes to the server with the fewest
outstanding requests among those up (ties: the one least recently chosen), and a server that refuses, times out or
answers 5xx is marked down and its request goes to another server with the same body (the same seed: the same
samples wherever it lands; nothing is lost or answered twice). When no server is up, a request waits for one to be
marked up again (the trainer re-admits a server that answers once it holds the current weights:
engine/generation/servers.py); it fails only when none has been up for `wait_s`, naming every server and why it
went down.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from typing import Callable, Optional

from .client import ServerClient, ServerError


class NoServerUp(RuntimeError):
    """Every rollout server is down (the message names each and why)."""


class ServerPool:
    """`wait_s`: how long a request waits, with no server up, for one to be marked up (0: it fails at once)."""

    def __init__(self, clients: list, max_in_flight: int = 64, wait_s: float = 0.0):
        if not clients:
            raise ValueError("a server pool needs at least one server")
        self.clients = list(clients)
        self.wait_s = float(wait_s)
        self.outstanding = [0] * len(self.clients)
        self.down: dict = {}  # index -> why
        self.served = [0] * len(self.clients)  # requests answered, per server
        self.moved = 0  # requests that went to another server after their first failed
        self.waiting = 0  # requests waiting now for a server to be up
        self._none_up_since: Optional[float] = None  # monotonic time the last server went down
        self._last = [0] * len(self.clients)
        self._tick = itertools.count(1)
        self._lock = threading.Condition()
        self._threads = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="rollout-request")

    @property
    def up(self) -> list:
        with self._lock:
            return [c for i, c in enumerate(self.clients) if i not in self.down]

    def down_now(self) -> dict:
        """{index: why} of the servers down now (a copy: request threads may mark one down meanwhile)."""
        with self._lock:
            return dict(self.down)

    def mark_down(self, index: int, why: str) -> None:
        with self._lock:
            self.down.setdefault(index, why)
            if len(self.down) == len(self.clients) and self._none_up_since is None:
                self._none_up_since = time.monotonic()

    def mark_up(self, index: int) -> None:
        with self._lock:
            self.down.pop(index, None)
            self._none_up_since = None
            self._lock.notify_all()

    def _pick(self) -> int:
        with self._lock:
            while len(self.down) == len(self.clients):
                left = self._none_up_since + self.wait_s - time.monotonic()
                if left <= 0:
                    raise NoServerUp(f"no rollout server has been up for {self.wait_s:g} s: " + "; ".join(
                        f"{self.clients[i].url}: {why}" for i, why in sorted(self.down.items())))
                self.waiting += 1
                try:
                    self._lock.wait(min(left, 1.0))
                finally:
                    self.waiting -= 1
            live = [i for i in range(len(self.clients)) if i not in self.down]
            i = min(live, key=lambda j: (self.outstanding[j], self._last[j]))
            self.outstanding[i] += 1
            self._last[i] = next(self._tick)
            return i

    def call(self, fn: Callable[[ServerClient], object]) -> tuple[int, object]:
        """(server index, fn(client)) on the least busy server up; a retriable failure marks that server down and
        tries the next. Raises NoServerUp when none is left, ServerError for a request the server refused (4xx)."""
        first = True
        while True:
            i = self._pick()
            try:
                out = fn(self.clients[i])
            except ServerError as e:
                if not e.retriable:
                    raise
                self.mark_down(i, str(e))
                if first:
                    with self._lock:
                        self.moved += 1
                first = False
                continue
            finally:
                with self._lock:
                    self.outstanding[i] -= 1
            with self._lock:
                self.served[i] += 1
            return i, out

    def submit(self, fn: Callable[[ServerClient, object], object], item) -> concurrent.futures.Future:
        """A future of fn(client, item) on the least busy server up when a thread takes it (failover as in call)."""
        return self._threads.submit(lambda: self.call(lambda c: fn(c, item))[1])

    def map(self, fn: Callable[[ServerClient, object], object], items: list) -> list:
        """[fn(client, item)] for every item, concurrently, each on the least busy server up, in items' order."""
        return [f.result() for f in [self.submit(fn, it) for it in items]]

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # requests waiting for a server fail now rather than after wait_s
            self.wait_s = 0.0
            self._lock.notify_all()


def counts(pool: Optional[ServerPool]) -> dict:
    """Per-pool counters for the logs."""
    if pool is None:
        return {}
    return {"servers/up": len(pool.up), "servers/moved_requests": pool.moved}
