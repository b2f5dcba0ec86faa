"""The Hugging Face backend: `model.generate` on the actor's module, the reference every other backend is held to.

ZeRO-3: by default each layer is fetched for every new token and the ranks run in lockstep (`synced_gpus`: a rank
that finished keeps running dummy forwards while another still generates). With `generation_gather_once` ('on', or
'auto' with CUDA) the whole actor is gathered once for the call and kept resident (engine/zero3.py): no collective
runs inside, so ranks may finish at different times; never above `gather_once_max_bytes` (logged once).
"""
from __future__ import annotations

import copy
import logging

import torch

from ...rollout import Rollout
from ..zero3 import full_param_bytes, gathered_for_generation
from . import GenerationBackend, Generated, SamplingParams

log = logging.getLogger("rlhf_engine.engine.rlhf_engine")


class HFBackend(GenerationBackend):
    name = "hf"

    def __init__(self, ctx):
        super().__init__(ctx)
        self._actor_bytes = None
        self._gather_once_logged = False
        self._logged_kwargs = False

    def gather_once_active(self) -> bool:
        """Whether the next `generate` gathers the ZeRO-3 actor once (`generation_gather_once`: 'on', or 'auto' with
        CUDA) instead of fetching each layer for every token; never above `gather_once_max_bytes` (logged once)."""
        e = self.ctx.cfg.engine
        if self.ctx.actor_stage != 3 or e.generation_gather_once == "off":
            return False
        if e.generation_gather_once == "auto" and not torch.cuda.is_available():
            return False  # on CPU gathering once was measured not faster (docs/notes: 1.36 s vs 1.43 s)
        if self._actor_bytes is None:
            self._actor_bytes = full_param_bytes(self.actor.module)
        if self._actor_bytes > e.gather_once_max_bytes:
            if not self._gather_once_logged and self.dist.is_main:
                log.warning("generation_gather_once: the actor's full weights (%.2f GiB) exceed gather_once_max_bytes "
                            "(%.2f GiB); generating with per-layer ZeRO-3 fetches", self._actor_bytes / 2**30,
                            e.gather_once_max_bytes / 2**30)
            self._gather_once_logged = True
            return False
        return True

    def lockstep(self) -> bool:
        """ZeRO-3 ranks must run the same number of forwards (each gathers layers collectively), unless the whole
        actor is gathered once for the call."""
        return self.ctx.actor_stage == 3 and self.dist.world_size > 1 and not self.gather_once_active()

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
        """(the model's generation_config updated with `params`, synced_gpus)."""
        kw = self.generation_kwargs(params)
        if not self._logged_kwargs:
            self._logged_kwargs = True
            if self.dist.is_main:
                log.info("generation arguments: %s", kw)
        synced = kw.pop("synced_gpus")
        gen_config = copy.deepcopy(self.actor.module.generation_config)
        gen_config.update(**kw)
        return gen_config, synced

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generated:
        model = self.actor.module
        was_training = model.training
        model.eval()
        gen_config, synced = self.generation_config(params)
        ids, mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        try:
            if self.gather_once_active():
                # every rank holds the full actor for the whole call and no collective runs inside, so ranks may
                # finish at different times: synced_gpus (one all-reduce per token, dummy forwards) is off
                with gathered_for_generation(model):
                    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                         synced_gpus=False)
            else:
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                     synced_gpus=synced)
        finally:
            model.train(was_training)
        return Generated(Rollout.from_generation(ids, mask, out, params.stop_token_ids, params.pad_token_id))
