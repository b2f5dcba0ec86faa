"""DeepSpeed's Hybrid Engine: the actor generates with DeepSpeed's inference kernels (GPU only; UNVERIFIED: this
project's machines have no GPU). Its sampling and stop rules are Hugging Face generate's (the HF backend's arguments).

The first call is a self-check: the first batch is decoded greedily by the Hybrid Engine and by plain Hugging Face
generate (the engine's training-mode forwards); any differing token on any rank stops the run. The experience forwards
must not run on the inference kernels: `forward_mode` keeps the DeepSpeed engine in training mode and puts only the
module in eval mode.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Iterator, Optional

import torch

from ... import comm
from .base import Generated, SamplingParams
from .hf import HFBackend, SampledLogprobs, generated, neutral_generation_config

log = logging.getLogger(__name__)


class HybridEngineBackend(HFBackend):
    name = "hybrid"

    def __init__(self, ctx):
        super().__init__(ctx)
        self._checked = False

    @classmethod
    def actor_ds_overrides(cls, cfg: Any) -> Optional[dict]:
        """The actor's `hybrid_engine` DeepSpeed section (DeepSpeed-Chat's flags)."""
        e, g = cfg.engine, cfg.generation
        return {"hybrid_engine": {"enabled": True, "max_out_tokens": g.max_prompt_seq_len + g.max_answer_seq_len,
                                  "inference_tp_size": e.inference_tp_size,
                                  "release_inference_cache": e.release_inference_cache,
                                  "pin_parameters": not e.unpin_actor_parameters,
                                  "tp_gather_partition_size": e.tp_gather_partition_size}}

    def zero3_mode(self) -> str:
        # the Hybrid Engine gathers ZeRO-3 parameters itself, in lockstep
        return "per_layer" if self.ctx.actor_stage == 3 else "plain"

    @contextlib.contextmanager
    def forward_mode(self) -> Iterator[None]:
        engine = self.actor
        was_training = engine.training
        engine.train()  # the Hybrid Engine's eval() would run these forwards on its inference kernels
        engine.module.eval()
        try:
            yield
        finally:
            engine.train(was_training)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generated:
        if params.row_limits:  # environments are refused with this backend, whichever flag asks (config/train.py)
            raise ValueError("the hybrid backend does not take per-row token limits (episodes): use lean or hf")
        engine = self.actor
        was_training = engine.module.training
        gen_config, synced = self.generation_config(params)
        ids, mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        try:
            if not self._checked:
                self._checked = True
                with neutral_generation_config(engine.module):
                    self._self_check(ids, mask, gen_config, synced)
            engine.eval()  # the Hybrid Engine swaps its inference containers in
            recorder = SampledLogprobs(params.temperature if params.do_sample else 1.0)
            with neutral_generation_config(engine.module):
                out = engine.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                      synced_gpus=synced, logits_processor=[recorder])
        finally:
            engine.train()  # its eval() swapped the inference kernels in: swap them out
            engine.module.train(was_training)
        return generated(ids, mask, out, params, recorder)

    def _self_check(self, ids: torch.Tensor, mask: torch.Tensor, gen_config, synced: bool) -> None:
        engine = self.actor
        greedy = copy.deepcopy(gen_config)
        greedy.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        engine.eval()  # the Hybrid Engine swaps its inference containers in
        he_out = engine.generate(input_ids=ids, attention_mask=mask, generation_config=greedy, synced_gpus=synced)
        engine.train()  # Hugging Face forwards back
        engine.module.eval()
        # the Hybrid Engine replaces module.generate with its own and keeps the original as `_generate`
        hf_generate = getattr(engine, "_generate", None) or engine.module.generate
        hf_out = hf_generate(input_ids=ids, attention_mask=mask, generation_config=greedy, synced_gpus=synced)
        same = he_out.shape == hf_out.shape and bool(torch.equal(he_out.cpu(), hf_out.cpu()))
        if comm.agree(not same):
            detail = (f"shapes {tuple(he_out.shape)} vs {tuple(hf_out.shape)}" if he_out.shape != hf_out.shape
                      else f"{int((he_out != hf_out).sum())} of {he_out.numel()} tokens differ")
            raise RuntimeError("generation_backend hybrid: self-check failed: the Hybrid Engine's greedy generation "
                               f"of the first batch differs from Hugging Face generate on some rank (this rank: "
                               f"{'equal' if same else detail}). Its inference kernels do not reproduce this "
                               "model; use --generation_backend hf")
        if self.dist.is_main:
            log.info("generation_backend hybrid: self-check passed (greedy first batch equals Hugging Face generate)")
