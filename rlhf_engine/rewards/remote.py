"""A reward server: the trainer POSTs each rank's batch as JSON and reads one score per response back.

    --reward_url http://host:8000/score [--reward_auth_token_env REWARD_TOKEN]

Request body: {"prompts": [...], "responses": [...], "columns": {name: [...], ...}, "rollout": {...}}, one entry per
response (the columns are the data row's, as reward functions get them: every column the data sources share; the
prompts as the model saw them, templates applied). "rollout" comes with every batch the trainer scores (not when
called as a plain function): the rollout's own tokens, so that a reward model scores exactly what the in-process
reward engine would (reward_inputs.py has the rules):
    prompt_ids      [[int]]   each prompt's real tokens (padding dropped), in the actor's vocabulary
    response_ids    [[int]]   each response's tokens, its stop token included
    ended_with_eos  [bool]    whether the response ended at a stop token (False: cut at max_answer_seq_len)
    vocab           str       `vocab_fingerprint` of the actor's tokenizer: a server uses the ids only when its
                              reward model's tokenizer has the same one, and re-encodes the text otherwise
    plain_prompts   [str]     the prompts decoded without special tokens (the text such a re-encoding starts from)
    row_texts       [str]|null  each sample's prompt as the data has it (for a reward model's chat template)
Headers: `X-Request-Id`, one per batch and the same on each of its retries (a server answers a retry from the first
computation instead of scoring the batch again), and `Authorization: Bearer <token>` with `auth_token_env`.
Expected answer: {"scores": [float, ...]}, one finite float per response, in order. A reference server:
`python -m rlhf_engine.rewards.serve` (serve.py).

Each attempt has a deadline of `timeout_s`, from connecting to the answer's last byte: a watchdog shuts the socket at
the deadline, so a server that trickles its answer cannot stretch an attempt. Connection errors, timeouts, broken
answers (http.client's IncompleteRead, RemoteDisconnected, ...), 5xx, 408 and 429 answers are retried `retries`
times with exponential backoff (0.5 s, 1 s, 2 s, ...), or after the answer's `Retry-After` (seconds or an HTTP date)
when that is longer, up to MAX_RETRY_AFTER_S; other 4xx answers are not. What still fails raises
`RewardFunctionError` naming the URL and the last failure, as does an answer with the wrong number of scores or a
non-finite one. The connection goes straight to the URL's host (proxy variables are not read).
"""
from __future__ import annotations

import contextlib
import datetime
import email.utils
import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable, Optional, Sequence

from .loader import RewardFunctionError
from .reward_inputs import vocab_fingerprint

BACKOFF_S = 0.5  # first pause between attempts; doubled after each
RETRIED_STATUS = (408, 429)  # besides 5xx: the server asks for another try
MAX_RETRY_AFTER_S = 60.0  # the longest pause a server's Retry-After gets (the trainer's ranks wait meanwhile)


class _Expired(Exception):
    """The attempt's deadline passed."""


