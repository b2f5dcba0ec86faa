"""`--generation_backend auto`: the field's engine where it can serve the run, else our own loop.

    backend, why = choose_backend(cfg)    # ("vllm", "vLLM 0.32.0 serves LlamaForCausalLM"), or ("lean", why not)

vllm where it imports here (or the rollout servers run it), the run samples the full distribution (vLLM's sampling
is scored only untruncated: `vllm_engine.request_fields`), and vLLM itself says it can generate for the actor
(`vllm_engine.unavailable_reasons`: its architecture, a mixture of experts, the CPU attention's head sizes); lean
otherwise. Decided once per run, from the config and the actor's config.json (no weight is read), before the
backend's defaults apply (`config.ppo.BACKEND_DEFAULTS`: rollout_correction token_truncate with vllm).
"""
from __future__ import annotations

import importlib.util
from typing import Any


def _actor_config(cfg: Any) -> Any:
    from transformers import AutoConfig

    from ...pretrained import resolve_builtin

    return AutoConfig.from_pretrained(resolve_builtin(cfg.actor.model_name_or_path))


def choose_backend(cfg: Any) -> tuple[str, str]:
    """(the backend `auto` stands for in the run `cfg`, why). Reads the actor's config only where vLLM imports."""
    if cfg.rollout.servers_on:
        return "vllm", "the rollout servers are vLLM servers"
    if importlib.util.find_spec("vllm") is None:
        return "lean", "vLLM is not installed in this environment"
    g = cfg.generation
    if g.do_sample and (g.top_k or g.top_p < 1.0):
        return "lean", f"top_k {g.top_k} / top_p {g.top_p}: vLLM's log-probs score only the full distribution"
    try:
        config = _actor_config(cfg)
    except Exception as e:  # noqa: BLE001  (a bad path is the plan's to report, by name)
        return "lean", f"the actor's config could not be read ({type(e).__name__})"
    from .vllm_engine import unavailable_reasons

    reasons = unavailable_reasons(config)
    if reasons:
        return "lean", reasons[0]
    import vllm

    archs = ", ".join(getattr(config, "architectures", None) or [])
    return "vllm", f"vLLM {vllm.__version__} is installed and serves {archs}"


def resolve_auto(cfg: Any) -> None:
    """Where the run asks for `generation_backend auto` (and not for the Hybrid Engine by enable_hybrid_engine): set
    the backend chosen, and why in `engine.generation_backend_auto` (logged at start-up)."""
    e = cfg.engine
    if e.generation_backend != "auto" or e.enable_hybrid_engine is True:
        return
    e.generation_backend, why = choose_backend(cfg)
    e.generation_backend_auto = f"auto chose {e.generation_backend}: {why}"
