"""Data columns carried beside the prompts: what a reward function declares (rewards/loader.py) becomes a
`ColumnRequest`; the prompt pipeline keeps those columns of every row through blending, the eval split and the
tokenized-data cache, and the trainer hands them to the reward function with each sample."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ColumnRequest:
    """Columns to keep: `required` ones (a source without one is an error naming it), `optional` ones (kept when
    every source has them), or, with `all_columns`, every column the sources share besides the prompt column."""

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    all_columns: bool = False
    field: str = "reward_fn"  # the setting that asked for them, for error messages

    def __bool__(self) -> bool:
        return bool(self.required or self.optional or self.all_columns)

    def wanted(self, available: Sequence[str], prompt_column: str) -> list[str]:
        """The requested columns among one source's `available` ones (missing required ones are the caller's)."""
        if self.all_columns:
            return [c for c in available if c != prompt_column]
        return [c for c in (*self.required, *self.optional) if c in available]

    def cache_key(self) -> list:
        return [sorted(self.required), sorted(self.optional), self.all_columns]
