"""One exception type for user errors, carrying every problem found at once, and the table of exit codes.

Validation code collects problems into a `Problems` list and raises once at the end, so a user fixing a config sees
all mistakes in one run instead of one per launch. The entry points (`cli.run_main`) map exceptions to the codes of
`EXIT_CODES`, once; nothing else chooses an exit code.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable


# ---- exit codes: the one table ---------------------------------------------------------------------------------------
EXIT_OK = 0
EXIT_FAILED = 1  # anything else: a crash, a collective that timed out or lost a peer, a reward function that raised
EXIT_USER_ERROR = 2  # ConfigError: configuration, data, model paths, batch arithmetic; nothing trained
EXIT_SKIPPED_STEPS = 3  # max_consecutive_skips updates in a row skipped (non-finite gradients / fp16 overflow)
EXIT_NON_FINITE = 4  # a non-finite score, advantage or loss; every rank stops
EXIT_PREEMPTED = 75  # preempted: a checkpoint was written, requeue me (EX_TEMPFAIL)
EXIT_CODES = {EXIT_OK: "done", EXIT_FAILED: "failed", EXIT_USER_ERROR: "user error (nothing trained)",
              EXIT_SKIPPED_STEPS: "too many skipped steps", EXIT_NON_FINITE: "non-finite value",
              EXIT_PREEMPTED: "preempted, checkpoint written"}
# Codes every rank reaches together at a clean end: the process group is torn down with a barrier first.
CLEAN_EXIT_CODES = frozenset({EXIT_OK, EXIT_PREEMPTED})


class TrainingStopped(RuntimeError):
    """Training cannot go on (every rank stops together); `exit_code` is what the entry point exits with."""

    exit_code = EXIT_FAILED


class RolloutServersLost(TrainingStopped):
    """No rollout server is up, or one answered what this run cannot train on: every trainer rank stops together,
    naming them, after a checkpoint of the iterations completed (trainer/ppo_trainer.py)."""


@dataclass(frozen=True)
class Problem:
    field: str  # the config field, flag, argument or file the problem is about
    value: Any  # what was given
    fix: str  # what to do instead

    def __str__(self) -> str:
        return f"  - {self.field} = {self.value!r}: {self.fix}"


class ConfigError(ValueError):
    """A user error (config, data, paths, batch arithmetic). `problems` lists every issue found."""

    def __init__(self, problems: Iterable[Problem], header: str = "invalid configuration"):
        self.problems = list(problems)
        self.header = header
        lines = [f"{header} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        lines += [str(p) for p in self.problems]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # pickle (multiprocessing, rank error gathering) with the problems, not the message
        return type(self), (self.problems, self.header)


class Problems(list):
    """Collects `Problem`s; `raise_if_any()` raises one `ConfigError` holding all of them."""

    def add(self, field: str, value: Any, fix: str) -> None:
        self.append(Problem(field, value, fix))

    def raise_if_any(self, header: str = "invalid configuration") -> None:
        if self:
            raise ConfigError(self, header)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the closest known name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""
