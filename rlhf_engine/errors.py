"""One exception type for user errors, carrying every problem found at once.

Validation code collects problems into a `Problems` list and raises once at the end, so a user fixing a config sees
all mistakes in one run instead of one per launch.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable


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
