"""A rollout worker: a process of its own that generates for a trainer (`python launch/rollout_worker.py
--rollout_address HOST:PORT`, docs/async-rollouts.md). The protocol is rlhf_engine/engine/generation/remote.py's.

It needs nothing but the address: the trainer sends the run's config, the actor's model config and dtype and the
generation backend, then the weights after every optimizer step, then batches. The worker runs the same backend
class the colocated path runs: `lean` on a plain copy of the policy (random weights until the first broadcast),
`vllm` with its engine (the only copy of the weights: the plain model is built on the meta device, for the names
and shapes of what arrives, and the broadcast streams into the engine block by block). It answers each batch with
the response tokens, their generation-time log-probs and the policy version that made them, and stops when the
trainer says so. Environments run here: a batch with data rows is played as episodes (envs/EpisodeRunner, built from
the run's config and the tokenizer the trainer sent), so a turn never waits on the trainer and, with max_staleness
>= 1, whole episodes are played while the trainer trains. Reward functions and reward servers stay on the trainer:
they score the finished rollouts beside the reference, critic and reward model forwards.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import logging
import os
import pickle
import random
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .. import comm
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
    """A plain causal LM of the trainer's config and dtype, random weights (the broadcast replaces every one); on the
    meta device it holds no memory (names, shapes and dtypes only)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(setup), dtype=_DTYPES[setup["dtype"]])
    return model.eval().requires_grad_(False)


def model_config(setup: dict) -> Any:
    from transformers import AutoConfig

    config = dict(setup["config"])
    return AutoConfig.for_model(config.pop("model_type"), **config)


