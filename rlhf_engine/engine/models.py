"""Model loading per role: causal LMs for actor/reference, scalar-head models for critic/reward.

Scalar-head models are stored as HF `*ForSequenceClassification` with one label, so any HF tool loads them, but we
never use HF's pooling (it finds the last token from `input_ids != pad`, which is wrong when pad == EOS). Instead
`ScalarHeadModel` returns the head output at every position and the caller gathers the positions it needs.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Optional

import torch
from torch import nn

log = logging.getLogger(__name__)


def prepare_tokenizer(tok):
    """The actor's tokenizer as every rollout needs it: left-padded; a missing pad token becomes EOS (logged)."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer {tok.name_or_path} has neither a pad nor an EOS token; add one")
        tok.pad_token = tok.eos_token
        log.warning("tokenizer has no pad token: using EOS %r as pad", tok.eos_token)
    return tok


def load_tokenizer(path: str):
    """`prepare_tokenizer` of the tokenizer at `path`."""
    from transformers import AutoTokenizer

    return prepare_tokenizer(AutoTokenizer.from_pretrained(path))


def no_dropout_config(path: str, **overrides):
    """The model's config with every dropout probability set to 0 (RL needs deterministic forwards)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **overrides)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    return config


@contextlib.contextmanager
def zero3_construction(ds_config: Optional[dict]):
    """Keep transformers' `HfDeepSpeedConfig` alive only while a ZeRO-3 model is built.

    It is a process-global weak reference: while it lives every `from_pretrained` is partitioned, including models
    meant for other stages. `ds_config=None` builds normally.
    """
    if ds_config is None or ds_config.get("zero_optimization", {}).get("stage") != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    holder = HfDeepSpeedConfig(ds_config)  # noqa: F841  (must stay referenced while building)
    try:
        yield
    finally:
        del holder
        unset_hf_deepspeed_config()


def attention_kwargs(setting: str) -> dict:
    """`from_pretrained` arguments of an `attn_implementation` setting ('auto': transformers' own default, sdpa).
    Measured on CPU in bf16 (OPT H64 L2, 2026-12-02): eager's attention alone is 2-3x faster than sdpa's CPU
    flash kernel forward + backward, but in the model eager made generation and experience 17% slower and training
    5% faster, so auto stays sdpa."""
    return {} if setting == "auto" else {"attn_implementation": setting}


def load_causal_lm(path: str, dtype: torch.dtype, ds_config: Optional[dict] = None,
                   gradient_checkpointing: bool = False, attn_implementation: str = "auto") -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = no_dropout_config(path)
    with zero3_construction(ds_config):
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                     **attention_kwargs(attn_implementation))
    if gradient_checkpointing:
        # use_cache stays on in the config: generation (eval mode) keeps its KV cache; the training forwards pass
        # use_cache=False themselves, and HF turns the cache off under checkpointing in training mode anyway
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class ScalarHeadModel(nn.Module):
    """Wraps an HF `*ForSequenceClassification` (num_labels=1) to output the head at every position.

    forward(input_ids [B, L], attention_mask [B, L], position_ids [B, L]) -> [B, L] fp32.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.model = hf_model
        head = getattr(hf_model, "score", None)
        if head is None:
            raise ValueError(f"{type(hf_model).__name__} has no `score` head; scalar roles need a decoder "
                             "*ForSequenceClassification model (e.g. GPT2, Llama, Qwen, Mistral)")
        self.head = head

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model (under the peft wrapper when the role has a LoRA adapter)."""
        return unwrap_peft(self.model)

    def forward(self, input_ids, attention_mask, position_ids):
        hf = self.hf_model
        backbone = getattr(hf, hf.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    def save_pretrained(self, out_dir: str, state_dict: Optional[dict] = None) -> None:
        if state_dict is not None:
            state_dict = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
        self.hf_model.save_pretrained(out_dir, state_dict=state_dict)


def load_scalar_model(path: str, dtype: torch.dtype, ds_config: Optional[dict] = None, pad_token_id: Optional[int] = None,
                      gradient_checkpointing: bool = False, attn_implementation: str = "auto") -> ScalarHeadModel:
    """A scalar-head model from a `*ForSequenceClassification` folder, or from a causal LM folder (new head)."""
    from transformers import AutoModelForSequenceClassification

    config = no_dropout_config(path, num_labels=1)
    if pad_token_id is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = pad_token_id
    with zero3_construction(ds_config):
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype,
                                                                   **attention_kwargs(attn_implementation))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return ScalarHeadModel(model)


# ---- LoRA (peft) ---------------------------------------------------------------------------------------------------
def weightless_model(config, scalar: bool) -> Optional[nn.Module]:
    """The model `config` describes, built on the meta device (no memory, no weights): a scalar role's is the
    one-label *ForSequenceClassification. None where transformers cannot build it so (the plan's checks that use it
    then leave the model to the engine's build)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        with torch.device("meta"):
            if scalar:
                config = copy.deepcopy(config)
                config.num_labels = 1
                return AutoModelForSequenceClassification.from_config(config)
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001  (an architecture transformers cannot build weightless)
        return None


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft `PeftModel` (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def peft_model_of(module: nn.Module):
    """The `PeftModel` of an engine module (a causal LM's `PeftModel`, or the one inside a `ScalarHeadModel`), or
    None when the role has no adapter."""
    inner = module.model if isinstance(module, ScalarHeadModel) else module
    return inner if hasattr(inner, "peft_config") and hasattr(inner, "disable_adapter") else None


def _adapter_layer_types() -> tuple:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def _heads(hf_model: nn.Module) -> set:
    """ids of the output layers that never get an adapter: the LM head and classification / score heads."""
    heads = [hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None]
    heads += [getattr(hf_model, name, None) for name in ("score", "classifier", "lm_head")]
    return {id(m) for m in heads if isinstance(m, nn.Module)}


def lora_target_names(hf_model: nn.Module, spec: str) -> list[str]:
    """Full names of the modules of `hf_model` that get an adapter under `lora_target_modules = spec`: every Linear /
    GPT-2 Conv1D layer of the backbone for 'all-linear', else those whose name equals or ends with one of the
    comma-separated entries. Heads (LM head, score head) are never adapted: the LM head is usually tied to the
    embeddings, and the critic's score head is trained fully instead."""
    heads = _heads(hf_model)
    layers = [n for n, m in hf_model.named_modules() if isinstance(m, _adapter_layer_types()) and id(m) not in heads]
    wanted = [t.strip() for t in spec.split(",") if t.strip()]
    if wanted == ["all-linear"]:
        return layers
    return [n for n in layers if any(n == t or n.endswith("." + t) for t in wanted)]


def lora_config_for(hf_model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: str):
    """The peft `LoraConfig` of one role (explicit module names, so the same config rebuilds the same adapter on a
    fresh copy of the model for export). Raises ValueError when nothing matches `target_modules`."""
    from peft import LoraConfig

    names = lora_target_names(hf_model, target_modules)
    if not names:
        layers = [n for n, m in hf_model.named_modules() if isinstance(m, _adapter_layer_types())]
        raise ValueError(f"lora_target_modules={target_modules!r} matches no Linear/Conv1D layer of "
                         f"{type(hf_model).__name__}; its layers are e.g. {layers[:6]}")
    modules = dict(hf_model.named_modules())
    conv1d = [n for n in names if not isinstance(modules[n], nn.Linear)]  # GPT-2's Conv1D stores W transposed
    if conv1d and len(conv1d) != len(names):
        raise ValueError(f"lora_target_modules={target_modules!r} mixes Linear and Conv1D layers; name one kind")
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=names, bias="none",
                      fan_in_fan_out=bool(conv1d))


def apply_lora(hf_model: nn.Module, rc, gradient_checkpointing: bool = False):
    """Wrap `hf_model` in a peft `PeftModel` with the role's LoRA adapter (`rc`: a RoleConfig with lora_dim > 0).

    Every base weight is frozen; only the adapter trains. The adapter has the backbone's dtype (no fp32 upcast: ZeRO
    needs one dtype per engine). Works on a ZeRO-3-partitioned model: the adapter is created unpartitioned and
    `deepspeed.initialize` partitions (and broadcasts) it. With gradient checkpointing the embedding outputs are made
    to require grad, so checkpointed blocks see an input that does."""
    from peft import get_peft_model

    cfg = lora_config_for(hf_model, rc.lora_dim, rc.lora_alpha, rc.lora_dropout, rc.lora_target_modules)
    if gradient_checkpointing and getattr(hf_model, "_require_grads_hook", None) is None:
        hf_model.enable_input_require_grads()
    dtype = next(p.dtype for p in hf_model.parameters() if p.is_floating_point())
    peft_model = get_peft_model(hf_model, cfg, autocast_adapter_dtype=False)
    for name, p in peft_model.named_parameters():
        if "lora_" in name and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return peft_model


def add_lora(module: nn.Module, rc, gradient_checkpointing: bool = False) -> nn.Module:
    """A role's model with its LoRA adapter: a causal LM becomes a `PeftModel`; a `ScalarHeadModel` keeps its class
    with the adapter on its backbone and its score head fully trainable."""
    if isinstance(module, ScalarHeadModel):
        module.model = apply_lora(module.model, rc, gradient_checkpointing)
        module.head.requires_grad_(True)
        return module
    return apply_lora(module, rc, gradient_checkpointing)


@contextlib.contextmanager
def adapter_disabled(module: nn.Module):
    """Run `module` (a role with a LoRA adapter) as its base model: peft's `disable_adapter()`. The adapter's
    requires_grad flags are restored on exit (DeepSpeed's gradient hooks sit on the tensors and survive)."""
    peft_model = peft_model_of(module)
    if peft_model is None:
        raise ValueError("this model has no LoRA adapter to disable")
    with peft_model.disable_adapter():
        yield


def merged_copy(module: nn.Module, state_dict: dict) -> nn.Module:
    """A plain Hugging Face model on CPU with the adapter merged into the base weights: a fresh copy of `module`'s
    structure (fp32), loaded with its full (consolidated) `state_dict`, then peft's `merge_and_unload`, cast back to
    the state dict's dtype. `module` is the engine's module (a causal LM `PeftModel` or a `ScalarHeadModel`)."""
    import copy

    from peft import get_peft_model

    peft_model = peft_model_of(module)
    if peft_model is None:
        raise ValueError("this model has no LoRA adapter to merge")
    if isinstance(module, ScalarHeadModel):
        state_dict = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
    base = peft_model.get_base_model()
    dtype = next(v.dtype for v in state_dict.values() if v.is_floating_point())
    fresh = type(base)(copy.deepcopy(base.config)).float()
    fresh_peft = get_peft_model(fresh, copy.deepcopy(peft_model.peft_config[peft_model.active_adapter]),
                                autocast_adapter_dtype=False)
    missing, unexpected = fresh_peft.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    # tied weights (an LM head tied to the embeddings) may be stored under one name only
    tied = {k for k in missing if "lm_head" in k or "embed_out" in k}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"merging the adapter: state dict does not fit the model (missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]})")
    merged = fresh_peft.merge_and_unload()
    return merged.to(dtype).eval()


def accepts_logits_to_keep(module) -> bool:
    """Whether the causal LM's forward takes `logits_to_keep` (transformers' decoder models do; peft passes it on).
    Cached per model class (asked at every forward)."""
    base = getattr(module, "get_base_model", lambda: module)()
    return _forward_takes(type(base), "logits_to_keep")


def cache_argument(module) -> str:
    """The name of the KV cache in the causal LM's forward and output: `cache` (transformers >= 5.2x) or
    `past_key_values` (earlier 5.x, e.g. 5.19 in the vLLM environment)."""
    base = getattr(module, "get_base_model", lambda: module)()
    return "cache" if _forward_takes(type(base), "cache") else "past_key_values"


@functools.lru_cache(maxsize=None)
def _forward_takes(cls: type, name: str) -> bool:
    import inspect

    return name in inspect.signature(cls.forward).parameters
