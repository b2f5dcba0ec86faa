"""The collectives the trainer, the data layer and the entry points use, over torch.distributed alone.

A bottom-level module (torch only): every function is a no-op, or the single-rank answer, when torch.distributed is
not initialised, so unit tests and one-process runs need no process group. Starting the process group is the engine's
job (`engine/distributed.init_distributed`, the only place that talks to DeepSpeed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return torch.distributed.get_rank() if initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if initialized() else 1


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over every rank (sum, max or min); a no-op when not distributed."""
    if world_size() > 1:
        torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, _OPS[op]))
    return tensor


def barrier() -> None:
    if initialized():
        torch.distributed.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` of rank `src` on every rank (one decision, whatever each rank's own view)."""
    if world_size() <= 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list:
    """Every rank's `obj`, in rank order."""
    if world_size() <= 1:
        return [obj]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def shutdown(ok: bool) -> None:
    """Tear the process group down on every rank together. `ok`: every rank got here (a barrier first, so nobody
    closes a connection a peer still uses); otherwise no collective, since a peer may be gone."""
    if initialized():
        if ok:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
