"""Where an iteration's wall time goes: `time/iteration` split into named parts, and `time/other` for the rest."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Mapping, Optional

PHASES = ("time/eval", "time/generate", "time/experience", "time/train")  # timed by the trainer's step itself
CARRIED = ("log", "checkpoint")  # timed at the end of one iteration, counted in the next one's window


class IterationClock:
    """The window of iteration N runs from the moment record N-1 was complete to the moment record N is. In order, it
    holds what ended iteration N-1 (writing its record and samples, its log line: `time/log`; the checkpointer's turn,
    a save or the preemption poll: `time/checkpoint`), then step N's phases (`PHASES`) and the metrics of N (the one
    reduction over ranks and the record: `time/metrics`). A harness that stamps the end of `PPOTrainer.step` sees the
    same windows shifted by one write, so the parts add up to its stamp-to-stamp time as well.

    `time/iteration` is the window; `time/other` = window - every named part: what nothing names (the loop's own
    bookkeeping), a few percent at most when the accounting is complete. The first iteration of a process has no
    window (no previous record): neither key is written then.
    """

    def __init__(self) -> None:
        self._last: Optional[float] = None
        self._carried = dict.fromkeys(CARRIED, 0.0)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time a part of the end of this iteration; it is reported in the next record as `time/<name>`."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self._carried[name] += time.perf_counter() - t

    def close(self, rec: Mapping[str, float], metrics: float) -> dict[str, float]:
        """The timing keys of the record `rec` (holding `PHASES`), now complete; `metrics`: seconds spent on its
        metrics so far."""
        now = time.perf_counter()
        out = {"time/metrics": metrics, **{f"time/{k}": v for k, v in self._carried.items()}}
        if self._last is not None:
            window, named = now - self._last, sum(rec[k] for k in PHASES) + sum(out.values())
            out.update({"time/iteration": window, "time/other": window - named})
        self._last = now
        self._carried = dict.fromkeys(CARRIED, 0.0)
        return out
