"""The collectives of the whole package, over torch.distributed alone: the only module that calls them.

A bottom-level module (torch only): every function is a no-op, or the single-rank answer, when torch.distributed is
not initialised, so unit tests and one-process runs need no process group. Starting the process group is the engine's
job (`engine/distributed.init_distributed`, the only place that talks to DeepSpeed).

Tensors go where the group's backend serves them: NCCL reduces CUDA tensors only (a CPU tensor is refused with "No
backend type associated with device type cpu"), gloo CPU tensors (and CUDA ones through a copy). `all_reduce` moves
a tensor that lives elsewhere to `backend_device(group)` and writes the result back into the caller's tensor, so a
caller never needs to know which backend the run has. The layering test (tests/unit/test_layering.py) keeps every
other module off torch.distributed's collectives.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable, Optional

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


def backend_device(group: Any = None) -> torch.device:
    """The device whose tensors `group`'s backend reduces: cuda:LOCAL_RANK for NCCL, cpu otherwise (gloo)."""
    if initialized() and torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # init_distributed set it to LOCAL_RANK
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """In-place all-reduce over every rank of `group` (sum, max or min); a no-op when not distributed.

    The reduction runs on `backend_device(group)`; a tensor kept elsewhere is copied there and the result copied
    back into it, so the caller's tensor holds the answer on its own device either way."""
    if world_size() <= 1:
        return tensor
    op_ = getattr(torch.distributed.ReduceOp, _OPS[op])
    target = backend_device(group)
    if tensor.device == target:
        torch.distributed.all_reduce(tensor, op=op_, group=group)
        return tensor
    moved = tensor.to(target)
    torch.distributed.all_reduce(moved, op=op_, group=group)
    tensor.copy_(moved)
    return tensor


def agree(failed_here: bool, group: Any = None) -> bool:
    """Whether any rank failed: one all-reduce (max) of this rank's flag. Every "try, else fall back" around
    collective work decides with this, so that all ranks take the same path (a failure on one rank only, such as an
    out-of-memory error, must not send the ranks into different collectives)."""
    flag = torch.tensor([1.0 if failed_here else 0.0])
    return bool(all_reduce(flag, "max", group).item() > 0)


def max_over_ranks(values: list[int], group: Any = None) -> list[int]:
    """The element-wise maximum of every rank's `values` (equal lengths), in one all-reduce: how ranks agree on
    counts of collective work (micro-batches) that they would otherwise each decide alone."""
    if world_size() <= 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    return [int(v) for v in all_reduce(t, "max", group).tolist()]


def barrier(group: Any = None) -> None:
    if initialized():
        torch.distributed.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """`obj` of rank `src` on every rank (one decision, whatever each rank's own view)."""
    if world_size() <= 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list:
    """Every rank's `obj`, in rank order (over `group`, e.g. a new_cpu_group, else the default group)."""
    if world_size() <= 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def consecutive_groups(size: int) -> tuple[Optional[Any], list[int]]:
    """(this rank's group of `size` consecutive ranks, its members): ranks [k * size, (k + 1) * size) form group k,
    the layout vLLM gives its tensor-parallel groups under an external launcher. Every rank must call it (each
    creates every group, on the default backend); `size` must divide the world. (None, [rank]) for size 1 or
    without a process group."""
    if size <= 1 or not initialized():
        return None, [rank()]
    world = world_size()
    if world % size:
        raise ValueError(f"groups of {size} consecutive ranks cannot split a world of {world} ranks")
    mine = None
    for first in range(0, world, size):
        members = list(range(first, first + size))
        group = torch.distributed.new_group(members)  # collective: every rank creates every group, in order
        if rank() in members:
            mine = (group, members)
    return mine


def new_cpu_group(timeout: datetime.timedelta) -> Optional[Any]:
    """A gloo group of every rank with its own collective timeout (CPU tensors, whatever the default backend), or
    None when not distributed. Every rank must call it; end it with `destroy_group`."""
    return torch.distributed.new_group(backend="gloo", timeout=timeout) if initialized() else None


def destroy_group(group: Optional[Any]) -> None:
    if group is not None:
        torch.distributed.destroy_process_group(group)


# how long the other ranks wait for rank 0's single-rank step in `run_on_main` (a dead rank 0 ends it sooner)
MAIN_RANK_WAIT = datetime.timedelta(hours=12)


def run_on_main(fn: Callable[[], Any], what: str, timeout: datetime.timedelta = MAIN_RANK_WAIT) -> Any:
    """`fn()` on rank 0 while every other rank waits for its outcome, then every rank goes on together. Collective.

    A single-rank step (converting a checkpoint, writing a large model) may outlast the default group's collective
    timeout (`--dist_timeout_minutes`), so the others do not wait in a barrier of that group: they wait for rank 0's
    outcome on a gloo group of their own with `timeout`. A rank 0 that dies closes its connections and ends the wait
    at once. Returns fn's value on rank 0 (None elsewhere); an exception of fn is raised on rank 0 as it is and on
    the other ranks as a RuntimeError naming `what` and the error."""
    group = new_cpu_group(timeout)
    result, failure = None, None
    try:
        if rank() == 0:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001  (told to the waiting ranks first, then raised)
                failure = e
        error = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    finally:
        destroy_group(group)
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"rank 0 failed to {what}: {error}")
    return result


_AT_SHUTDOWN: list = []


def at_shutdown(fn: Callable[[], Any]) -> None:
    """Run `fn` in `shutdown`, after the barrier and before the group is destroyed: what holds the process group
    (a vLLM engine, which destroys it itself when it shuts down) ends first, in a known order."""
    _AT_SHUTDOWN.append(fn)


def shutdown(ok: bool) -> None:
    """Tear the process group down on every rank together. `ok`: every rank got here (a barrier first, so nobody
    closes a connection a peer still uses); otherwise no collective, since a peer may be gone. The `at_shutdown`
    callbacks run next, newest first."""
    if initialized() and ok:
        torch.distributed.barrier()
    failure = None
    while _AT_SHUTDOWN:  # each runs, whatever an earlier one raised; the group is destroyed, then the first raises
        try:
            _AT_SHUTDOWN.pop()()
        except Exception as e:  # noqa: BLE001
            failure = failure or e
    if initialized():
        torch.distributed.destroy_process_group()
    if failure is not None:
        raise failure
