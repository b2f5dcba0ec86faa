"""What scores the rollouts when it is not a reward model: a reward function (in process or in workers), or a
reward server."""
from __future__ import annotations

import math
import os
import urllib.parse
from dataclasses import dataclass
from typing import Optional

from ..errors import Problems
from .fields import is_number, opt


@dataclass
class ScoringConfig:
    """A reward function or a reward server in place of the reward model (docs/rewards.md)."""

    reward_fn: str = opt("", "'module:function' scoring (prompts, responses) as text, one float each; replaces the "
                         "reward model (no reward engine is built) and the critic then starts from the actor.")
    reward_url: str = opt("", "A reward server instead of a reward model or function: each rank POSTs its batch as "
                          "JSON {prompts, responses, columns} and reads {scores} back (docs/rewards.md; reference "
                          "server: python -m rlhf_engine.rewards.serve). No reward engine is built.")
    reward_timeout_s: float = opt(60.0, "Seconds one attempt of a reward_url request (connect to last byte of the "
                                  "answer), or one reward_workers call, may take: the request is then retried, a "
                                  "worker call fails (reward_on_error).")
    reward_retries: int = opt(3, "reward_url: further attempts after a connection error, a timeout, a broken answer "
                              "or a 5xx answer (exponential backoff from 0.5 s); then the run stops naming the URL "
                              "and the last status.")
    reward_auth_token_env: str = opt("", "reward_url: the NAME of an environment variable holding the server's "
                                     "bearer token (sent as 'Authorization: Bearer ...'; the reference server's "
                                     "--auth_token_env). The token itself is never logged nor written to the run "
                                     "directory; only this name is.")
    reward_workers: int = opt(0, "Run reward_fn in N worker processes, one call per response, each limited to "
                              "reward_timeout_s (0 = in the trainer's process, one call per batch, no timeout). For "
                              "verifiers that run code: a hung or crashed call is contained.")
    reward_on_error: str = opt("stop", "reward_workers: what a call that raised, timed out or crashed its process "
                               "scores: 'stop' (the run stops naming the row; the default, so a broken verifier "
                               "is not mistaken for wrong answers) or a number (e.g. 0).")

    @property
    def on_error_score(self) -> Optional[float]:
        """reward_on_error as a score, None for 'stop'."""
        return None if self.reward_on_error == "stop" else float(self.reward_on_error)

    def validate(self, p: Problems, prefix: str = "") -> None:
        """Settings that fit the source (two sources at once: config/reward_source.py, from TrainConfig.validate)."""
        if self.reward_url and not (str(self.reward_url).startswith(("http://", "https://"))
                                    and urllib.parse.urlsplit(str(self.reward_url)).hostname):
            p.add("reward_url", self.reward_url, "must be an http:// or https:// URL with a host")
        if not (is_number(self.reward_timeout_s) and self.reward_timeout_s > 0):
            p.add("reward_timeout_s", self.reward_timeout_s, "must be > 0 (seconds)")
        if not (isinstance(self.reward_retries, int) and self.reward_retries >= 0):
            p.add("reward_retries", self.reward_retries, "must be a whole number >= 0")
        self._validate_auth(p)
        if not (isinstance(self.reward_workers, int) and self.reward_workers >= 0):
            p.add("reward_workers", self.reward_workers, "must be a whole number >= 0 (0 = in-process)")
        elif self.reward_workers and not self.reward_fn:
            p.add("reward_workers", self.reward_workers, "runs a reward_fn in worker processes: set reward_fn (a "
                  "reward_url server runs its own workers)")
        on_error = self.reward_on_error
        try:
            ok = on_error == "stop" or math.isfinite(float(on_error))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            p.add("reward_on_error", on_error, "must be 'stop' or a finite score, e.g. 0")
        elif on_error != "stop" and not self.reward_workers:
            p.add("reward_on_error", on_error, "scores failed worker calls: it needs reward_workers >= 1 (in-process "
                  "a failing reward function stops the run)")

    def _validate_auth(self, p: Problems) -> None:
        """The token's variable must name a set, non-empty variable (its value is never shown)."""
        name = self.reward_auth_token_env
        if not name:
            return
        if not self.reward_url:
            p.add("reward_auth_token_env", name, "sends a token to a reward server: set reward_url, or drop it")
        elif not os.environ.get(str(name), "").strip():
            p.add("reward_auth_token_env", name, f"the environment variable {name} is not set or is empty: export "
                  "it with the reward server's token before starting (the flag takes the variable's name, not the "
                  "token)")