def receive_stream(group: comm.PeerGroup, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's broadcast as (Hugging Face name, tensor), block by block in `weight_groups(model)` order: one
    flat buffer per block, received when the consumer reaches it (the same blocks the trainer sends)."""
    for _, params in weight_groups(model):
        flat = torch.empty(sum(p.numel() for _, p in params), dtype=params[0][1].dtype, device=group.device)
        group.broadcast_(flat)
        offset = 0
        for name, p in params:
            yield name, flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()


class Received:
    """A stream's pairs passed on as they come, counted, and (`hashed`) their sha256 kept
    (`policy_weights.weights_sha256`'s order and bytes): what a worker whose engine holds the only copy answers a
    checksum request with. Hashing reads every byte again (about 1 GB/s): only when the trainer asks for it."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]], hashed: bool = True):
        self.stream, self.count = stream, 0
        self.hash = hashlib.sha256() if hashed else None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in self.stream:
            if self.hash is not None:
                self.hash.update(value.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
            self.count += 1
            yield name, value


def take_broadcast(group: comm.PeerGroup, model: torch.nn.Module, generator: Any, version: int,
                   hashed: bool = True) -> Optional[str]:
    """Receive one broadcast into the backend (`take_weights`); the sha256 of what arrived (None: not `hashed`).
    The whole stream is read whatever the backend does (it is collective with the trainer): a backend that stops
    early or raises mid-stream is an error here, and the trainer's broadcast still completes."""
    stream = receive_stream(group, model)
    received = Received(stream, hashed)
    try:
        generator.take_weights(iter(received), version)
    finally:
        left = sum(1 for _ in stream)  # the rest of the broadcast, dropped
    expected = sum(len(g) for _, g in weight_groups(model))
    if left or received.count != expected:
        raise RuntimeError(f"the {generator.name} backend took {received.count} of the {expected} weights broadcast")
    return received.hash.hexdigest() if received.hash is not None else None


def backend_refusal(probe: dict, backend: str) -> str:
    """Why this worker cannot generate as the trainer asks ('' : it can): it was started with another
    `--generation_backend`, or the backend cannot run here for the trainer's model (`probe`: its 'backend' and
    'config')."""
    if backend and backend != probe["backend"]:  # the trainer planned its correction and checks for its own
        return (f"this worker was started with --generation_backend {backend} and the trainer generates with "
                f"{probe['backend']}: start the worker without the flag, or the trainer with --generation_backend "
                f"{backend}")
    cls = BACKENDS[probe["backend"]]
    reasons = cls.unavailable(model_config(probe))
    if reasons:
        return f"the {cls.name} generation backend cannot run here: " + "; ".join(reasons)
    if probe.get("environment"):  # the worker plays the episodes: the environment's module must import here
        from ..envs import load_environment_factory

        try:
            load_environment_factory(probe["environment"])
        except ValueError as e:
            return f"the environment cannot be loaded here (install its package on the worker): {e}"
    return ""


def find_trainer(host: str, port: int, timeout_s: float, poll_s: float = 0.2) -> Any:
    """The trainer's store, looked for every `poll_s` until `timeout_s` (a worker may start before its trainer). A
    plain socket asks first whether anything listens there: a refused connection answers at once, where the store's
    own client would retry with growing pauses (seconds late to notice the trainer) and log each failed try."""
    deadline = time.monotonic() + timeout_s
    last: Optional[BaseException] = None
    while True:
        if _listening(host, port):
            try:
                store = comm.open_store(host, port, False, datetime.timedelta(seconds=5))
                store.set_timeout(datetime.timedelta(seconds=timeout_s))
                return store
            except Exception as e:  # noqa: BLE001  (DistNetworkError, or a RuntimeError from older torch)
                last = e
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollout worker: no trainer at {host}:{port} within {timeout_s:.0f} s (start "
                               "the trainer with --rollout_workers N --rollout_address HOST:PORT)") from last
        time.sleep(poll_s)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


class Worker:
    """What one worker holds once set up: its backend, the plain (or meta) model, the policy version."""

    def __init__(self, setup: dict, backend: str, device: torch.device, workdir: str):
        self.setup = setup
        reason = backend_refusal(setup, backend)
        if reason:  # told to the trainer, before any engine or weight is built here (the probe asked it already)
            raise RuntimeError(reason)
        cls = BACKENDS[setup["backend"]]
        # an engine of its own holds the only copy of the weights: the plain model only names and shapes them
        self.model = build_policy(setup, torch.device("meta") if cls.has_engine else device)
        self.names = [n for _, g in weight_groups(self.model) for n, _ in g]
        self.policy = PlainPolicy(self.model)
        model_path = ""
        if cls.has_engine:  # the engine reads the model's config from a folder, and joins this process's group
            model_path = os.path.join(workdir, "model")
            model_config(setup).save_pretrained(model_path)
            # a world of one, as a launcher would describe it (vLLM's external launcher reads these; LOCAL_RANK
            # picks its device): set, not defaulted, since a worker started under a launcher or a scheduler inherits
            # values describing another world
            for key, value in (("RANK", 0), ("LOCAL_RANK", device.index or 0), ("WORLD_SIZE", 1),
                               ("LOCAL_WORLD_SIZE", 1), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 0)):
                os.environ[key] = str(value)
            if not comm.initialized():
                torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                                     world_size=1)
        cfg = copy.deepcopy(setup["cfg"])
        # the engine never sleeps here: a wake-up that discarded its weights would push them from the meta model;
        # a worker's device holds nothing else to make room for
        cfg.engine.vllm_sleep_level = 0
        ctx = GenerationContext(self.policy, comm.DistInfo(0, 1, 0, device), 0, cfg, model_path=model_path,
                                dtype=setup["dtype"], max_len=int(setup["max_len"]))
        self.generator = cls(ctx)
        self.received_sha256: Optional[str] = None
        self.versions_taken = 0
        self.cfg = cfg
        self.envs = EpisodeParts(cfg, setup["tokenizer"], workdir) if setup.get("tokenizer") is not None else None

    def take(self, group: comm.PeerGroup, version: int, hashed: bool) -> None:
        # an engine's only copy is hashed as it arrives, when the trainer will ask; a plain model is hashed on request
        self.received_sha256 = take_broadcast(group, self.model, self.generator, version,
                                              hashed and self.generator.has_engine)
        self.policy.global_steps = version
        self.versions_taken += 1

    def checksum(self) -> str:
        """sha256 of the weights decoded with: the plain model's own, or (an engine's only copy) what it received."""
        if not self.generator.has_engine:
            return weights_sha256(p for _, g in weight_groups(self.model) for p in g)
        if self.received_sha256 is None:
            raise RuntimeError("the last broadcast was not hashed on arrival (the trainer did not ask: "
                               "RemoteBackend.hash_broadcasts)")
        return self.received_sha256

    def generate(self, msg: dict) -> dict:
        if not self.versions_taken:
            raise RuntimeError("a batch came before any weights")
        if msg.get("seed") is not None:  # the trainer's draw: a rerun samples the same
            torch.manual_seed(msg["seed"])
        gen = self.generator.generate(msg["ids"], msg["mask"], msg["params"])
        return {"tokens": gen.rollout.responses.cpu(), "logprobs": gen.logprobs.cpu(),
                "version": self.policy.global_steps}

    def episodes(self, msg: dict) -> dict:
        """Play a batch's episodes (its data rows in `msg`) on the weights held now: the rollout, its log-probs,
        the batch's sums and the environment failure that ended it (a message; None: none)."""
        if not self.versions_taken:
            raise RuntimeError("a batch came before any weights")
        if self.envs is None:
            raise RuntimeError("episodes asked of a worker set up without an environment")
        # the sampling draws from the trainer's seed (sampled runs); the environments' own draws (python's random,
        # numpy, torch when decoding is greedy) from the episodes' seed: a rerun or a resume plays the same episodes
        random.seed(msg["env_seed"])
        np.random.seed(msg["env_seed"] % 2**32)
        torch.manual_seed(msg["seed"] if msg.get("seed") is not None else msg["env_seed"])
        runner = self.envs.runner(self.cfg, self.generator, msg["params"])
        rollout, logprobs, stats, failure = runner.run(msg["ids"], msg["mask"], msg["rows"])
        return {"rollout": rollout.to(torch.device("cpu")) if rollout is not None else None,
                "logprobs": logprobs.cpu() if logprobs is not None else None, "stats": stats,
                "failure": str(failure) if failure is not None else None, "version": self.policy.global_steps}


class EpisodeParts:
    """What a worker plays episodes with: the environment factory (`--environment`, imported here: its module must
    be importable on the worker), the tokenizer the trainer sent, and one pool of environment calls for the run
    (its abandoned calls count across batches, as on the trainer)."""

    def __init__(self, cfg: Any, tokenizer_files: dict, workdir: str):
        from transformers import AutoTokenizer

        from ..envs import load_environment_factory
        from ..envs.calls import EnvCalls

        folder = os.path.join(workdir, "tokenizer")
        os.makedirs(folder, exist_ok=True)
        for name, data in tokenizer_files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.factory = load_environment_factory(cfg.env.environment)
        env = cfg.env
        self.calls = EnvCalls(env.env_workers, env.env_timeout_s, env.env_max_abandoned_calls)

    def runner(self, cfg: Any, generator: Any, params: Any) -> Any:
        from ..envs import EpisodeRunner

        return EpisodeRunner.for_run(cfg, self.factory, self.tokenizer,
                                     lambda ids, mask, p: generator.generate(ids, mask, p), lambda: False, params,
                                     self.calls)


def serve(address: str, backend: str = "", timeout_s: float = 300.0, idle_timeout_s: float = 86400.0,
          device: str = "cpu") -> int:
    """Join the trainer at `address` and serve it until it says stop; returns the exit code. `backend` '' = the
    trainer's generation backend."""
    host, port = parse_address(address)
    store = find_trainer(host, port, timeout_s)
    index = int(store.add("joined", 1)) - 1
    size = int(store.get("size"))
    if index >= size:
        log.error("rollout worker: the trainer at %s asked for %d workers and %d have joined", address, size, index)
        return 2
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # a GPU by index: NCCL and set_device need one
        dev = torch.device("cuda", torch.cuda.current_device())
    mail = Mailbox(store, timeout_s, address)
    # the trainer's probe, answered before it builds its engines: a worker that cannot serve stops it at once
    probe = pickle.loads(store.get("probe"))  # read, not taken: every worker reads it
    reason = backend_refusal(probe, backend) or nccl_refusal(probe["group_backend"], dev, probe["trainer_gpu"])
    mail.put(answer_key(index, "probe"), {"error": reason} if reason else {})
    if reason:
        log.error("rollout worker %d: %s", index, reason)
        return 2
    # the trainer builds its engines meanwhile (minutes for a large model): waited for without the answer timeout
    try:
        store.wait(["connect"], datetime.timedelta(seconds=idle_timeout_s))
    except _STORE_ERRORS as e:  # the trainer stopped (or its store went) before it connected
        log.error("rollout worker %d: the trainer at %s stopped before connecting (%s: %s)", index, address,
                  type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
        return 1
    group = comm.PeerGroup(store, index + 1, size + 1, datetime.timedelta(seconds=timeout_s),
                           backend=probe["group_backend"], device=dev)
    log.info("rollout worker %d of %d: joined the trainer at %s", index, size, address)
    with tempfile.TemporaryDirectory(prefix="rollout_worker_") as workdir:
        try:
            return _loop(index, mail, group, backend, dev, workdir, idle_timeout_s)
        except (TimeoutError, _STORE_ERRORS) as e:  # the trainer's store is gone or silent: the run is over for us
            log.error("rollout worker %d: lost the trainer at %s (%s: %s)", index, address, type(e).__name__,
                      str(e).splitlines()[0][:300] if str(e) else "")
            return 1
        finally:
            comm.shutdown(ok=True)  # an engine shuts down first (comm.at_shutdown), then its group


# what the trainer's store raises when the trainer went away (a closed connection, a wait that failed)
_STORE_ERRORS = torch.distributed.DistError


def nccl_refusal(group_kind: str, device: torch.device, trainer_gpu: str) -> str:
    """Why this worker cannot join an NCCL weight group ('' : it can, or the group is gloo)."""
    if group_kind != "nccl":
        return ""
    if device.type != "cuda":
        return (f"the trainer's weight group is nccl and this worker runs on {device}: start it on a GPU (--device "
                "cuda), or the trainer with --rollout_group_backend gloo")
    if comm.gpu_identity(device) == trainer_gpu:
        return (f"this worker's {device} is the trainer's rank-0 GPU, and NCCL cannot join two processes on one GPU: "
                "give the worker a GPU of its own, or start the trainer with --rollout_group_backend gloo")
    return ""


def _loop(index: int, mail: Mailbox, group: comm.PeerGroup, backend: str, device: torch.device, workdir: str,
          idle_timeout_s: float) -> int:
    worker: Optional[Worker] = None
    box = inbox(index)
    idle = 0.0  # seconds spent waiting for the trainer since the last answered batch (reported with the next)
    while True:
        t0 = time.perf_counter()
        msg = mail.receive(box, f"the trainer (worker {index}'s inbox)", timeout_s=idle_timeout_s)
        if worker is not None:  # not the wait for the first setup
            idle += time.perf_counter() - t0
        kind = msg["kind"]
        if kind == "stop":
            log.info("rollout worker %d: the trainer is done", index)
            mail.put(answer_key(index, "stopped"), {})  # the trainer keeps its store up until this is read
            return 0
        if kind == "setup":
            try:
                worker = Worker(msg, backend, device, workdir)
                mail.put(answer_key(index, "setup"), {"names": worker.names, "backend": worker.generator.name})
            except Exception as e:  # noqa: BLE001  (told to the trainer, which stops naming this worker)
                mail.put(answer_key(index, "setup"), {"names": None, "error": f"{type(e).__name__}: {e}"})
                raise
        elif kind == "weights":
            version = int(msg["version"])
            try:
                worker.take(group, version, bool(msg.get("sha256")))
            except Exception as e:  # noqa: BLE001  (told to the trainer, which stops naming this worker and why)
                mail.put(answer_key(index, f"ack/{version}"), {"version": None, "error": f"{type(e).__name__}: {e}"})
                raise
            mail.put(answer_key(index, f"ack/{version}"), {"version": worker.policy.global_steps})
        elif kind == "checksum":
            try:
                answer = {"sha256": worker.checksum()}
            except RuntimeError as e:
                answer = {"error": str(e)}
            mail.put(answer_key(index, f"sum/{msg['n']}"), answer)
        elif kind in ("generate", "episodes"):
            key = answer_key(index, f"batch/{msg['ticket']}/{msg['rank']}")
            try:
                answer = worker.generate(msg) if kind == "generate" else worker.episodes(msg)
                mail.put(key, {**answer, "idle_s": idle})
            except Exception as e:  # noqa: BLE001
                mail.put(key, {"error": f"worker {index}: {type(e).__name__}: {e}"})
                raise
            idle = 0.0
        else:
            raise RuntimeError(f"rollout worker {index}: unknown message {kind!r}")
