"""Rollouts from worker processes of their own (`--rollout_workers N`, docs/async-rollouts.md): the trainer side and
the protocol both sides speak. The worker's loop is rlhf_engine/workers/rollout_worker.py.

* Rendezvous, in two steps. While the trainer plans its run (before any engine is built: `join_workers`), its rank 0
  serves a TCP store at `--rollout_address HOST:PORT` and writes the probe (the generation backend, the actor's model
  config, the weight group's backend and the trainer's GPU) and the worker count; each worker joins, takes an index
  from a counter and answers whether it can serve (its own vLLM, its head sizes, its device for NCCL): a worker that
  cannot stops the trainer there, with its reason, before minutes of engine building. Once the engines are built
  (`RemoteBackend`) the trainer says `connect` and the N + 1 processes build a `comm.PeerGroup` on that store (rank 0
  = the trainer's rank 0, rank 1 + i = worker i): never the trainer's DeepSpeed group, never a worker's default
  group.
* Messages: pickled objects under `w<i>/in/<seq>` (to worker i, read in order) and one key per answer
  (`answer_key`: a batch's by its ticket), each taken once and deleted; every wait has `rollout_timeout_s` and names
  the worker it waited for.
* Setup: the worker gets the run's config, the actor's Hugging Face config, dtype, generation backend, the longest
  sequence and the weight names it must hold; it builds the backend (a plain copy of the policy, random weights, or
  an engine of its own) and answers with its own names, checked against ours, or with why it cannot.
* Weights: after every optimizer step, before the next generate call, the actor's weights are broadcast block by
  block (engine/policy_weights.stream_blocks: gathered under ZeRO-3, LoRA merged; each block flattened into one
  buffer), versioned by the actor's step count; each worker acknowledges the version it now holds.
* Generate: every trainer rank's call is collective (`collective_calls`): rank 0 gathers the ranks' prompts, sends
  rank r's batch to worker (call x world + r) mod N as it is (so a worker decodes exactly the batch that rank would),
  and hands each rank the tokens, their log-probs and the version that made them; the rollout is laid out from them
  exactly as the lean backend lays out its own.
* Episodes (an environment): a batch goes with its data rows and the worker plays its episodes there, every turn on
  the weights of one version (envs/EpisodeRunner, as the trainer's ranks would; the worker builds the environments
  from `--environment` and the tokenizer the trainer sent at setup); it answers with the episodes' rollout, their
  log-probs, their sums (env/* metrics) or the environment failure that ended them. Played next to the engine, a turn
  does not go through the trainer, and with max_staleness >= 1 whole episodes run ahead while the trainer trains.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import pickle
import random
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ... import comm
from ...rollout import Rollout
from ..policy_weights import stream_blocks, weight_groups
from .base import GenerationBackend, Generated, SamplingParams

log = logging.getLogger(__name__)

WORKER_COMMAND = "python launch/rollout_worker.py --rollout_address {address}"


class Mailbox:
    """Pickled messages over a TCP store. A worker's inbox is read in order (`send` / `receive`); every answer has
    a key of its own (`put` / `take`): a batch's by its ticket, so answers are taken in any order (an evaluation's
    batch while batches submitted earlier are still in flight)."""

    def __init__(self, store: Any, timeout_s: float, address: str):
        self.store, self.timeout_s, self.address = store, timeout_s, address
        self.sent: dict = {}
        self.read: dict = {}

    def put(self, key: str, obj: Any) -> None:
        self.store.set(key, pickle.dumps(obj))

    def take(self, key: str, who: str, timeout_s: Optional[float] = None) -> Any:
        """The message at `key` (deleted once taken); a TimeoutError naming `who` after the timeout."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.store.wait([key], datetime.timedelta(seconds=wait))
        except Exception as e:  # noqa: BLE001  (the store raises its own error types for a timeout or a lost peer)
            raise TimeoutError(f"{who} did not answer within {wait:.0f} s at {self.address} "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        obj = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return obj

    def send(self, box: str, obj: Any) -> None:
        seq = self.sent.get(box, 0)
        self.sent[box] = seq + 1
        self.put(f"{box}/{seq}", obj)

    def receive(self, box: str, who: str, timeout_s: Optional[float] = None) -> Any:
        seq = self.read.get(box, 0)
        obj = self.take(f"{box}/{seq}", who, timeout_s)
        self.read[box] = seq + 1
        return obj


def inbox(index: int) -> str:
    """The box worker `index` reads its messages from, in order."""
    return f"w{index}/in"


def answer_key(index: int, what: str) -> str:
    """Where worker `index` answers: 'setup', 'ack/<version>', 'sum/<n>', 'batch/<ticket>', 'stopped'."""
    return f"w{index}/{what}"


def plain_names(module: torch.nn.Module) -> list:
    """The weight names a worker's plain copy of the policy must hold, in stream order (LoRA merged away)."""
    out = []
    for _, group in weight_groups(module):
        for name, _ in group:
            if ".lora_" not in name:
                out.append(name.replace(".base_layer.", "."))
    return out


def flatten(values: list, device: torch.device) -> torch.Tensor:
    """One contiguous buffer on `device` (the weight group's) of a block's tensors (all of one dtype), in order."""
    return torch.cat([v.detach().reshape(-1).to(device) for v in values])


@dataclass
class WorkerLink:
    """The rollout workers as the plan joined them. On rank 0: the store it serves at the address, the mailbox on it
    and the weight group's backend the workers agreed to; the other ranks hold an empty link."""

    store: Any = None
    mail: Optional[Mailbox] = None
    group_backend: str = ""


def who(i: int, workers: int, address: str) -> str:
    return f"rollout worker {i} (of {workers}, at {address})"


def join_workers(cfg: Any, dist: Any, backend: str, model_config: Any) -> WorkerLink:
    """Serve the store at `--rollout_address`, wait for the `--rollout_workers` to join and ask each whether it can
    generate with `backend` for a model of `model_config` (a transformers config; read on rank 0 only) on its device.
    Collective on the trainer's ranks: every rank raises the same `ConfigError` at the first worker that cannot (its
    reason), or when some did not answer within `--rollout_timeout_s` (which, and the command that starts one). The
    link `RemoteBackend` connects over (rank 0's holds the store)."""
    from ...errors import ConfigError

    r = cfg.rollout
    timeout_s = float(r.rollout_timeout_s)
    # the other ranks wait for rank 0's answer on a group whose timeout outlasts rank 0's wait (the default group's
    # could end them first, with a message that names nobody)
    group = comm.new_cpu_group(datetime.timedelta(seconds=timeout_s + 60))
    problem, link = None, WorkerLink()
    if dist.is_main:
        try:
            link = _probe_workers(cfg, dist, backend, model_config)
        except ConfigError as e:
            problem = e.problems[0]
        except Exception as e:  # noqa: BLE001  (the store's own errors: a port in use, an unknown host)
            from ...errors import Problem

            problem = Problem("rollout_address", r.rollout_address, f"cannot serve the rollout workers' store there "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})")
    problem = comm.broadcast_object(problem, group=group)
    comm.destroy_group(group)
    if problem is not None:
        raise ConfigError([problem], "cannot start: rollout workers")
    return link


