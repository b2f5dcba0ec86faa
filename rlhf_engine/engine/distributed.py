"""Distributed start-up: one code path for the deepspeed launcher, torchrun, SLURM-less single processes and pytest."""
from __future__ import annotations

import datetime
import importlib
import os
import socket
from dataclasses import dataclass

import torch

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """An unused TCP port on localhost (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_minutes: float | None = None) -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (idempotent).

    Without launcher variables (a plain `python script.py`) a one-rank environment on a free port is set up first.
    On CPU the gloo backend is used and DeepSpeed's shm-comm C++ op is not built (its JIT build costs 40 s and plain
    gloo is enough). The collective timeout comes from `timeout_minutes`, else `DEEPSPEED_TIMEOUT` (minutes), else 10.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # local: only the engine package imports deepspeed
    importlib.import_module("torch._dynamo")  # must precede zero.Init (DeepSpeed 0.19 + torch 2.13)

    if not all(v in os.environ for v in ("RANK", "WORLD_SIZE")):
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    if not torch.distributed.is_initialized():
        minutes = timeout_minutes if timeout_minutes is not None else float(os.environ.get("DEEPSPEED_TIMEOUT", 10))
        deepspeed.init_distributed(timeout=datetime.timedelta(minutes=minutes))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over every rank (sum, max or min); a no-op when not distributed."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
               "min": torch.distributed.ReduceOp.MIN}
        torch.distributed.all_reduce(tensor, op=ops[op])
    return tensor


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
