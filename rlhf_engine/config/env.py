"""Multi-turn environments."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problems
from .fields import check_choice, check_positive, opt


ENV_ERRORS = ("stop", "score_zero")


@dataclass
class EnvConfig:
    """Multi-turn rollouts (docs/environments.md): the model writes a turn, an environment answers with an
    observation and a reward, until it says done. Observations are context, never trained on."""

    environment: str = opt("", "'module:factory': factory(row) gets a data row (its columns and 'prompt') and "
                           "returns an environment with reset() -> first user message or None (the row's prompt) "
                           "and step(response) -> Step(observation, reward, done). '' = single-turn rollouts "
                           "scored by the reward model or function.")
    max_turns: int = opt(4, "Most model turns per episode; the episode ends after the last one whatever the "
                         "environment says.")
    max_episode_tokens: int = opt(0, "Most tokens of an episode after the prompt, model turns and observations "
                                  "together (0 = max_turns x max_answer_seq_len). An episode that reaches it ends "
                                  "truncated (env/truncated_rate).")
    env_timeout_s: float = opt(30.0, "Seconds one reset() or step() call may take before it counts as an error.")
    env_max_abandoned_calls: int = opt(16, "Most environment calls abandoned after env_timeout_s whose threads "
                                       "are still running, on a rank (a thread cannot be killed; "
                                       "env/abandoned_calls counts the calls abandoned per iteration): past it the "
                                       "run stops naming both flags instead of leaking threads to a hanging "
                                       "environment. 0 = stop at the first call left running.")
    env_workers: int = opt(8, "Environment calls of a turn run in this many threads, across the batch's rows.")
    env_errors: str = opt("stop", "What an environment call that raised or timed out does: 'stop' (the default: "
                          "the run stops naming the row, so a broken environment is not mistaken for a failing "
                          "model) or 'score_zero' (the episode ends there, the failed turn scoring 0; counted in "
                          "env/errors).")

    @property
    def on(self) -> bool:
        return bool(self.environment)

    def episode_tokens(self, max_answer_seq_len: int) -> int:
        """The episode's token budget after the prompt."""
        return self.max_episode_tokens or self.max_turns * max_answer_seq_len

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not isinstance(self.environment, str) or (self.environment and ":" not in self.environment):
            p.add(prefix + "environment", self.environment, "must be 'module:factory' (or '' for single-turn)")
        for name in ("max_turns", "env_workers"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                p.add(prefix + name, v, "must be a whole number >= 1")
        v = self.max_episode_tokens
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            p.add(prefix + "max_episode_tokens", v, "must be a whole number >= 0 (0 = max_turns x "
                  "max_answer_seq_len)")
        v = self.env_max_abandoned_calls
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            p.add(prefix + "env_max_abandoned_calls", v, "must be a whole number >= 0 (abandoned environment threads "
                  "still running that the run tolerates; 0 = none)")
        check_positive(p, prefix, self, "env_timeout_s")
        check_choice(p, prefix, self, "env_errors", ENV_ERRORS)