def _probe_workers(cfg: Any, dist: Any, backend: str, model_config: Any) -> WorkerLink:
    """Rank 0's side of `join_workers`: a ConfigError naming the first worker that refused, or those that never
    answered."""
    from ...config.rollout import group_backend, parse_address
    from ...errors import ConfigError, Problem

    r = cfg.rollout
    workers, address, timeout_s = int(r.rollout_workers), r.rollout_address, float(r.rollout_timeout_s)
    host, port = parse_address(address)
    kind = group_backend(r.rollout_group_backend, dist.device.type, torch.distributed.is_nccl_available())
    store = comm.open_store(host, port, True, datetime.timedelta(seconds=timeout_s))
    mail = Mailbox(store, timeout_s, address)
    mail.put("probe", {"backend": backend, "config": model_config.to_dict(), "group_backend": kind,
                       "trainer_gpu": comm.gpu_identity(dist.device),
                       "environment": cfg.env.environment if cfg.env.on else ""})
    store.set("size", str(workers))  # last: a worker that reads the size finds the probe written
    waiting = set(range(workers))
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:  # answers in any order: a refusal stops the wait at once
        for i in sorted(waiting):
            if store.check([answer_key(i, "probe")]):
                answer = mail.take(answer_key(i, "probe"), who(i, workers, address))
                waiting.discard(i)
                if answer.get("error"):
                    raise ConfigError([Problem("rollout_workers", workers,
                                               f"{who(i, workers, address)}: {answer['error']}")])
        if waiting:
            time.sleep(0.1)
    if waiting:
        raise ConfigError([Problem("rollout_workers", workers, f"{workers - len(waiting)} of {workers} joined and answered "
                                   f"at {address} within {timeout_s:.0f} s (--rollout_timeout_s); start each with "
                                   f"`{WORKER_COMMAND.format(address=address)}`")])
    return WorkerLink(store, mail, kind)


