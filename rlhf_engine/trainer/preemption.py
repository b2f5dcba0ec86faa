"""Preemption and time-based saving, decided at iteration (or optimizer-step) boundaries by every rank together.

A rank that receives SIGUSR1 or SIGTERM only notes it (the handler sets a flag: a save, an evaluation or a
collective in progress runs to its end). A request file `<output_dir>/PREEMPT_REQUESTED`, which the sbatch scripts
write for ranks a signal cannot reach (pdsh-started nodes), counts the same; rank 0 looks for it. At each boundary
`Boundary.poll` runs one all-reduce of two numbers: "a rank was asked to stop" and "save_interval_minutes have
passed since the last checkpoint". On a stop every rank writes a complete checkpoint of the iteration reached (unless
it was just written), rank 0 writes `PREEMPTED` beside its `COMPLETE` and `<output_dir>/PREEMPTED` (the sbatch
scripts requeue the job when that file is there), and the run exits with code 75 (`errors.EXIT_PREEMPTED`). Before
the first iteration there is nothing new to save: the run exits 75 with the run-level marker only.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Callable, Optional

import torch

from .. import signals
from ..comm import all_reduce
from ..errors import EXIT_PREEMPTED, TrainingStopped

log = logging.getLogger(__name__)

REQUEST_FILE = "PREEMPT_REQUESTED"  # written by the sbatch trap (launch/slurm/common.sh)
MARKER = "PREEMPTED"  # beside a checkpoint's COMPLETE, and in the run directory


class Preempted(TrainingStopped):
    """Every rank stopped at a boundary on a preemption request; the checkpoint (if any) is complete."""

    exit_code = EXIT_PREEMPTED


class Boundary:
    """What every rank decides at a boundary: stop for preemption, and whether a time-based save is due.

    The signal handlers are `rlhf_engine.signals`', installed at process start by the launch scripts (in-process
    use, a notebook, installs them with `signals.install()` if it wants them). `save_interval_minutes` 0 = no
    time-based saving; `clock` is injectable.
    """

    def __init__(self, dist: Any, output_dir: str, save_interval_minutes: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.dist, self.output_dir = dist, output_dir
        self.interval_s = float(save_interval_minutes or 0) * 60.0
        self.clock = clock
        self.last_save = clock()
        self.notice_at: Optional[float] = None  # wall time of the earliest stop request on any rank (after a poll)

    @property
    def received(self) -> Optional[str]:
        return signals.received()

    def saved(self) -> None:
        """A checkpoint was just written: the time-based interval starts again."""
        self.last_save = self.clock()

    def _requested_here(self) -> bool:
        return self._notice_here() is not None

    def _notice_here(self) -> Optional[float]:
        """Wall-clock time of this rank's stop request (its signal, or the request file's mtime), None without."""
        if self.received is not None:
            return signals.received_at()
        request = os.path.join(self.output_dir, REQUEST_FILE)
        if self.dist.is_main and os.path.exists(request):
            return os.path.getmtime(request)
        return None

    def poll(self) -> tuple[bool, bool]:
        """(stop, save_due), the same on every rank: one all-reduce (max) of two flags and of minus the earliest
        notice time (kept for `seconds_since_notice`, whichever rank was asked). Collective."""
        due = bool(self.interval_s) and self.clock() - self.last_save >= self.interval_s
        at = self._notice_here()
        flags = torch.tensor([float(at is not None), float(due), -at if at is not None else -math.inf],
                             dtype=torch.float64)
        stop, due, minus_first = all_reduce(flags, "max").tolist()
        if stop:
            self.notice_at = -minus_first
        return bool(stop), bool(due)

    def seconds_since_notice(self) -> Optional[float]:
        """Seconds from the earliest stop request on any rank (signal or request file) to now; None before one."""
        return None if self.notice_at is None else time.time() - self.notice_at

    def why(self) -> str:
        if self.received:
            return f"{self.received} received"
        return f"{REQUEST_FILE} found" if self._requested_here() else "another rank was asked to stop"

    # ---- the markers -------------------------------------------------------------------------------------------
    def write_markers(self, iteration: int, checkpoint: Optional[str]) -> None:
        """Rank 0: `PREEMPTED` beside the checkpoint's COMPLETE (when there is one) and in the run directory."""
        if not self.dist.is_main:
            return
        since = self.seconds_since_notice()
        body = {"iteration": int(iteration), "checkpoint": checkpoint, "why": self.why(),
                "seconds_since_signal": None if since is None else round(since, 3),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        targets = [os.path.join(checkpoint, MARKER)] if checkpoint else []
        targets.append(os.path.join(self.output_dir, MARKER))
        for path in targets:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(json.dumps(body, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
        request = os.path.join(self.output_dir, REQUEST_FILE)
        if os.path.exists(request):
            os.remove(request)  # answered: a requeued run must not stop again on it

    def stop(self, iteration: int, checkpoint: Optional[str]) -> Preempted:
        """Write the markers; the exception every rank raises to end the run with code 75."""
        self.write_markers(iteration, checkpoint)
        where = f"checkpoint {checkpoint} written" if checkpoint else "no checkpoint (nothing trained yet)"
        since = self.seconds_since_notice()
        if since is not None:  # the launcher's SIGKILL follows its SIGTERM after 30 s, SLURM's after GraceTime
            where += f" {since:.1f} s after the notice"
        if self.dist.is_main:
            log.warning("preempted at iteration %d (%s): %s; exit %d, requeue and --resume auto to continue",
                        iteration, self.why(), where, EXIT_PREEMPTED)
        return Preempted(f"preempted at iteration {iteration} ({self.why()}): {where}")


def clear_markers(output_dir: str) -> None:
    """A new attempt of the run (rank 0, at start): the previous attempt's run-level marker and request are old."""
    for name in (MARKER, REQUEST_FILE):
        path = os.path.join(output_dir, name)
        if os.path.exists(path):
            os.remove(path)
