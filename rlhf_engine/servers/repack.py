"""After vLLM reloads a model's weights on a CPU: a tied LM head packed again (the colocated vllm backend and the
rollout servers' weight transfer both reload layer by layer). torch and the model only: no vLLM import here."""
from __future__ import annotations

from typing import Any


def repack_tied_head(model: Any) -> bool:
    """After a reload: every packed layer whose weight is another module's (an LM head tied to the embedding,
    whatever the architecture names them: Llama's model.embed_tokens, GPT-2's transformer.wte, OPT's
    model.decoder.embed_tokens, ...) gets its GEMM packed again from the new values. On CPU vLLM packs a layer's
    weight into a kernel of its own (a copy) when the model is processed; a reload processes only the layers it
    loaded weights into, and a tied head has none of its own, so it kept computing logits with the first weights,
    the engine's dummy ones: garbage tokens from a tied model such as SmolLM2. Returns whether it packed any (GPU: no
    packing, nothing to do)."""
    owners: dict = {}
    for module in model.modules():
        weight = getattr(module, "_parameters", {}).get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    packed = False
    for modules in owners.values():
        if len(modules) < 2:  # not shared: the reload processed it with its own weight
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and method is not None:
                method.process_weights_after_loading(module)
                packed = True
    return packed
