"""A reward server: the trainer POSTs each rank's batch as JSON and reads one score per response back.

    --reward_url http://host:8000/score

Request body: {"prompts": [...], "responses": [...], "columns": {name: [...], ...}}, one entry per response (the
columns are the data row's, as reward functions get them: every column the data sources share; the prompts as the
model saw them, templates applied). Expected answer: {"scores": [float, ...]}, one finite float per response, in
order. A reference server: `python -m rlhf_engine.rewards.serve` (serve.py).

Each request waits at most `timeout_s`. Connection errors, timeouts and 5xx answers are retried `retries` times with
exponential backoff (0.5 s, 1 s, 2 s, ...); a 4xx answer is not retried. What still fails raises
`RewardFunctionError` naming the URL and the last status, as does an answer with the wrong number of scores or a
non-finite one.
"""
from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from .loader import RewardFunctionError

BACKOFF_S = 0.5  # first pause between attempts; doubled after each


class RemoteReward:
    """A reward function (the calling rule's `**columns` form) that asks a reward server."""

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 3):
        self.url, self.timeout_s, self.retries = url, float(timeout_s), int(retries)
        self.__rlhf_spec__ = f"reward server {url}"  # how errors name it (loader.reward_fn_name)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Sequence[Any]) -> list[float]:
        body = json.dumps({"prompts": list(prompts), "responses": list(responses),
                           "columns": {k: list(v) for k, v in columns.items()}}).encode("utf-8")
        answer = self._post(body)
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise RewardFunctionError(f"reward server {self.url} answered without a 'scores' list "
                                      f"(got {_excerpt(answer)}); it must answer {{\"scores\": [float, ...]}}")
        if len(scores) != len(responses):
            raise RewardFunctionError(f"reward server {self.url} returned {len(scores)} scores for {len(responses)} "
                                      "responses; it must return one score per response, in order")
        try:
            values = [float(s) for s in scores]
        except (TypeError, ValueError) as e:
            raise RewardFunctionError(f"reward server {self.url} returned a score that is not a number ({e})") from e
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise RewardFunctionError(f"reward server {self.url} returned non-finite scores for responses {bad[:10]} "
                                      f"of the batch (values {[values[i] for i in bad[:10]]})")
        return values

    def _post(self, body: bytes) -> Any:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    raw = response.read()
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}: {_excerpt(e.read().decode('utf-8', 'replace'))}"
                if e.code < 500:  # the request itself is wrong: another try gets the same answer
                    break
                continue
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as e:
                reason = getattr(e, "reason", e)
                last = (f"no answer within {self.timeout_s:g} s" if isinstance(reason, (socket.timeout, TimeoutError))
                        else f"connection failed ({reason})")
                continue
            try:
                return json.loads(raw)
            except ValueError:
                raise RewardFunctionError(f"reward server {self.url} answered with something that is not JSON: "
                                          f"{_excerpt(raw.decode('utf-8', 'replace'))}") from None
        tries = f"{attempt + 1} attempt{'s' if attempt else ''}"
        raise RewardFunctionError(f"reward server {self.url} failed after {tries} (--reward_retries "
                                  f"{self.retries}, --reward_timeout_s {self.timeout_s:g}); last: {last}")


def _excerpt(x: Any, n: int = 200) -> str:
    s = x if isinstance(x, str) else repr(x)
    return s if len(s) <= n else s[:n] + "..."
