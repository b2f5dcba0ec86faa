"""Distributed start-up: one code path for the deepspeed launcher, torchrun, SLURM-less single processes and pytest."""
from __future__ import annotations

import datetime
import importlib
import os
import socket

import torch

from ..comm import DistInfo, all_reduce, barrier  # noqa: F401  (re-exported: the engine's own use)

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """An unused TCP port on localhost (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(environ) -> dict:
    """The variables `init_distributed` adds to the environment before the rendezvous: nothing under a launcher
    (RANK and WORLD_SIZE set: the deepspeed launcher, torchrun; they win over SLURM's variables), SLURM's mapping
    inside an srun task (`env_from_slurm`: one task per GPU), else one rank on a free local port."""
    if all(v in environ for v in ("RANK", "WORLD_SIZE")):
        return {}
    slurm = env_from_slurm(environ)
    if slurm:
        return slurm
    return dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=environ.get("MASTER_PORT", str(free_port())))


def init_distributed(timeout_minutes: float | None = None) -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (idempotent).

    Without launcher variables (RANK, WORLD_SIZE: the deepspeed launcher, torchrun) but inside an srun task, the
    rendezvous comes from SLURM's environment (`env_from_slurm`); otherwise (a plain `python script.py`) a one-rank
    environment on a free port is set up first.
    On CPU the gloo backend is used and DeepSpeed's shm-comm C++ op is not built (its JIT build costs 40 s and plain
    gloo is enough). The collective timeout comes from `timeout_minutes`, else `DEEPSPEED_TIMEOUT` (minutes), else 10.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # local: only the engine package imports deepspeed
    importlib.import_module("torch._dynamo")  # must precede zero.Init (DeepSpeed 0.19 + torch 2.13)

    os.environ.update(launch_env(os.environ))
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # Denormal floats (tiny Adam second moments, near-zero activations) are much slower on x86 CPUs; flush
        # them to zero (a precaution: its effect on our runs was not measured separately).
        torch.set_flush_denormal(True)

    if not torch.distributed.is_initialized():
        minutes = timeout_minutes if timeout_minutes is not None else float(os.environ.get("DEEPSPEED_TIMEOUT", 10))
        deepspeed.init_distributed(timeout=datetime.timedelta(minutes=minutes))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK is {local_rank} but this process sees {torch.cuda.device_count()} CUDA "
                               "device(s): every rank of a node must see all of the node's GPUs (under srun: "
                               "--gpus-per-node=N, not --gpus-per-task=1 or --gpu-bind=single)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


# ---- SLURM ---------------------------------------------------------------------------------------------------
SLURM_PORT_BASE = 15000  # MASTER_PORT = 15000 + job id % 10000: below Linux's ephemeral range, one port per job
SLURM_PORT_SPAN = 10000


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names: `node[01-03,07]` -> node01 node02 node03 node07;
    `gpu-a[1-2],cpu7` -> gpu-a1 gpu-a2 cpu7; `rack[1-2]-n[1-2]` -> rack1-n1 rack1-n2 rack2-n1 rack2-n2 (zero padding
    kept)."""
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        parts = [[""]]
        rest = item
        while rest:
            i = rest.find("[")
            if i < 0:
                parts.append([rest])
                break
            j = rest.index("]", i)
            parts.append([rest[:i]])
            parts.append(_expand_ranges(rest[i + 1:j]))
            rest = rest[j + 1:]
        names = [""]
        for choices in parts:
            names = [n + c for n in names for c in choices]
        hosts.extend(n for n in names if n)
    return hosts


def _split_top(s: str) -> list[str]:
    """Split at commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return [x for x in out if x]


def _expand_ranges(spec: str) -> list[str]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if not hi:
            out.append(lo)
            continue
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def parse_tasks_per_node(spec: str) -> list[int]:
    """SLURM's tasks-per-node list -> one count per node: `4(x2),3` -> [4, 4, 3]."""
    out: list[int] = []
    for part in _split_top(spec.strip()):
        n, _, rep = part.partition("(x")
        out.extend([int(n)] * (int(rep.rstrip(")")) if rep else 1))
    return out


def slurm_port(job_id: str) -> int:
    """A rendezvous port derived from the job id: the same for every task of the job (and after a requeue)."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit())
    if not digits:
        import zlib

        digits = str(zlib.crc32(str(job_id).encode()))
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN


def env_from_slurm(environ) -> dict:
    """The torch.distributed variables of an srun task, from SLURM's environment; {} when this is not one.

    RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), LOCAL_RANK = SLURM_LOCALID,
    LOCAL_SIZE / LOCAL_WORLD_SIZE = this node's entry of SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE),
    NODE_RANK = SLURM_NODEID, MASTER_ADDR = the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST,
    SLURM_NODELIST), MASTER_PORT = `slurm_port(SLURM_JOB_ID)`. MASTER_ADDR / MASTER_PORT already in the environment
    win. Only inside a job step (SLURM_STEP_ID set, i.e. under srun): the batch script itself also has
    SLURM_PROCID=0 and the allocation's SLURM_NTASKS, and a plain `python` there must not wait for tasks that
    never start."""
    env = environ
    if "SLURM_PROCID" not in env or not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        return {}
    world = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not world:
        return {}
    out = {"RANK": str(int(env["SLURM_PROCID"])), "WORLD_SIZE": str(int(world)),
           "LOCAL_RANK": str(int(env.get("SLURM_LOCALID", 0))), "NODE_RANK": str(int(env.get("SLURM_NODEID", 0)))}
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node:
        counts = parse_tasks_per_node(per_node)
        node = int(out["NODE_RANK"])
        if node < len(counts):
            out["LOCAL_SIZE"] = out["LOCAL_WORLD_SIZE"] = str(counts[node])
    out["MASTER_ADDR"] = env.get("MASTER_ADDR") or (expand_nodelist(nodelist)[0] if nodelist else "127.0.0.1")
    out["MASTER_PORT"] = env.get("MASTER_PORT") or str(slurm_port(env.get("SLURM_JOB_ID", "0")))
    return out


# ---- failures of the process group -----------------------------------------------------------------------------
_TIMEOUT_PATTERNS = ("timed out waiting", "watchdog caught collective operation timeout",
                     "collective operation timeout", "socket timeout", "wait timeout")
_PEER_LOST_PATTERNS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                       "nccl communicator was aborted", "remote process exited")
_BACKEND_WORDS = ("gloo", "nccl", "c10d", "processgroup")  # in the message of an error a collective raised


def collective_failure(exc: BaseException) -> str:
    """'timeout' when `exc` (or an exception it was raised from) is a collective operation that timed out, 'peer'
    when the connection to another rank was lost (it died), '' for anything else (e.g. a reward function's own
    network error)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        backend = isinstance(exc, dist_error) or any(w in text for w in _BACKEND_WORDS)
        if backend and isinstance(exc, (RuntimeError, OSError)):
            if any(p in text for p in _TIMEOUT_PATTERNS):
                return "timeout"
            if any(p in text for p in _PEER_LOST_PATTERNS):
                return "peer"
        exc = exc.__cause__ or exc.__context__
    return ""


def describe_collective_failure(exc: BaseException, timeout_minutes: float | None = None) -> str:
    """One clear message for a failed collective ('' when `exc` is not one): what happened, on which rank, and what
    to do. The deepspeed launcher and torchrun stop the other ranks once this one exits."""
    kind = collective_failure(exc)
    if not kind:
        return ""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
    if timeout_minutes is None:
        timeout_minutes = float(os.environ.get("DEEPSPEED_TIMEOUT", 10))
    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    if kind == "timeout":
        what = (f"rank {rank}: a collective operation timed out after {timeout_minutes * 60:g} s "
                f"(dist_timeout_minutes = {timeout_minutes:g}): another rank stalled (or is far slower) and never "
                "joined it")
    else:
        what = f"rank {rank}: lost the connection to another rank during a collective operation: that rank died"
    return (f"{what} ({type(exc).__name__}: {last}). Look at the other ranks' output for the first error. The job "
            "stops; --resume auto continues from the newest complete checkpoint.")
