"""The Hugging Face backend: `model.generate` on the actor's module, the reference every other backend is held to.

Exact sampling: the `transformers.GenerationConfig` is built from our `SamplingParams` alone, never from a copy of the
model's `generation_config` (a checkpoint's repetition penalty, n-gram ban, bad words, min-p, ... would silently
change the sampled distribution; the ones a model sets are named once in a warning). transformers 5 fills every
field a passed config leaves unset from `model.generation_config`, so for the call the model holds a neutral one.
Tokens are drawn from softmax(logits / temperature), with the stop tokens masked before `min_new_tokens`: exactly
what the trainer's log-probs compute. The generation-time log-prob of every sampled token is recorded by a logits
processor (Hugging Face applies temperature after custom processors, so the recorder divides by it itself).

ZeRO-3: `GenerationBackend.zero3_mode` (a replica, the actor gathered once, or per-layer fetching with the ranks in
lockstep through `synced_gpus`: a rank that finished keeps running dummy forwards while another still generates).
"""
from __future__ import annotations

import contextlib
import logging

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from ...rollout import Rollout
from .base import GenerationBackend, Generated, SamplingParams

log = logging.getLogger(__name__)


@contextlib.contextmanager
def neutral_generation_config(model):
    """`model.generation_config` (of the Hugging Face model inside a peft or DeepSpeed wrapper) replaced by a default
    one for the duration: transformers 5 would otherwise fill our config's unset fields from the model's."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = hf.generation_config
    hf.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf.generation_config = saved


class SampledLogprobs:
    """A logits processor recording log p(sampled token) under softmax(scores / temperature): at each step the
    token appended since the previous call is looked up in the previous step's scores, minus their logsumexp;
    `finish` adds the last. Per step one [B] logsumexp and a reference to the step's scores (Hugging Face makes new
    tensors in the processors and the temperature warper after this one, so the kept scores stay as they were)."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev = self.prev_lse = None
        self.out: list = []

    def _logprob(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.prev.gather(1, tokens).squeeze(1).float() / self.temperature - self.prev_lse

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.out.append(self._logprob(input_ids[:, -1:]))
        self.prev = scores
        s = scores.float()
        self.prev_lse = torch.logsumexp(s / self.temperature if self.temperature != 1.0 else s, dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, G] log-probs of the G generated tokens (padding after a stop token included; the rollout masks it)."""
        self.out.append(self._logprob(sequences[:, -1:]))
        return torch.stack(self.out, dim=1)


class RowLimits(StoppingCriteria):
    """Ends each row after its own number of new tokens (`SamplingParams.row_limits`); Hugging Face pads it after.
    Its positions keep advancing while other rows generate, so the run's position check counts a whole turn past
    the episode budget for this backend (config: `TrainConfig.generation_positions`)."""

    def __init__(self, prompt_width: int, limits: torch.Tensor):
        self.prompt_width, self.limits = prompt_width, limits

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.limits


class HFBackend(GenerationBackend):
    name = "hf"

    def __init__(self, ctx):
        super().__init__(ctx)
        self._logged_kwargs = False

    def generation_kwargs(self, params: SamplingParams) -> dict:
        """The `generate` arguments of `params` (they override the model's generation_config)."""
        kw = dict(max_new_tokens=params.max_new_tokens, do_sample=params.do_sample,
                  eos_token_id=list(params.stop_token_ids), pad_token_id=params.pad_token_id, use_cache=True,
                  synced_gpus=self.lockstep())
        if params.min_new_tokens:
            kw["min_new_tokens"] = params.min_new_tokens
        if params.do_sample:
            # top_k=0 (not None) turns top-k off: None would fall back to transformers' default k=50, sampling from
            # a truncated distribution while the PPO log-probs assume the full softmax
            kw.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        return kw

    def generation_config(self, params: SamplingParams):
        """(a GenerationConfig of `params` alone, synced_gpus)."""
        kw = self.generation_kwargs(params)
        if not self._logged_kwargs:
            self._logged_kwargs = True
            if self.dist.is_main:
                log.info("generation arguments: %s", kw)
        synced = kw.pop("synced_gpus")
        return GenerationConfig(**kw), synced

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generated:
        gen_config, synced = self.generation_config(params)
        ids, mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        recorder = SampledLogprobs(params.temperature if params.do_sample else 1.0)
        limits = params.limits(ids.shape[0], self.device)
        stopping = StoppingCriteriaList([RowLimits(ids.shape[1], limits)] if limits is not None else [])
        # with the whole actor held for the call no collective runs inside, so ranks may finish at different times:
        # synced_gpus (one all-reduce per token, dummy forwards) is on only for per-layer ZeRO-3 fetching
        with self.generation_model() as model, neutral_generation_config(model):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                 logits_processor=[recorder], stopping_criteria=stopping, synced_gpus=synced)
        return generated(ids, mask, out, params, recorder, limits)


def generated(ids: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, params: SamplingParams,
              recorder: SampledLogprobs, limits=None) -> Generated:
    """The rollout of a generate call and its generation-time log-probs, aligned with its action mask."""
    rollout = Rollout.from_generation(ids, mask, out, params.stop_token_ids, params.pad_token_id, limits=limits)
    lp = recorder.finish(out)[:, :rollout.response_width]
    return Generated(rollout, lp * rollout.action_mask)