class RemoteBackend(GenerationBackend):
    """The trainer's side: `generate` hands each rank's batch to a worker and lays out what comes back."""

    name = "remote"

    def __init__(self, ctx, worker_backend: str, tokenizer: Any = None, link: Optional[WorkerLink] = None):
        """`link`: the workers as the plan joined them (`join_workers`); None: joined here (collective)."""
        super().__init__(ctx)
        self.tokenizer = tokenizer  # sent to the workers at setup when they play episodes (an environment)
        r = ctx.cfg.rollout
        self.workers, self.address, self.timeout_s = int(r.rollout_workers), r.rollout_address, float(r.rollout_timeout_s)
        self.worker_backend = worker_backend
        self.calls = self.checksums = 0  # batches submitted, checksum requests made
        # workers whose engine holds the only copy hash each broadcast as it arrives, for `worker_checksums`: off by
        # default (it reads every byte again); tests that compare checksums turn it on
        self.hash_broadcasts = False
        self._seen_steps: Optional[int] = None  # the actor's optimizer steps when the version was last read
        self._version = 0
        self._pushed_version: Optional[int] = None
        self.sync_seconds = self.trainer_wait = self.worker_idle = 0.0
        self.group = self.mail = None
        self._episode_rows: dict = {}  # ticket -> rows of an episodes batch (its answer may take all its turns)
        # the other ranks wait for rank 0's exchanges with the workers on a gloo group of their own, whose timeout
        # outlasts rank 0's (every answer of a call, one after another): the default group's collective timeout
        # would end the job with a generic message before rank 0 can name the worker
        longest = self._answer_wait(ctx.cfg.batch.generation_rollouts if ctx.cfg.env.on else 0)
        self.wait_group = comm.new_cpu_group(datetime.timedelta(seconds=longest * (2 + self.dist.world_size) + 60))
        comm.at_shutdown(self.close)
        if link is None:
            hf = getattr(self.actor.module, "get_base_model", lambda: self.actor.module)()
            link = join_workers(ctx.cfg, self.dist, worker_backend, hf.config)
        lost = self._rank0(lambda: self._connect(ctx, link)) if self.dist.is_main else None
        self._raise_if_lost(lost)  # every rank goes on once the workers are set up, or stops with rank 0's reason

    # ---- rank 0: the workers -------------------------------------------------------------------------------
    def _connect(self, ctx, link: WorkerLink) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store, backend = link.store, link.group_backend
        self.store, self.mail = store, link.mail
        t0 = time.perf_counter()
        store.set("connect", "1")  # the workers wait for it since the probe (the engines were being built)
        try:
            self.group = comm.PeerGroup(store, 0, self.workers + 1, timeout, backend=backend, device=self.device)
        except Exception as e:  # noqa: BLE001  (a worker that left since the probe)
            raise RuntimeError(f"rollout workers at {self.address}: the weight group did not form within "
                               f"{self.timeout_s:.0f} s ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
        names = plain_names(self.actor.module)
        hf = getattr(self.actor.module, "get_base_model", lambda: self.actor.module)()
        setup = {"kind": "setup", "config": hf.config.to_dict(), "dtype": ctx.dtype, "backend": self.worker_backend,
                 "names": names, "cfg": ctx.cfg, "max_len": ctx.max_len,
                 "tokenizer": tokenizer_files(self.tokenizer) if ctx.cfg.env.on else None}
        for i in range(self.workers):
            self.mail.send(inbox(i), setup)
        for i in range(self.workers):
            answer = self.mail.take(answer_key(i, "setup"), self._who(i))
            if answer.get("error"):
                raise RuntimeError(f"{self._who(i)} could not set up: {answer['error']}")
            if answer.get("backend") != self.worker_backend:
                raise RuntimeError(f"{self._who(i)} generates with {answer.get('backend')}, not with "
                                   f"{self.worker_backend}")
            if answer.get("names") != names:
                raise RuntimeError(f"{self._who(i)}: its copy of the policy holds other weights than the actor "
                                   "(names differ)")
        log.info("rollout workers: %d joined at %s in %.1f s (%s backend, weights over %s)", self.workers,
                 self.address, time.perf_counter() - t0, self.worker_backend, backend)

    def _who(self, i: int) -> str:
        return who(i, self.workers, self.address)

    def close(self, wait_s: float = 5.0) -> None:
        """Tell every worker the run is over, and wait up to `wait_s` in all for each to say it read that (rank 0;
        once): this process serves the store, and a worker still reading its last message when the store goes
        would end with a lost connection instead of exit code 0. A worker that is gone does not hold the end up."""
        if self.mail is not None:
            for i in range(self.workers):
                self.mail.send(inbox(i), {"kind": "stop"})
            deadline = time.monotonic() + wait_s
            for i in range(self.workers):
                try:
                    self.store.wait([answer_key(i, "stopped")],
                                    datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
                except Exception:  # noqa: BLE001  (a worker that died: nothing to wait for)
                    pass
            self.mail = None

    # ---- weights -------------------------------------------------------------------------------------------
    def zero3_mode(self) -> str:
        return "plain"  # the workers hold their own copy; only the weight stream gathers (collectively)

    def lockstep(self) -> bool:
        return False

    def collective_calls(self) -> bool:
        return self.dist.world_size > 1  # rank 0 gathers every rank's batch at each call

    @property
    def actor_version(self) -> int:
        """The policy version: how many times the actor's weights changed (its optimizer stepped) since the run
        started, counted once per change however many steps an iteration takes (what staleness counts)."""
        steps = int(self.actor.global_steps)
        if steps != self._seen_steps:
            self._seen_steps, self._version = steps, self._version + (self._seen_steps is not None)
        return self._version

    def sync_weights(self) -> bool:
        """Broadcast the actor's weights to every worker if they changed since the last broadcast (collective on
        the trainer's ranks: the stream gathers under ZeRO-3). Returns whether it broadcast."""
        version = self.actor_version
        if self._pushed_version == version:
            return False
        t0 = time.perf_counter()
        lost = None  # rank 0: what went wrong with a worker (the stream goes on: under ZeRO-3 it is collective)
        if self.mail is not None:
            for i in range(self.workers):
                self.mail.send(inbox(i), {"kind": "weights", "version": version, "sha256": self.hash_broadcasts})
        for _, values in stream_blocks(self.actor.module):
            if self.group is not None and lost is None:
                try:
                    self.group.broadcast_(flatten([v for _, v in values], self.group.device))
                except Exception as e:  # noqa: BLE001  (gloo: a closed connection or its timeout)
                    lost = (f"a rollout worker (of {self.workers}, at {self.address}) is gone: the weight broadcast "
                            f"failed ({str(e).splitlines()[0][:300]})")
        if self.mail is not None and lost is None:
            lost = self._rank0(lambda: [self._ack(i, version) for i in range(self.workers)])
        self._raise_if_lost(lost)
        self._pushed_version = version
        self.sync_seconds += time.perf_counter() - t0
        return True

    def _ack(self, i: int, version: int) -> None:
        ack = self.mail.take(answer_key(i, f"ack/{version}"), self._who(i))
        if ack.get("error"):
            raise RuntimeError(f"{self._who(i)} failed to take the weights of version {version}: {ack['error']}")
        if ack.get("version") != version:
            raise RuntimeError(f"{self._who(i)} holds version {ack.get('version')} after the broadcast of {version}")

    @staticmethod
    def _rank0(fn) -> Optional[str]:
        """Run rank 0's side of an exchange with the workers; what went wrong, as a message (None: nothing)."""
        try:
            fn()
        except (TimeoutError, RuntimeError) as e:
            return str(e)
        return None

    def _raise_if_lost(self, lost: Optional[str]) -> None:
        """Every trainer rank learns rank 0's outcome and they stop together (collective)."""
        from ...errors import RolloutWorkerLost

        lost = comm.broadcast_object(lost, group=self.wait_group)
        if lost is not None:
            raise RolloutWorkerLost(lost)

    def worker_checksums(self) -> list:
        """(rank 0) Each worker's sha256 of its weights' bytes in stream order (tests: bitwise equality)."""
        out = []
        self.checksums += 1
        for i in range(self.workers):
            self.mail.send(inbox(i), {"kind": "checksum", "n": self.checksums})
        for i in range(self.workers):
            answer = self.mail.take(answer_key(i, f"sum/{self.checksums}"), self._who(i))
            if answer.get("error"):
                raise RuntimeError(f"{self._who(i)}: no checksum: {answer['error']}")
            out.append(answer["sha256"])
        return out

    # ---- generation ----------------------------------------------------------------------------------------
    def submit(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
               rows: Optional[list] = None) -> int:
        """Hand every rank's batch to a worker with the weights it holds now, without waiting: a ticket for
        `result`. Collective on the trainer's ranks. A sampled batch carries a seed from this rank's stream (the
        worker seeds its draws with it: a rerun draws the same samples). With `rows` (the batch's data rows) the
        worker plays the batch's episodes (an environment)."""
        seed = int(torch.randint(0, 2**31 - 1, ())) if params.do_sample else None
        # episodes: a seed for the environments' own draws (python's `random`, numpy) from this rank's python
        # generator, which nothing else of training draws from and a checkpoint restores: a rerun or a resume plays
        # the same episodes
        env_seed = random.randrange(2**31 - 1) if rows is not None else None
        batches = comm.all_gather_object((prompt_ids.cpu(), prompt_mask.cpu(), params, seed, rows, env_seed))
        ticket = self.calls
        if rows is not None:
            self._episode_rows[ticket] = int(prompt_ids.shape[0])
        if self.mail is not None:
            for r, (ids, mask, p, sd, rw, es) in enumerate(batches):
                self.mail.send(inbox(self._worker(ticket, r, len(batches))),
                               {"kind": "generate" if rw is None else "episodes", "ticket": ticket, "rank": r,
                                "ids": ids, "mask": mask, "params": p, "seed": sd, "rows": rw, "env_seed": es})
        self.calls += 1
        return ticket

    def _answer_wait(self, episode_rows: int) -> float:
        """How long rank 0 waits for one answer: `rollout_timeout_s` for a generation; for a batch of episodes
        (`episode_rows` > 0) each of its turns' generation and environment calls (reset included), every call
        bounded by `env_timeout_s`, `env_workers` at a time."""
        if not episode_rows:
            return self.timeout_s
        env = self.ctx.cfg.env
        per_turn = self.timeout_s + math.ceil(episode_rows / max(int(env.env_workers), 1)) * float(env.env_timeout_s)
        return (int(env.max_turns) + 1) * per_turn

    def _worker(self, ticket: int, rank: int, world: int) -> int:
        return (ticket * world + rank) % self.workers

    def result(self, ticket: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               params: SamplingParams) -> Generated:
        """The rollout of a submitted batch (this rank's), waiting for it (`time/trainer_wait`). Collective."""
        answers = None
        t0 = time.perf_counter()
        wait = self._answer_wait(self._episode_rows.pop(ticket, 0))
        if self.mail is not None:
            world = self.dist.world_size
            try:
                answers = [self.mail.take(answer_key(self._worker(ticket, r, world), f"batch/{ticket}/{r}"),
                                          self._who(self._worker(ticket, r, world)), wait) for r in range(world)]
                self.worker_idle += sum(a.get("idle_s", 0.0) for a in answers)
            except TimeoutError as e:
                answers = [{"error": str(e)}] * world
            failed = next((a for a in answers if "error" in a), None)
            if failed is not None:  # one rank's batch failed: every rank stops, not only that one
                answers = [failed] * world
        answer = comm.broadcast_object(answers, group=self.wait_group)[self.dist.rank]
        self.trainer_wait += time.perf_counter() - t0
        if "error" in answer:
            from ...errors import RolloutWorkerLost

            raise RolloutWorkerLost(answer["error"])
        dev = self.device
        if "stats" in answer:  # episodes: laid out by the worker's EpisodeRunner
            rollout = answer["rollout"]
            return Generated(rollout.to(dev) if rollout is not None else None,
                             answer["logprobs"].to(dev) if rollout is not None else None, answer["stats"],
                             policy_version=int(answer["version"]), failure=answer["failure"])
        limits = params.limits(prompt_ids.shape[0], dev)
        rollout = Rollout.from_generation(prompt_ids.to(dev), prompt_mask.to(dev), answer["tokens"].to(dev),
                                          params.stop_token_ids, params.pad_token_id, includes_prompt=False,
                                          limits=limits)
        lp = answer["logprobs"].to(dev)[:, :rollout.response_width]
        return Generated(rollout, lp * rollout.action_mask, policy_version=int(answer["version"]))

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 rows: Optional[list] = None) -> Generated:
        """Synchronous: the current weights, then this batch (max_staleness 0); with `rows`, its episodes."""
        self.sync_weights()
        gen = self.result(self.submit(prompt_ids, prompt_mask, params, rows), prompt_ids, prompt_mask, params)
        if gen.policy_version != self.actor_version:
            raise RuntimeError(f"rollout worker answered with policy version {gen.policy_version}, the trainer is at "
                               f"{self.actor_version}")
        return gen

    def take_async_stats(self) -> dict:
        """Seconds the trainer waited for answers, the workers waited for work and the weight broadcasts took,
        since the last call."""
        out = {"time/trainer_wait": self.trainer_wait, "time/worker_idle": self.worker_idle,
               "time/weight_broadcast": self.sync_seconds}
        self.trainer_wait = self.worker_idle = self.sync_seconds = 0.0
        return out


def tokenizer_files(tokenizer: Any) -> dict:
    """The tokenizer's files as {name: bytes} (save_pretrained's): what a worker playing episodes loads it from."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tokenizer_") as d:
        tokenizer.save_pretrained(d)
        out = {}
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = f.read()
    return out