class RemoteReward:
    """A reward function (the calling rule's `**columns` form) that asks a reward server."""

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 3, auth_token_env: str = ""):
        self.url, self.timeout_s, self.retries = url, float(timeout_s), int(retries)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward_url {url!r} must be an http:// or https:// URL with a host")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._target = (parts.scheme, parts.hostname, parts.port, path)
        self._headers = {"Content-Type": "application/json"}
        if auth_token_env:
            token = os.environ.get(auth_token_env, "").strip()
            if not token:
                raise ValueError(f"reward_auth_token_env = {auth_token_env!r}: the environment variable is not set "
                                 "or is empty; export it with the reward server's token")
            self._headers["Authorization"] = f"Bearer {token}"  # only ever sent, never shown
        self.__rlhf_spec__ = f"reward server {url}"  # how errors name it (loader.reward_fn_name)

    def __repr__(self) -> str:  # never the headers (the token)
        return f"RemoteReward({self.url!r})"

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Sequence[Any]) -> list[float]:
        return self._score(prompts, responses, columns, None)

    def for_rollout(self, rollout: Any, tokenizer: Any) -> Callable[..., list[float]]:
        """This reward function for one rollout batch: its requests also carry the rollout's tokens (module
        docstring). The trainer calls this (experience.text_reward); the calling rule is unchanged."""
        block = rollout_block(rollout, tokenizer)

        def score(prompts: Sequence[str], responses: Sequence[str], **columns: Sequence[Any]) -> list[float]:
            return self._score(prompts, responses, columns, block)

        score.__rlhf_spec__ = self.__rlhf_spec__
        return score

    def _score(self, prompts: Sequence[str], responses: Sequence[str], columns: dict,
               block: Optional[dict]) -> list[float]:
        payload = {"prompts": list(prompts), "responses": list(responses),
                   "columns": {k: list(v) for k, v in columns.items()}}
        if block is not None:
            payload["rollout"] = block
        answer = self._post(json.dumps(payload).encode("utf-8"))
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
        headers = dict(self._headers, **{"X-Request-Id": uuid.uuid4().hex})  # one id for every retry of the batch
        last, asked = "", 0.0  # asked: the last answer's Retry-After, in seconds
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(max(BACKOFF_S * 2 ** (attempt - 1), min(asked, MAX_RETRY_AFTER_S)))
            asked = 0.0
            try:
                status, reason, raw, asked = self._attempt(body, headers)
            except _Expired:
                last = f"no answer within {self.timeout_s:g} s"
                continue
            except http.client.HTTPException as e:  # before OSError: RemoteDisconnected is both
                last = f"broken answer ({type(e).__name__}: {e})"
                continue
            except OSError as e:
                last = f"connection failed ({type(e).__name__}: {e})"
                continue
            if status >= 300:
                last = f"HTTP {status} {reason}: {_excerpt(raw.decode('utf-8', 'replace'))}"
                if status >= 500 or status in RETRIED_STATUS:
                    continue
                break  # the request itself is wrong: another try gets the same answer
            try:
                return json.loads(raw)
            except ValueError:
                raise RewardFunctionError(f"reward server {self.url} answered with something that is not JSON: "
                                          f"{_excerpt(raw.decode('utf-8', 'replace'))}") from None
        tries = f"{attempt + 1} attempt{'s' if attempt else ''}"
        raise RewardFunctionError(f"reward server {self.url} failed after {tries} (--reward_retries "
                                  f"{self.retries}, --reward_timeout_s {self.timeout_s:g}); last: {last}")

    def _attempt(self, body: bytes, headers: dict) -> tuple[int, str, bytes, float]:
        """One POST -> (status, reason, body, Retry-After in seconds or 0), all of it within `timeout_s` (raises
        _Expired past it)."""
        scheme, host, port, path = self._target
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = cls(host, port, timeout=self.timeout_s)  # each socket operation; the watchdog bounds their sum
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            if conn.sock is not None:  # wakes a blocked send or receive
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(self.timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()
            if expired.is_set():  # it fired before the socket existed
                raise _Expired
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            chunks = []
            while not expired.is_set():
                chunk = response.read1(1 << 16)  # what has arrived: a trickle cannot hold the loop past the deadline
                if not chunk:
                    break
                chunks.append(chunk)
            if expired.is_set():
                raise _Expired
            if response.length:  # closed before the length it announced
                raise http.client.IncompleteRead(b"".join(chunks), response.length)
            return response.status, response.reason, b"".join(chunks), retry_after(response.getheader("Retry-After"))
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or isinstance(e, TimeoutError):  # a socket timeout may beat the watchdog's thread
                raise _Expired from None
            raise
        finally:
            watchdog.cancel()
            conn.close()


def retry_after(value: Optional[str]) -> float:
    """A Retry-After header -> seconds to wait (0: none, or one that cannot be read): delay-seconds or an HTTP date."""
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    if when.tzinfo is None:  # an HTTP date is GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def rollout_block(rollout: Any, tokenizer: Any) -> dict:
    """The "rollout" part of a request (module docstring) from a `Rollout` and the actor's tokenizer."""
    P = rollout.prompt_length
    masks = rollout.attention_mask[:, :P].bool().tolist()
    prompt_ids = [[t for t, m in zip(row, mask) if m] for row, mask in zip(rollout.prompts.tolist(), masks)]
    response_ids = [row[:int(n)] for row, n in zip(rollout.responses.tolist(), rollout.response_lengths.tolist())]
    return {"prompt_ids": prompt_ids, "response_ids": response_ids,
            "ended_with_eos": [bool(e) for e in rollout.ended_with_eos.tolist()],
            "vocab": vocab_fingerprint(tokenizer),
            # as the trainer's decode_rollout does: the text a reward model of another vocabulary re-encodes
            "plain_prompts": [tokenizer.decode(p, skip_special_tokens=True) for p in prompt_ids],
            "row_texts": [row.text for row in rollout.rows] if rollout.rows else None}


def _excerpt(x: Any, n: int = 200) -> str:
    s = x if isinstance(x, str) else repr(x)
    return s if len(s) <= n else s[:n] + "..."
