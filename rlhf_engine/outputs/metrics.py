"""`<output_dir>/metrics.jsonl`: one JSON object per line, written as it happens so a crashed run keeps its history."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from .run_dir import METRICS


def _plain(key: str, value: Any) -> Any:
    """0-dim / one-element tensors and numpy scalars -> python numbers; None and non-finite floats -> None (omitted)."""
    if hasattr(value, "item") and type(value) not in (int, float, bool):  # np.float64 subclasses float: convert too
        numel = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
        if numel != 1:
            raise TypeError(f"metric {key!r}: only scalars can be logged, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON line per `write(record)` to `<output_dir>/metrics.jsonl` and flushes it.

    Keys that do not apply are omitted: a value of None or a non-finite number (NaN, inf) drops its key, so the file
    never holds NaN. Tensors and numpy scalars become python numbers (floats stay floats, ints stay ints).
    `enabled=False` (ranks other than 0) makes every call a no-op and creates nothing.
    """

    def __init__(self, output_dir: str, enabled: bool = True):
        self.path = os.path.join(output_dir, METRICS)
        self.enabled = enabled
        self._file: Optional[Any] = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        out = {k: v for k, v in ((k, _plain(k, v)) for k, v in record.items()) if v is not None}
        line = json.dumps(out, allow_nan=False)  # nested NaN (inside a list) raises instead of writing NaN
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl (or of `<path>/metrics.jsonl` when `path` is a folder), in order.

    A last line cut short by a crash mid-write is skipped; a bad line anywhere else raises.
    """
    if os.path.isdir(path):
        path = os.path.join(path, METRICS)
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().split("\n") if ln.strip()]
    records = []
    for i, ln in enumerate(lines):
        try:
            records.append(json.loads(ln))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records
