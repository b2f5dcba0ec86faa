"""A rollout worker: a process of its own that generates for a trainer (`python launch/rollout_worker.py
--rollout_address HOST:PORT`, docs/async-rollouts.md). The protocol is rlhf_engine/engine/generation/remote.py's.

It needs nothing but the address: the trainer sends the actor's config, dtype and generation backend (the worker
builds a plain copy of the policy with random weights and the same backend class the colocated path uses), then the
weights after every optimizer step, then batches. It answers each batch with the response tokens, their
generation-time log-probs and the policy version that made them, and stops when the trainer says so. Reward
functions, reward servers and environments stay on the trainer: they need the rows' data and the trainer's ranks.
"""
from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from .. import comm
from ..config import TrainConfig
from ..config.rollout import parse_address
from ..engine.generation import BACKENDS, GenerationContext
from ..engine.generation.remote import Mailbox, answer_key, inbox
from ..engine.policy_weights import weight_groups, weights_sha256

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PlainPolicy:
    """What a generation backend takes as its actor, for a plain model (no DeepSpeed engine on a worker)."""

    module: torch.nn.Module
    global_steps: int = 0


def build_policy(setup: dict, device: torch.device) -> torch.nn.Module:
    """A plain causal LM of the trainer's config and dtype, random weights (the broadcast replaces every one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(setup["config"])
    config_obj = AutoConfig.for_model(config.pop("model_type"), **config)
    model = AutoModelForCausalLM.from_config(config_obj, dtype=_DTYPES[setup["dtype"]])
    return model.to(device).eval().requires_grad_(False)


def receive_weights(group: comm.PeerGroup, model: torch.nn.Module) -> None:
    """The trainer's broadcast, block by block, into the model's parameters (the same blocks in the same order)."""
    for _, params in weight_groups(model):
        flat = torch.empty(sum(p.numel() for _, p in params), dtype=params[0][1].dtype)
        group.broadcast_(flat)
        offset = 0
        for _, p in params:
            p.data.copy_(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()


def find_trainer(host: str, port: int, timeout_s: float) -> Any:
    """The trainer's store, looked for every few seconds until `timeout_s` (a worker may start before its trainer;
    one long connection attempt would back off for minutes after the trainer came up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store = comm.open_store(host, port, False, datetime.timedelta(seconds=5))
            store.set_timeout(datetime.timedelta(seconds=timeout_s))
            return store
        except Exception as e:  # noqa: BLE001  (DistNetworkError, or a RuntimeError from older torch)
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout worker: no trainer at {host}:{port} within {timeout_s:.0f} s (start "
                                   "the trainer with --rollout_workers N --rollout_address HOST:PORT)") from e
            time.sleep(1.0)


def serve(address: str, backend: str = "", timeout_s: float = 300.0, idle_timeout_s: float = 86400.0,
          device: str = "cpu") -> int:
    """Join the trainer at `address` and serve it until it says stop; returns the exit code. `backend` '' = the
    trainer's generation backend."""
    host, port = parse_address(address)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = find_trainer(host, port, timeout_s)
    index = int(store.add("joined", 1)) - 1
    size = int(store.get("size"))
    if index >= size:
        log.error("rollout worker: the trainer at %s asked for %d workers and %d have joined", address, size, index)
        return 2
    group = comm.PeerGroup(store, index + 1, size + 1, timeout)
    mail = Mailbox(store, timeout_s, address)
    box = inbox(index)
    dev = torch.device(device)
    model = generator = policy = None
    log.info("rollout worker %d of %d: joined the trainer at %s", index, size, address)
    idle = 0.0  # seconds spent waiting for the trainer since the last answered batch (reported with the next)
    while True:
        t0 = time.perf_counter()
        msg = mail.receive(box, f"the trainer (worker {index}'s inbox)", timeout_s=idle_timeout_s)
        if generator is not None:  # not the wait for the first setup
            idle += time.perf_counter() - t0
        kind = msg["kind"]
        if kind == "stop":
            log.info("rollout worker %d: the trainer is done", index)
            return 0
        if kind == "setup":
            try:
                model = build_policy(msg, dev)
                names = [n for _, g in weight_groups(model) for n, _ in g]
                policy = PlainPolicy(model)
                ctx = GenerationContext(policy, comm.DistInfo(0, 1, 0, dev), 0, TrainConfig())
                generator = BACKENDS[backend or msg["backend"]](ctx)
                mail.put(answer_key(index, "setup"), {"names": names})
            except Exception as e:  # noqa: BLE001  (told to the trainer, which stops naming this worker)
                mail.put(answer_key(index, "setup"), {"names": None, "error": f"{type(e).__name__}: {e}"})
                raise
        elif kind == "weights":
            receive_weights(group, model)
            policy.global_steps = int(msg["version"])
            mail.put(answer_key(index, f"ack/{policy.global_steps}"), {"version": policy.global_steps})
        elif kind == "checksum":
            mail.put(answer_key(index, f"sum/{msg['n']}"),
                     {"sha256": weights_sha256(p for _, g in weight_groups(model) for p in g)})
        elif kind == "generate":
            try:
                if msg.get("seed") is not None:  # the trainer's draw: a rerun samples the same
                    torch.manual_seed(msg["seed"])
                gen = generator.generate(msg["ids"], msg["mask"], msg["params"])
                mail.put(answer_key(index, f"batch/{msg['ticket']}/{msg['rank']}"),
                         {"tokens": gen.rollout.responses.cpu(), "logprobs": gen.logprobs.cpu(),
                          "version": policy.global_steps, "idle_s": idle})
            except Exception as e:  # noqa: BLE001
                mail.put(answer_key(index, f"batch/{msg['ticket']}/{msg['rank']}"),
                         {"error": f"worker {index}: {type(e).__name__}: {e}"})
                raise
        else:
            raise RuntimeError(f"rollout worker {index}: unknown message {kind!r}")
        if kind == "generate":
            idle = 0.0
