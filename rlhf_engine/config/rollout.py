"""Rollout workers of their own: processes that generate for the trainer on their own devices (docs/async-rollouts.md)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problems
from .fields import check_choice, check_positive, is_number, opt

GROUP_BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class RolloutConfig:
    """Where the rollouts are generated: on the trainer's ranks (the default), or by `rollout_workers` processes
    started with `python launch/rollout_worker.py --rollout_address HOST:PORT`, which get everything else (model
    config, sampling, weights) from the trainer."""

    rollout_workers: int = opt(0, "Rollout worker processes that generate for this run (0 = the trainer's ranks "
                               "generate). Each is started with launch/rollout_worker.py --rollout_address HOST:PORT "
                               "and runs the generation_backend on a plain copy of the policy.")
    rollout_address: str = opt("", "HOST:PORT where the trainer's rank 0 waits for its rollout workers (a TCP store "
                               "of their own group: never the trainer's DeepSpeed group); give the workers the same.")
    max_staleness: int = opt(0, "Policy versions a trained batch may lag behind the trainer's weights. 0 = "
                             "synchronous: every batch is generated with the current weights (equals the "
                             "colocated run); K >= 1: the workers generate the next K iterations while the trainer "
                             "trains, and rollout_correction defaults to token_truncate.")
    rollout_timeout_s: float = opt(300.0, "Seconds the trainer waits for its workers (to join, to answer a batch, "
                                   "to take the weights) before it stops naming the worker.")
    rollout_group_backend: str = opt("auto", "The process group that carries the weights from the trainer to its "
                                     "workers: gloo (through CPU memory), nccl (GPU to GPU: the trainer and every "
                                     "worker on a GPU), auto (nccl when the trainer runs on a GPU and this torch has "
                                     "NCCL, else gloo). The workers take the trainer's choice.")

    @property
    def on(self) -> bool:
        return isinstance(self.rollout_workers, int) and self.rollout_workers > 0

    def validate(self, p: Problems, prefix: str = "") -> None:
        check_positive(p, prefix, self, "rollout_workers", "max_staleness", allow_zero=True)
        check_positive(p, prefix, self, "rollout_timeout_s")
        check_choice(p, prefix, self, "rollout_group_backend", GROUP_BACKENDS)
        if is_number(self.rollout_workers) and not isinstance(self.rollout_workers, int):
            p.add(prefix + "rollout_workers", self.rollout_workers, "must be a whole number")
        if self.on and not _host_port(self.rollout_address):
            p.add(prefix + "rollout_address", self.rollout_address, "give HOST:PORT (the trainer's rank 0 listens "
                  "there; start each worker with launch/rollout_worker.py --rollout_address HOST:PORT)")
        if is_number(self.max_staleness) and self.max_staleness > 0 and not self.on:
            p.add(prefix + "max_staleness", self.max_staleness, "needs rollout_workers > 0")


def _host_port(address: str) -> tuple | None:
    """('host', port) of 'HOST:PORT', or None."""
    host, _, port = str(address).rpartition(":")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


def parse_address(address: str) -> tuple:
    """('host', port) of a checked 'HOST:PORT' (ValueError naming the flag otherwise)."""
    hp = _host_port(address)
    if hp is None:
        raise ValueError(f"rollout_address {address!r}: give HOST:PORT")
    return hp


def group_backend(choice: str, device_type: str, nccl_available: bool) -> str:
    """The weight group's backend for a trainer on `device_type` ('cuda', 'cpu'): `choice` unless it is auto."""
    if choice != "auto":
        return choice
    return "nccl" if device_type == "cuda" and nccl_available else "gloo"
