"""What every generation backend is: `SamplingParams`, `Generated`, `GenerationContext` and the `GenerationBackend`
base class with its ZeRO-3 modes (the package docstring, `rlhf_engine/engine/generation/__init__.py`, has the
contract). The backends (`lean.py`, `hf.py`, `hybrid.py`) import from here, never from the package."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
import logging
from typing import Any, Iterator, Optional

import torch
from transformers import GenerationConfig

from ... import comm
from ...rollout import Rollout
from ..zero3 import GenerationReplica, full_param_bytes, gathered_for_generation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample, explicitly (nothing is read from the run's config at generation time)."""

    max_new_tokens: int
    min_new_tokens: int = 0  # stop tokens cannot end a response before this many tokens
    do_sample: bool = True  # False: greedy
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple = ()
    pad_token_id: int = 0
    # per row, the most tokens that row may take (<= max_new_tokens; () = max_new_tokens for every row): an episode's
    # turn stops at its own room, never at a batch-mate's. A row at its limit is done (not ended by a stop token) and
    # its positions no longer advance in the lean backend.
    row_limits: tuple = ()

    @classmethod
    def from_config(cls, g: Any, stop_token_ids, pad_token_id: int) -> "SamplingParams":
        """The rollout's sampling parameters from a `GenerationConfig` section."""
        return cls(max_new_tokens=g.max_answer_seq_len, min_new_tokens=g.min_answer_seq_len or 0,
                   do_sample=bool(g.do_sample), temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                   stop_token_ids=tuple(int(t) for t in stop_token_ids), pad_token_id=int(pad_token_id))

    def greedy(self) -> "SamplingParams":
        return dataclasses.replace(self, do_sample=False)

    def limits(self, batch: int, device: torch.device) -> Optional[torch.Tensor]:
        """[B] long per-row token limits, or None when every row may take max_new_tokens."""
        if not self.row_limits:
            return None
        if len(self.row_limits) != batch:
            raise ValueError(f"row_limits has {len(self.row_limits)} entries for a batch of {batch} rows")
        limits = torch.tensor(self.row_limits, dtype=torch.long, device=device)
        if bool((limits < 1).any()):
            raise ValueError(f"row_limits must be >= 1 (a row generates at least one token); got {self.row_limits}")
        return limits.clamp(max=self.max_new_tokens)


@dataclass
class Generated:
    rollout: Rollout
    logprobs: Optional[torch.Tensor] = None  # [B, R] generation-time log-probs, None: not available
    episode_stats: Optional[Any] = None  # multi-turn batches: their envs.EpisodeStats (env/* metrics)
    policy_version: Optional[int] = None  # rollout servers: the oldest weight version of its tokens
    # rollout servers: [B, R] long, the weight version that sampled each action token (0 on padding); then
    # policy_version is the oldest of them
    token_versions: Optional[torch.Tensor] = None
    # multi-turn batches played ahead of training: the environment failure that ended them (env_errors 'stop'),
    # and then `rollout` is None; the trainer stops every rank with it
    failure: Optional[str] = None


@dataclass(frozen=True)
class GenerationContext:
    """What a backend is built from: the actor's DeepSpeed engine, this process's place, the actor's ZeRO stage and
    the run's config (its `engine` section holds the backends' own settings); for a backend with an engine of its
    own (vllm), the actor's model folder, its dtype and the longest sequence of the run."""

    actor: Any
    dist: Any
    actor_stage: int
    cfg: Any
    model_path: str = ""
    dtype: str = "fp32"
    max_len: int = 0


