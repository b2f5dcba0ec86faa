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

Under ZeRO-3 the actor's weights are partitioned; `zero3_mode` says how a call gets them (`generation_gather_once`):
'replica' decodes on a plain copy refreshed once per call (engine/zero3.py: no hook, no collective inside); 'gathered'
gathers them into the ZeRO-3 module once (its hooks still run at every token); 'per_layer' fetches every layer for
every token, the ranks in lockstep. `generation_model()` is the module to decode with, prepared that way.

`vllm` (vllm_engine.py) runs an inference engine of its own on each rank, loaded with the actor's weights whenever
the actor has stepped; `release` and `take_sync_seconds` are its hooks into the loop.

A new backend is one new file holding a `GenerationBackend` subclass plus one line in `BACKENDS` below.
"""
from .base import GenerationBackend, GenerationContext, Generated, SamplingParams
from .hf import HFBackend
from .hybrid import HybridEngineBackend
from .lean import LeanBackend
from .vllm_engine import VLLMBackend

BACKENDS: dict[str, type] = {"lean": LeanBackend, "hf": HFBackend, "hybrid": HybridEngineBackend,
                             "vllm": VLLMBackend}

__all__ = ["BACKENDS", "GenerationBackend", "GenerationContext", "Generated", "SamplingParams"]
