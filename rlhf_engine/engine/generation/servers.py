"""Rollouts from rollout servers (`--rollout_servers URL[,URL...]`, docs/rollout-servers.md): stock vLLM servers
reached over HTTP, token in / token out, their weights pushed through vLLM's weight-transfer routes.

* At the end of the plan, before any engine is built (`probe_servers`, collective): rank 0 asks every server what
  it serves (`/collective_rpc rlhf_server_info`, our extension) and stops the run, naming the server, when one
  refuses the token, runs without our extension, serves another architecture or dtype, is shorter than the run's
  longest sequence, or does not give processed log-probs, or when none answers within `--rollout_timeout_s`. A
  server silent at start (still starting) is late: down until a push finds it answering.
* Every trainer rank sends its own rows straight to the servers, one request per row with its own seed (from the
  rank's checkpointed torch stream, as the colocated vllm backend draws them), spread by least outstanding requests
  (servers/pool.py); nothing passes through rank 0. The answers are laid out exactly as the colocated vllm backend
  lays out its own (`vllm_engine.lay_out`): sampled = scored holds as there (stop ids, minimum length, temperature,
  processed log-probs, the full distribution).
* Weights: at the first generate call after the actor stepped, every rank walks the weight stream (collective under
  ZeRO-3: gathered block by block, LoRA merged) and rank 0 pushes each block to every server up (servers/weights.py:
  pause, start, update block by block, finish with the version, resume); then every rank learns the outcome. A
  server that failed the push is marked down on every rank. Each answer's `weight_versions` must name the current
  version for every token (max_staleness 0), else the run stops.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ... import comm
from ...servers.client import ServerClient, ServerError
from ...servers.pool import NoServerUp, ServerPool
from ...servers.protocol import BACKEND_NAME, EXTENSION_VERSION, RECEIVER
from ...servers.weights import WeightPush, connect_senders, version_of
from ..policy_weights import stream_blocks
from .base import GenerationBackend, Generated, SamplingParams
from .vllm_engine import lay_out, request_fields, row_requests

log = logging.getLogger(__name__)

SERVER_COMMAND = "python launch/rollout_server.py MODEL_FOLDER --port PORT [--auth_token_env NAME]"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class BadAnswer(ValueError):
    """A server answered what this run cannot train on (no log-prob for a token, a weight version not this
    trainer's, a token past max_staleness 0)."""


@dataclass
class ServerLink:
    """The servers as the plan checked them: their URLs, the token, and (rank 0) what each said it serves."""

    urls: list
    token: str = field(default="", repr=False)
    infos: dict = field(default_factory=dict)  # url -> rlhf_server_info answer (rank 0)
    late: dict = field(default_factory=dict)  # url -> why it did not answer at start (taken in once it does)
    # what a server must serve (server_problems' arguments): a server that comes back is checked again
    arch: list = field(default_factory=list)
    dtype: str = "fp32"
    longest: int = 0


def server_token(cfg: Any) -> str:
    name = cfg.rollout.rollout_auth_token_env
    return os.environ.get(name, "") if name else ""


def server_problems(info: dict, url: str, arch: list, dtype: str, longest: int) -> list:
    """Why a server that answered `info` cannot serve this run (empty: it can)."""
    out = []
    if info.get("extension") != EXTENSION_VERSION:
        out.append(f"{url} runs version {info.get('extension')} of the rlhf_engine extension, this trainer speaks "
                   f"{EXTENSION_VERSION}: start it with this checkout's launch/rollout_server.py")
    if arch and not set(arch) & set(info.get("architectures") or []):
        out.append(f"{url} serves {info.get('architectures')}, the actor is {arch}: start it on the actor's folder")
    if info.get("dtype") != _DTYPES.get(dtype, dtype):
        out.append(f"{url} runs in {info.get('dtype')}, the actor in {dtype}: start it with --dtype "
                   f"{_DTYPES.get(dtype, dtype)}")
    if int(info.get("max_model_len") or 0) < longest:
        out.append(f"{url} takes sequences of {info.get('max_model_len')} tokens, the run's longest is {longest} "
                   f"(prompt + response): start it with --max_model_len {longest} or more")
    if info.get("logprobs_mode") != "processed_logprobs":
        out.append(f"{url} gives {info.get('logprobs_mode')} log-probs, not processed_logprobs (what PPO's "
                   "log-probs describe): start it with launch/rollout_server.py")
    if not info.get("weight_transfer"):
        out.append(f"{url} has no weight transfer configured (--weight-transfer-config): the trainer could not "
                   "push its weights")
    elif info["weight_transfer"] != RECEIVER:
        out.append(f"{url} receives weights with {info['weight_transfer']}, and this trainer sends them over "
                   f"{BACKEND_NAME} only (vLLM's nccl needs a trainer side not built yet): start it with "
                   f"launch/rollout_server.py, or --weight-transfer-config '{{\"backend\": \"{BACKEND_NAME}\"}}'")
    return out


def _ask(url: str, token: str, timeout_s: float) -> dict:
    """A server's info, waiting up to `timeout_s` for one that is still starting (connection refused)."""
    client = ServerClient(url, token, timeout_s=min(timeout_s, 60.0))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.info()
        except ServerError as e:
            if not e.retriable or e.status is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def probe_servers(cfg: Any, dist: Any, actor_dtype: str, model_config: Any, longest: int) -> ServerLink:
    """Check every `--rollout_servers` entry for this run (rank 0 asks them all at once, each given
    `--rollout_timeout_s` to answer; collective: every rank raises the same ConfigError naming the first server that
    cannot serve). A server that answers must serve this run; one that does not answer (refused, timed out: still
    starting) is late, taken in at a later push once it answers, as long as one server answered now.
    `model_config`: the actor's (read on rank 0)."""
    import concurrent.futures

    from ...config.rollout import server_urls
    from ...errors import ConfigError, Problem

    r = cfg.rollout
    urls, token = server_urls(r.rollout_servers), server_token(cfg)
    timeout_s = float(r.rollout_timeout_s)
    group = comm.new_cpu_group(datetime.timedelta(seconds=timeout_s + 120))
    problem, infos, late = None, {}, {}
    if dist.is_main:
        if r.rollout_auth_token_env and not token:
            problem = Problem("rollout_auth_token_env", r.rollout_auth_token_env, "the variable is empty or unset: "
                              "put the servers' bearer token there")
        arch = list(getattr(model_config, "architectures", None) or [])
        if problem is None:
            with concurrent.futures.ThreadPoolExecutor(len(urls)) as ask:
                answers = list(ask.map(lambda u: _answer(u, token, timeout_s), urls))
            for url, (info, error) in zip(urls, answers):
                if error is not None and error.retriable and error.status is None:
                    late[url] = str(error)  # nothing answered: a server still starting, or one not started yet
                    continue
                if error is not None:
                    hint = (" (set --rollout_auth_token_env to the variable holding the servers' token)"
                            if error.status == 401 else f"; start one with `{SERVER_COMMAND}`")
                    problem = Problem("rollout_servers", r.rollout_servers, f"{error}{hint}")
                    break
                wrong = server_problems(info, url, arch, actor_dtype, longest)
                if wrong:
                    problem = Problem("rollout_servers", r.rollout_servers, wrong[0])
                    break
                infos[url] = info
            if problem is None and not infos:
                problem = Problem("rollout_servers", r.rollout_servers, "no server answered within "
                                  f"--rollout_timeout_s {timeout_s:g}: " + "; ".join(late.values())
                                  + f"; start them with `{SERVER_COMMAND}`")
    problem = comm.broadcast_object(problem, group=group)
    comm.destroy_group(group)
    if problem is not None:
        raise ConfigError([problem], "cannot start: rollout servers")
    if late and dist.is_main:
        log.warning("rollout servers not up at start, taken in once they answer (asked again at every push): %s",
                    "; ".join(late.values()))
    return ServerLink(urls, token, infos, late=late, arch=list(getattr(model_config, "architectures", None) or []),
                      dtype=actor_dtype, longest=longest)


def _answer(url: str, token: str, timeout_s: float) -> tuple:
    """(info, None) of a server, or (None, the ServerError)."""
    try:
        return _ask(url, token, timeout_s), None
    except ServerError as e:
        return None, e


class ServersBackend(GenerationBackend):
    """The trainer's side: each rank's rows as requests to the servers, the actor's weights pushed to them."""

    name = "servers"

    def __init__(self, ctx, link: ServerLink):
        super().__init__(ctx)
        r = ctx.cfg.rollout
        self.timeout_s = float(r.rollout_timeout_s)
        self.link = link
        self.clients = [ServerClient(u, link.token, self.timeout_s) for u in link.urls]
        self.pool = ServerPool(self.clients, wait_s=self.timeout_s)
        self.hash_pushes = False  # tests: the servers hash what they receive and the push compares
        self._seen_steps: Optional[int] = None
        self._version = 0
        self._pushed_version: Optional[int] = None
        self.max_staleness = int(r.max_staleness)
        # K >= 2 with partial rollouts: a push pauses the requests in flight, which go on with the new weights;
        # otherwise it waits for them (K <= 1 has none in flight at a push: nothing to wait for)
        self.pause_mode = "keep" if r.partial_rollouts else "wait"
        self._ticket, self._tickets = 0, {}
        self.sync_seconds = self.trainer_wait = 0.0
        self.pushes = self.partial = self.dropped = 0
        self.senders: dict = {}
        self.wait_group = comm.new_cpu_group(datetime.timedelta(seconds=self.timeout_s * 4 + 60))
        failed = None
        if self.dist.is_main:
            self.senders, failed = connect_senders([c for c in self.clients if c.url in link.infos],
                                                   {u: i["workers"] for u, i in link.infos.items()}, self.timeout_s)
            failed = {**link.late, **failed}  # late servers start down: the pushes ask them again (_rejoin)
        self._mark_failed(failed)
        comm.at_shutdown(self.close)

    def close(self) -> None:
        self.pool.close()
        self.senders = {}

    # ---- ZeRO-3: the servers hold their own copy; only the weight stream is collective ------------------------
    def zero3_mode(self) -> str:
        return "plain"

    def lockstep(self) -> bool:
        return False

    def collective_calls(self) -> bool:
        return self.dist.world_size > 1  # every rank learns the outcome of rank 0's push before generating

    # ---- weights -------------------------------------------------------------------------------------------
    @property
    def actor_version(self) -> int:
        """How many times the actor's weights changed since the run started (one per iteration however many
        optimizer steps it takes), as the servers' weight versions count it."""
        steps = int(self.actor.global_steps)
        if steps != self._seen_steps:
            self._seen_steps, self._version = steps, self._version + (self._seen_steps is not None)
        return self._version

    def _index(self, url: str) -> int:
        return [c.url for c in self.clients].index(url)

    def _mark_failed(self, failed: Optional[dict], admitted: tuple = ()) -> None:
        """Rank 0's failed servers marked down, and its re-admitted ones up, on every rank (collective). With none up,
        requests wait for one (await_answers re-admits a server that answers again)."""
        failed, admitted = comm.broadcast_object((failed, list(admitted)), group=self.wait_group)
        news = []
        for url, why in (failed or {}).items():
            if self._index(url) not in self.pool.down_now():
                news.append(f"{url} down: {why}")
            self.pool.mark_down(self._index(url), why)
            self.senders.pop(url, None)
        for url in admitted:
            self.pool.mark_up(self._index(url))
        news += [f"{u} back, with the current weights" for u in admitted]
        if self.dist.is_main and news:
            log.warning("rollout servers: %s%s", "; ".join(news), "" if self.pool.up else (
                f"; none is up: requests wait up to --rollout_timeout_s {self.timeout_s:g} for one to answer again"))

    def _rejoin(self, down: set) -> dict:
        """Rank 0: {url: GlooSender} of the servers down (on any rank) that answer again and can serve this run, on
        a new weight group (a restarted server lost the old one; recover() closes what a push left open)."""
        from ...servers.weights import GlooSender

        out = {}
        for url in sorted(down):
            self.senders.pop(url, None)
            client = self.clients[self._index(url)]
            try:
                info = client.info(timeout_s=min(5.0, self.timeout_s))
                if server_problems(info, url, self.link.arch, self.link.dtype, self.link.longest):
                    continue
                out[url] = GlooSender(client, info["workers"], self.timeout_s)
            except (ServerError, RuntimeError, OSError):
                continue  # still down: asked again at the next push
        return out

    def sync_weights(self, rescue: bool = False) -> bool:
        """Push the actor's weights to every server up if they changed since the last push, and to every server
        that was down and answers again (collective on the trainer's ranks); a server that takes the whole push
        is (back) up on every rank, and one down on any rank that does not answer is down on every rank (no rank
        sends it requests it would answer with old weights). `rescue` (await_answers, no server up on a rank): only
        the servers coming back are pushed, with the actor's current weights. Returns whether it pushed."""
        version = self.actor_version
        down = set().union(*comm.all_gather_object(sorted(self.clients[i].url for i in self.pool.down_now()),
                                                   group=self.wait_group))
        newcomers = self._rejoin(down) if self.dist.is_main and down else {}
        # every rank walks the weight stream (collective under ZeRO-3): all ranks must agree to push, and to whom
        whole = self._pushed_version != version and not rescue
        to = comm.broadcast_object("all" if whole else "new" if newcomers else None, group=self.wait_group)
        silent = {u: "down on a trainer rank and silent at a push" for u in down if u not in newcomers}
        if to is None:
            if down:
                self._mark_failed(silent if self.dist.is_main else None)
            return False
        t0 = time.perf_counter()
        push = None
        if self.dist.is_main:
            self.senders.update(newcomers)
            push = WeightPush(self.senders if to == "all" else newcomers, sha256=self.hash_pushes,
                              pause_mode=self.pause_mode)
            push.start()
        try:
            for _, values in stream_blocks(self.actor.module):  # every rank: collective under ZeRO-3
                if push is not None:
                    push.block(values)
        except BaseException:
            if push is not None:
                push.abort()
            raise
        if push is not None:
            push.finish(version)
        self._mark_failed({**silent, **push.failed} if push is not None else None,
                          [u for u in newcomers if u not in push.failed] if push is not None else ())
        if to == "all":
            self._pushed_version = version
        self.pushes += 1
        self.sync_seconds += time.perf_counter() - t0
        return True

    def await_answers(self, futures: list, poll_s: float = 1.0) -> None:
        """Wait until every rank's `futures` are done (collective: each rank polls, and all learn each other's state
        every `poll_s`). While a rank has requests waiting with no server up, the ranks re-admit together any
        server that answers again, pushing it the current weights (sync_weights rescue); a request fails only
        when no server has been up for --rollout_timeout_s (the pool's wait)."""
        while True:
            concurrent.futures.wait(futures, timeout=poll_s)
            done = all(f.done() for f in futures)
            states = comm.all_gather_object((done, self.pool.waiting > 0), group=self.wait_group)
            if all(d for d, _ in states):
                return
            if any(w for _, w in states):
                self.sync_weights(rescue=True)

    def take_sync_seconds(self) -> float:
        out, self.sync_seconds = self.sync_seconds, 0.0
        return out

    def take_async_stats(self) -> dict:
        out = {"time/trainer_wait": self.trainer_wait, "servers/up": len(self.pool.up),
               "servers/moved_requests": self.pool.moved}
        if self.max_staleness:
            out.update({"async/partial_responses": self.partial, "async/dropped_responses": self.dropped})
        self.trainer_wait, self.partial, self.dropped = 0.0, 0, 0
        return out

    # ---- generation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generated:
        """Synchronous (max_staleness 0): the current weights, then this batch, every token of them."""
        self.sync_weights()
        return self.result(self.submit(prompt_ids, prompt_mask, params), prompt_ids, prompt_mask, params)

    def submit(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
               rows: Optional[list] = None) -> int:
        """Send this rank's rows (one request each, seeds drawn now) and return at once: a ticket for `result`."""
        if rows is not None:
            raise ValueError("episodes are played on the trainer's side: trainer/episodes_ahead.py submits them")
        bodies, limits = request_bodies(prompt_ids, prompt_mask, params)
        self._ticket += 1
        self._tickets[self._ticket] = (bodies, limits, [self.pool.submit(_ask_generate, b) for b in bodies])
        return self._ticket

    @torch.no_grad()
    def result(self, ticket: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               params: SamplingParams) -> Generated:
        """The ticket's batch laid out as the canonical rollout, each token stamped with the weight version that
        sampled it. A response with a token more than max_staleness versions behind the trainer is generated again
        (counted in `async/dropped_responses`); at max_staleness 0 every token must be of the current version.
        Collective: every rank learns whether any rank's requests failed, and then every rank stops."""
        bodies, limits, futures = self._tickets.pop(ticket)
        t0 = time.perf_counter()
        rows, wrong = [], None
        self.await_answers(futures)
        try:
            rows = [answer_row(f.result()) for f in futures]
            rows = self._fresh(rows, bodies)
        except (NoServerUp, ServerError, BadAnswer) as e:
            wrong = str(e)
        self.trainer_wait += time.perf_counter() - t0
        wrong = next((w for w in comm.all_gather_object(wrong, group=self.wait_group) if w), None)  # all stop, or none
        if wrong is not None:
            from ...errors import RolloutServersLost

            raise RolloutServersLost(wrong)
        self.partial += sum(len(set(v)) > 1 for _, _, v in rows)
        gen = _laid_out(prompt_ids, prompt_mask, rows, params, limits, self.device)
        mask = gen.rollout.action_mask.bool()
        oldest = int(gen.token_versions[mask].min()) if bool(mask.any()) else self.actor_version
        return dataclasses.replace(gen, policy_version=oldest)

    # what `request` raises when no server is up or one answered what the run cannot train on
    lost_errors = (NoServerUp, ServerError, BadAnswer)

    def request(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> Generated:
        """This rank's rows answered by the servers as their weights stand: no push, nothing collective, the seeds
        from `generator` (episodes played ahead of training call it from a thread of their own,
        trainer/episodes_ahead.py). Laid out on the CPU (the thread never waits on the trainer's device), without a
        policy_version. `lost_errors` (no server up, a bad answer) are raised to the caller."""
        bodies, limits = request_bodies(prompt_ids, prompt_mask, params, generator)
        rows = [answer_row(choice) for choice in self.pool.map(_ask_generate, bodies)]
        return _laid_out(prompt_ids, prompt_mask, rows, params, limits, torch.device("cpu"))

    def _fresh(self, rows: list, bodies: list) -> list:
        """`rows` with every response that holds a token past max_staleness generated again (by the servers' current
        weights, one push behind the trainer at most: within any K >= 1)."""
        current = self.actor_version
        stale = [i for i, (_, _, v) in enumerate(rows) if v and current - min(v) > self.max_staleness]
        if stale and self.max_staleness == 0:
            raise BadAnswer(f"a rollout server answered with tokens of weight versions "
                             f"{sorted(set(rows[stale[0]][2]))}; the trainer is at {current} (max_staleness 0)")
        if stale:
            again = self.pool.map(_ask_generate, [bodies[i] for i in stale])
            rows = list(rows)
            for i, choice in zip(stale, again):
                rows[i] = answer_row(choice)
            self.dropped += len(stale)
        return rows


def request_bodies(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                   generator: Optional[torch.Generator] = None) -> tuple:
    """(one (prompt token ids, sampling fields) body per row, the rows' response limits): each row's seed drawn as
    the colocated vllm backend draws it (`row_requests`), from `generator` or this thread's torch stream."""
    prompts, limits_list, seeds, limits = row_requests(prompt_ids, prompt_mask, params, generator)
    return [(p, request_fields(params, limit, seed)) for p, limit, seed in zip(prompts, limits_list, seeds)], limits


def _ask_generate(client: ServerClient, body: tuple) -> dict:
    return client.generate(*body)


def _laid_out(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list, params: SamplingParams, limits,
              device: torch.device) -> Generated:
    """answer_row's rows as the canonical rollout on `device`, each action token stamped with its weight version
    (`token_versions`, 0 on padding)."""
    gen = lay_out(prompt_ids, prompt_mask, [(t, lp) for t, lp, _ in rows], params, limits, device)
    versions = torch.zeros(gen.rollout.action_mask.shape, dtype=torch.long)
    for i, (_, _, v) in enumerate(rows):
        n = min(len(v), versions.shape[1])
        versions[i, :n] = torch.tensor(v[:n], dtype=torch.long)
    versions = versions * gen.rollout.action_mask.cpu().long()
    return dataclasses.replace(gen, token_versions=versions.to(device))


def answer_row(choice: dict) -> tuple:
    """(token ids, their log-probs, the weight version that sampled each) of one server answer; BadAnswer when a
    token has no log-prob or no version of this trainer (a server the trainer has not pushed to says 'default')."""
    tokens = list(choice["token_ids"])
    logprobs = [float(c["logprob"]) for c in (choice.get("logprobs") or {}).get("content") or []]
    if len(tokens) != len(logprobs):
        raise BadAnswer("a rollout server answered without a log-prob for every token (is it started with "
                         "launch/rollout_server.py?)")
    versions = [None] * len(tokens)
    for span in choice.get("weight_versions") or []:
        v = version_of(span.get("version"))
        for t in range(max(0, int(span.get("start", 0))), min(len(tokens), int(span.get("end", 0)))):
            versions[t] = v
    if None in versions:
        labels = sorted(str(s.get("version")) for s in choice.get("weight_versions") or [])
        raise BadAnswer(f"a rollout server answered with tokens of no version of this trainer (weight versions "
                         f"{labels} over {len(tokens)} tokens): were its weights pushed by another trainer?")
    return tokens, logprobs, versions