class GenerationBackend:
    """Base class: `generate` must be implemented; the rest has defaults."""

    name = ""
    gives_logprobs = True  # `Generated.logprobs` is filled (a rollout correction needs them; the plan checks)
    # an inference engine of its own (vllm): it holds its own copy of the weights, loaded after every step, and joins
    # the process's default group
    has_engine = False

    def __init__(self, ctx: GenerationContext):
        self.ctx = ctx
        self.actor, self.dist = ctx.actor, ctx.dist
        self._actor_bytes: Optional[int] = None
        self._replica: Optional[GenerationReplica] = None
        self._replica_error: Optional[str] = None  # the replica could not be built: gathered in place instead
        self._logged_modes: set = set()
        warn_unused_sampling_fields(self.actor.module, self.dist.is_main)

    @classmethod
    def unavailable(cls, model_config: Any) -> list:
        """Why this backend cannot generate for a model of `model_config` here (empty: it can); asked before any
        engine or weight is built."""
        return []

    @classmethod
    def actor_ds_overrides(cls, cfg: Any) -> Optional[dict]:
        """A section merged into the actor's DeepSpeed config when the engine is built (None: nothing)."""
        return None

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generated:
        raise NotImplementedError

    def release(self) -> None:
        """Called after an iteration's rollouts: a backend with an engine of its own may free its memory for the
        training phase (vllm on a GPU: sleep mode)."""

    def take_async_stats(self) -> dict:
        """Rollout servers: time/trainer_wait, servers/* and async/* since the last call ({} otherwise)."""
        return {}

    def take_sync_seconds(self) -> Optional[float]:
        """Seconds spent loading the actor's weights into the backend's own engine since the last call (None: the
        backend decodes on the actor itself)."""
        return None

    # ---- ZeRO-3 -------------------------------------------------------------------------------------------
    def _log_once(self, key: str, msg: str, *args, level: int = logging.INFO) -> None:
        if key not in self._logged_modes and self.dist.is_main:
            log.log(level, msg, *args)
        self._logged_modes.add(key)

    def zero3_mode(self) -> str:
        """'plain' (actor not at ZeRO-3), 'replica', 'gathered' or 'per_layer': how the next call decodes.

        `generation_gather_once`: 'auto' = 'replica' where the actor fits `gather_once_max_bytes` and has no LoRA
        adapter (peft layers are not rebuilt in the copy), else 'per_layer'; 'on' = 'gathered'; 'replica'; 'off'.
        Above the bound every mode falls back to 'per_layer' (logged once)."""
        e = self.ctx.cfg.engine
        if self.ctx.actor_stage != 3:
            return "plain"
        mode = e.generation_gather_once
        if mode == "off":
            return "per_layer"
        if self._actor_bytes is None:
            self._actor_bytes = full_param_bytes(self.actor.module)
        if self._actor_bytes > e.gather_once_max_bytes:
            self._log_once("bytes", "generation_gather_once: the actor's full weights (%.2f GiB) exceed "
                           "gather_once_max_bytes (%.2f GiB); generating with per-layer ZeRO-3 fetches",
                           self._actor_bytes / 2**30, e.gather_once_max_bytes / 2**30, level=logging.WARNING)
            return "per_layer"
        if mode == "on":
            return "gathered"
        if hasattr(self.actor.module, "peft_config"):
            if mode == "replica":
                self._log_once("lora", "generation_gather_once replica: a LoRA actor is gathered in place instead "
                               "(the copy would not hold its adapter)")
                return "gathered"
            return "per_layer"
        return "gathered" if self._replica_error else "replica"

    def gather_once_active(self) -> bool:
        """Whether the next call holds the actor's full weights throughout (no collective while decoding)."""
        return self.zero3_mode() in ("gathered", "replica")

    def lockstep(self) -> bool:
        """ZeRO-3 ranks must run the same number of forwards (each gathers layers collectively), unless the whole
        actor is held for the call."""
        return self.zero3_mode() == "per_layer" and self.dist.world_size > 1

    def collective_calls(self) -> bool:
        """Every rank must make the same generate calls: under ZeRO-3 on several ranks each call is collective
        (the replica's refresh, the gather, or every layer's fetch in lockstep)."""
        return self.ctx.actor_stage == 3 and self.dist.world_size > 1

    @contextlib.contextmanager
    def generation_model(self) -> Iterator[torch.nn.Module]:
        """The module to decode with (in eval mode for the block): the actor's, or its refreshed replica. Collective
        under ZeRO-3 'replica' and 'gathered' (every rank must enter)."""
        model, mode = self.actor.module, self.zero3_mode()
        self._log_once("mode:" + mode, "generation: %s backend, ZeRO-3 mode %s", self.name, mode)
        if mode == "replica" and self._replica is None:
            mode = self._build_replica(model)
        if mode == "replica":
            try:
                yield self._replica.refresh(model)
            finally:
                self._replica.release()  # the weights exist only while generating
            return
        was_training = model.training
        model.eval()
        try:
            if mode == "gathered":
                with gathered_for_generation(model):
                    yield model
            else:
                yield model
        finally:
            model.train(was_training)

    def _build_replica(self, model: torch.nn.Module) -> str:
        """Build the replica (a local step), then decide on every rank together: when it failed anywhere (a model
        that cannot be copied fails everywhere, an out-of-memory error on one rank only), every rank gathers in place
        instead, so that all of them enter the same collectives. Returns the mode of this call. Collective."""
        error: Optional[BaseException] = None
        try:
            replica = GenerationReplica(model, self.device)
        except Exception as e:  # noqa: BLE001  (any failure: the ranks must agree before the next collective)
            error, replica = e, None
        if comm.agree(error is not None):
            del replica
            self._replica_error = (f"{type(error).__name__}: {error}" if error is not None
                                   else "another rank could not build its replica")
            log.warning("generation_gather_once: no replica on rank %d (%s); every rank gathers the actor in place",
                        self.dist.rank, self._replica_error)
            return "gathered"
        self._replica = replica
        return "replica"

    @contextlib.contextmanager
    def forward_mode(self) -> Iterator[None]:
        """The actor in eval mode for the experience forwards (restored after)."""
        was_training = self.actor.module.training
        if was_training:
            self.actor.eval()
        try:
            yield
        finally:
            if was_training:
                self.actor.train(True)


# generation_config fields that change which token is drawn (compared with transformers' defaults)
SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff",
                   "eta_cutoff",
                   "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
                   "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
                   "forced_eos_token_id", "min_length", "min_new_tokens", "exponential_decay_length_penalty",
                   "renormalize_logits", "penalty_alpha", "num_beams", "guidance_scale", "watermarking_config")


def warn_unused_sampling_fields(model, is_main: bool) -> None:
    """Name once what the model's generation_config asks for that no backend applies."""
    unused = unused_sampling_fields(model.generation_config)
    if unused and is_main:
        log.warning("the model's generation_config sets %s; not used: rollouts sample from softmax(logits / "
                    "temperature) with the run's own sampling flags (so that PPO's log-probs describe them)",
                    ", ".join(f"{k}={v!r}" for k, v in unused.items()))


def unused_sampling_fields(model_config) -> dict:
    """The sampling fields a model's generation_config sets to a non-default value (none of them is used)."""
    defaults = GenerationConfig()._get_default_generation_params()
    out = {}
    for name in SAMPLING_FIELDS:
        value = getattr(model_config, name, None)
        if value is not None and value != defaults.get(name):
            out[name] = value
    return out
