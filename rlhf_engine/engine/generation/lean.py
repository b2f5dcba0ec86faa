"""The lean backend: our own decoding loop over the actor's forward and its KV cache (the default).

Per token it runs one forward of the new tokens against the cache and the token selection of `sampling.py`; nothing
else (Hugging Face generate adds its input preparation, processor and stopping-criteria machinery around every
step, and torch.multinomial, measured at 60% of a small model's decoding time on CPU). Same rules as the HF backend,
which tests hold it to: the exact distribution softmax(masked logits / temperature), stop tokens masked before
`min_new_tokens`, a response ends at its first stop token and pads after it, at most `max_new_tokens`; position ids
from the attention mask (left-padded prompts start at 0); the generation-time log-prob of every sampled token comes
out of the same pass over the logits. ZeRO-3: see `GenerationBackend.zero3_mode`; in per-layer mode every step ends
with one all-reduce of "this rank is done" so the ranks run the same number of forwards. A LoRA actor generates with
its adapter (the module is called as it is).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...comm import all_reduce
from ...rollout import Rollout, position_ids_from_mask
from ..models import accepts_logits_to_keep, cache_argument
from .base import GenerationBackend, Generated, SamplingParams
from .sampling import greedy_from_scores, sample_from_scores, step_scores


class LeanBackend(GenerationBackend):
    name = "lean"

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> Generated:
        if params.do_sample and (params.top_k or params.top_p < 1.0):
            raise ValueError("the lean backend samples the full distribution (top_k 0, top_p 1.0): a truncated one is "
                             "not what PPO's log-probs score")
        ids, mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        stop = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        lockstep = self.lockstep()
        fetching = self.zero3_mode() == "per_layer"
        limits = params.limits(ids.shape[0], self.device)
        with self.generation_model() as model:
            # inference mode: no autograd bookkeeping per op (measured -7% decoding time on a small model); the
            # results are cloned out of it so that the rollout may enter autograd (training forwards) later. Not
            # where ZeRO-3 fetches layers inside the loop (per-layer mode): a parameter it gathers there and keeps
            # (the persistent small ones) would be an inference tensor, refused by the next training backward.
            with torch.no_grad() if fetching else torch.inference_mode():
                tokens, logprobs = self._decode(model, ids, mask, stop, params, lockstep, limits)
            tokens, logprobs = tokens.clone(), logprobs.clone()
        rollout = Rollout.from_generation(ids, mask, tokens, params.stop_token_ids, params.pad_token_id,
                                          includes_prompt=False, limits=limits)
        return Generated(rollout, logprobs[:, :rollout.response_width] * rollout.action_mask)

    def _decode(self, model, ids: torch.Tensor, mask: torch.Tensor, stop: torch.Tensor, params: SamplingParams,
                lockstep: bool, limits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, G] response tokens, pad after each row's stop token or its limit; [B, G] fp32 log-probs),
        G <= max_new_tokens. A finished row's position stops advancing: the filler it is fed never reaches a position
        past its last real token (a row at its limit may sit at the end of the positions checked at start-up)."""
        B, P = ids.shape
        R = params.max_new_tokens
        temperature = params.temperature if params.do_sample else 1.0
        full_mask = torch.cat([mask, mask.new_ones(B, R)], dim=1)
        position = position_ids_from_mask(mask)
        keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        cache_arg = cache_argument(model)
        # the model's own growing cache: a preallocated StaticCache only pays under torch.compile (measured 1-13%
        # slower per call than the dynamic one on CPU, 2026-12-03)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, **keep)
        cache, logits = getattr(out, cache_arg), out.logits[:, -1]
        step_masks = decode_step_masks(model, full_mask)
        position = position[:, -1:]
        tokens = ids.new_full((B, R), params.pad_token_id)
        logprobs = torch.zeros(B, R, dtype=torch.float32, device=ids.device)
        unfinished = torch.ones(B, dtype=torch.bool, device=ids.device)
        done = torch.zeros(1, device=ids.device)
        for t in range(R):
            scores = step_scores(logits, t, stop, params.min_new_tokens, temperature)
            tok, lp = sample_from_scores(scores) if params.do_sample else greedy_from_scores(scores)
            tokens[:, t] = torch.where(unfinished, tok, params.pad_token_id)
            logprobs[:, t] = lp * unfinished
            unfinished &= ~torch.isin(tok, stop)
            if limits is not None:
                unfinished &= limits > t + 1
            if t == R - 1:
                return tokens, logprobs
            if lockstep:  # every rank stops at the same step: each forward gathers layers collectively
                done.fill_(float(not bool(unfinished.any())))
                if all_reduce(done, "min").item() > 0:
                    break
            elif not bool(unfinished.any()):
                break
            position = position + unfinished[:, None]
            step_mask = full_mask[:, :P + t + 1] if step_masks is None else step_masks[..., :P + t + 1]
            out = model(input_ids=tokens[:, t:t + 1], attention_mask=step_mask, position_ids=position,
                        use_cache=True, **{cache_arg: cache}, **keep)
            cache, logits = getattr(out, cache_arg), out.logits[:, -1]
        return tokens[:, :t + 1], logprobs[:, :t + 1]


def decode_step_masks(model, full_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """[B, 1, 1, P + R] attention masks of the one-token decode steps (sliced to the step's key length), built once
    in the form the model would build at every step, or None where the model must build its own.

    A one-token query sees every earlier key, so its causal mask is the padding mask: True (sdpa) or 0.0 (eager,
    additive) where it attends. transformers passes a prepared 4D mask through unchanged; rebuilding it per token
    cost 10% of a small model's decoding on CPU (measured 2026-12-03). Other kernels (flash attention takes 2D
    masks) and sliding-window layers keep the 2D mask."""
    base = getattr(model, "get_base_model", lambda: model)()
    cfg = base.config
    impl = getattr(cfg, "_attn_implementation", None)
    layer_types = getattr(cfg, "layer_types", None) or ()
    sliding = getattr(cfg, "sliding_window", None) or any("sliding" in str(t) for t in layer_types)
    if impl not in ("sdpa", "eager") or sliding:
        return None
    attend = full_mask[:, None, None, :].bool()
    if impl == "sdpa":
        return attend
    dtype = base.dtype
    return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill(~attend, torch.finfo(dtype).min)
