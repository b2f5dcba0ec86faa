"""The actor's weights as (Hugging Face name, tensor) pairs, one block at a time: what an inference engine holding its
own copy of the policy loads (the vLLM backend's push after every optimizer step).

* Names are the plain Hugging Face model's state-dict names (what `from_pretrained` reads, and what an engine's
  checkpoint loader maps onto its own fused layers), whatever wraps the model: a LoRA layer is yielded merged,
  W + scale * B @ A (peft's `get_delta_weight`, which knows GPT-2's transposed Conv1D), under the base layer's name;
  the adapter's own tensors never. Tied weights appear once, as `named_parameters` lists them.
* Groups: the parameters of one numbered block (`model.layers.3.`, GPT-2's `transformer.h.3.`) form a group; every
  other parameter (embeddings, final norm, head) is a group of its own. A group is yielded whole before the next
  starts, so a layer the engine fuses (q, k, v -> qkv; gate, up -> gate_up) receives all its parts together: vLLM
  processes a fused layer when its last part arrives and corrupts one whose parts are split across loads.
* ZeRO-3: a group's partitions are gathered (collective: every rank streams the same groups in the same order) only
  while it is copied out; no rank holds more than one gathered group and its copy beyond its own partitions.
"""
from __future__ import annotations

import hashlib
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from .models import unwrap_peft
from .zero3 import _not_available

_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # the first numbered module of a parameter's path: its block


def weight_groups(module: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """[(group name, [(parameter name in the Hugging Face model, parameter)])] in the model's own order; `module`
    is the actor's module (a Hugging Face causal LM or its peft wrapper)."""
    groups: list[tuple[str, list]] = []
    for name, p in unwrap_peft(module).named_parameters():
        m = _BLOCK.match(name)
        key = m.group(1) if m else name
        if groups and groups[-1][0] == key:
            groups[-1][1].append((name, p))
        else:
            groups.append((key, [(name, p)]))
    return groups


def _lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """name -> peft LoRA layer of the Hugging Face model inside `module` (empty without an adapter)."""
    if not hasattr(module, "peft_config"):
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in unwrap_peft(module).named_modules() if isinstance(m, LoraLayer)}


def _plain(group: list[tuple[str, nn.Parameter]], lora: dict[str, nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """One group's (plain name, value) pairs: adapters merged into their base weights, their own tensors dropped."""
    out = []
    for name, p in group:
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            out.append((name, p.data))
            continue
        owner, _, leaf = name.partition(".base_layer.")
        value = p.data
        layer = lora[owner]
        if leaf == "weight":
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    value = value + layer.get_delta_weight(adapter).to(value.dtype)
        out.append((f"{owner}.{leaf}", value))
    return out


@torch.no_grad()
def stream_blocks(module: nn.Module) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """(group name, [(Hugging Face name, tensor)]) of the actor's `module`, group by group (`weight_groups`).
    Collective under ZeRO-3 (each group is gathered): every rank must consume the whole stream. A tensor is the
    parameter itself where nothing had to be gathered or merged (the consumer copies it), else a fresh tensor."""
    import deepspeed

    lora = _lora_layers(module)
    for key, group in weight_groups(module):
        todo = _not_available([p for _, p in group])
        if not todo:
            yield key, _plain(group, lora)
            continue
        with deepspeed.zero.GatheredParameters(todo):  # the gathered storage is freed on exit: copy it out
            values = [(n, v.clone()) for n, v in _plain(group, lora)]
        yield key, values


def stream_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight, in `stream_blocks` order (collective under ZeRO-3)."""
    for _, values in stream_blocks(module):
        yield from values


def weights_sha256(pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of the tensors' bytes in the given order: equal on two sides only if every weight is bitwise equal."""
    h = hashlib.sha256()
    for _, t in pairs:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
