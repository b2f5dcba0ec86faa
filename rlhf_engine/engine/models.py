"""Model loading per role: causal LMs for actor/reference, scalar-head models for critic/reward.

Scalar-head models are stored as HF `*ForSequenceClassification` with one label, so any HF tool loads them, but we
never use HF's pooling (it finds the last token from `input_ids != pad`, which is wrong when pad == EOS). Instead
`ScalarHeadModel` returns the head output at every position and the caller gathers the positions it needs.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
from torch import nn

log = logging.getLogger(__name__)


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


def load_causal_lm(path: str, dtype: torch.dtype, ds_config: Optional[dict] = None,
                   gradient_checkpointing: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = no_dropout_config(path)
    with zero3_construction(ds_config):
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
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

    def forward(self, input_ids, attention_mask, position_ids):
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    def save_pretrained(self, out_dir: str, state_dict: Optional[dict] = None) -> None:
        if state_dict is not None:
            state_dict = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
        self.model.save_pretrained(out_dir, state_dict=state_dict)


def load_scalar_model(path: str, dtype: torch.dtype, ds_config: Optional[dict] = None, pad_token_id: Optional[int] = None,
                      gradient_checkpointing: bool = False) -> ScalarHeadModel:
    """A scalar-head model from a `*ForSequenceClassification` folder, or from a causal LM folder (new head)."""
    from transformers import AutoModelForSequenceClassification

    config = no_dropout_config(path, num_labels=1)
    if pad_token_id is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = pad_token_id
    with zero3_construction(ds_config):
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return ScalarHeadModel(model)
