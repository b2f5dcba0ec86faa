"""Rollout generation behind one small interface; the backends are chosen by `--generation_backend`.

    backend = BACKENDS[name](GenerationContext(actor, dist, actor_stage, cfg))
    out = backend.generate(prompt_ids [B, P], prompt_mask [B, P], params: SamplingParams) -> Generated
    out.rollout    the canonical layout (rollout.py), cut at the first stop token
    out.logprobs   [B, R] fp32 generation-time log-prob of each sampled token (0 on padding), or None when the
                   backend cannot give it

Every backend keeps ZeRO-3 ranks in lockstep where they must be (a rank that finished keeps running dummy forwards
while another still generates, or no collective runs inside at all), derives position ids from the attention mask
(Hugging Face generate does it for left-padded prompts), and works with a LoRA actor and with the reference taken
from the actor's disabled adapter (generation always runs the adapted actor). `forward_mode` is how the actor's
experience forwards must be put in eval mode next to this backend (the Hybrid Engine swaps kernels in `eval()`).

A new backend is one new file holding a `GenerationBackend` subclass plus one line in `BACKENDS` below.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ...rollout import Rollout


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

    @classmethod
    def from_config(cls, g: Any, stop_token_ids, pad_token_id: int) -> "SamplingParams":
        """The rollout's sampling parameters from a `GenerationConfig` section."""
        return cls(max_new_tokens=g.max_answer_seq_len, min_new_tokens=g.min_answer_seq_len or 0,
                   do_sample=bool(g.do_sample), temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                   stop_token_ids=tuple(int(t) for t in stop_token_ids), pad_token_id=int(pad_token_id))

    def greedy(self) -> "SamplingParams":
        return dataclasses.replace(self, do_sample=False)


@dataclass
class Generated:
    rollout: Rollout
    logprobs: Optional[torch.Tensor] = None  # [B, R] generation-time log-probs, None: not available


@dataclass(frozen=True)
class GenerationContext:
    """What a backend is built from: the actor's DeepSpeed engine, this process's place, the actor's ZeRO stage and
    the run's config (its `engine` section holds the backends' own settings)."""

    actor: Any
    dist: Any
    actor_stage: int
    cfg: Any


class GenerationBackend:
    """Base class: `generate` must be implemented; the rest has defaults."""

    name = ""

    def __init__(self, ctx: GenerationContext):
        self.ctx = ctx
        self.actor, self.dist = ctx.actor, ctx.dist

    @classmethod
    def actor_ds_overrides(cls, cfg: Any) -> Optional[dict]:
        """A section merged into the actor's DeepSpeed config when the engine is built (None: nothing)."""
        return None

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generated:
        raise NotImplementedError

    @contextlib.contextmanager
    def forward_mode(self) -> Iterator[None]:
        """The actor in eval mode for the experience forwards (restored after)."""
        was_training = self.actor.training
        self.actor.eval()
        try:
            yield
        finally:
            self.actor.train(was_training)


def _registry() -> dict:
    from .hf import HFBackend
    from .hybrid import HybridEngineBackend

    return {"hf": HFBackend, "hybrid": HybridEngineBackend}


BACKENDS: dict[str, type] = _registry()
