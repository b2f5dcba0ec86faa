"""Forwards on packed rows (rlhf_engine/packing.py), and the start-up check that a model computes them right.

A causal LM runs as its backbone on the packed rows, then its output head on the hidden states of the positions
that predict response tokens only (as `logits_to_keep` does for padded rows: prompt logits are never computed). A
scalar-head model (critic, reward) runs as it always does, with the packed rows' additive mask as its attention
mask. `packing_works` runs both paths on a probe of two short sequences: a model whose head adds a transform of
its own (logit soft-capping, scaling) or that ignores a 4D attention mask fails it, and packing is then refused
for it by name.
"""
from __future__ import annotations

from typing import Any

import torch

from ..packing import Packed, pack_rows
from .models import ScalarHeadModel, unwrap_peft

PROBE_ATOL = 1e-3  # packed vs padded logits of the probe in the model's dtype (fp32 agrees to ~1e-6)


def causal_parts(module: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone, output head) of a Hugging Face causal LM (under a peft wrapper: its adapted layers)."""
    hf = unwrap_peft(module)
    return getattr(hf, hf.base_model_prefix), hf.get_output_embeddings()


def packed_inputs(packed: Packed, input_ids: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype) -> dict:
    return dict(input_ids=packed.take(input_ids), position_ids=packed.take(position_ids),
                attention_mask=packed.attention_bias(dtype))


def packed_hidden(module: Any, inputs: dict) -> torch.Tensor:
    """[N, W, H] last hidden states of a causal LM's backbone on packed rows."""
    backbone, _ = causal_parts(module)
    return backbone(**inputs, use_cache=False).last_hidden_state


def packed_logits_at(module: Any, packed: Packed, inputs: dict, positions: torch.Tensor) -> torch.Tensor:
    """[K, V] logits at `positions` [K] (flat slots of the packed rows)."""
    hidden = packed_hidden(module, inputs)
    _, head = causal_parts(module)
    return head(hidden.reshape(-1, hidden.shape[-1])[positions])


def model_dtype(module: Any) -> torch.dtype:
    p = next(iter(module.parameters()), None)
    return p.dtype if p is not None and p.is_floating_point() else torch.float32


def packing_works(module: Any) -> bool:
    """Packed and padded forwards agree on a probe (two sequences of 5 and 3 tokens, left-padded, ids below the
    model's vocabulary size). Collective under ZeRO-3 (every rank runs the same probe)."""
    device = next(iter(module.parameters())).device
    hf = module.hf_model if isinstance(module, ScalarHeadModel) else unwrap_peft(module)
    vocab_size = int(hf.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(vocab_size, 4), (2, 5), generator=gen).to(device)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    dtype = model_dtype(module)
    packed = pack_rows(mask, width=8)  # both sequences in one row
    inputs = packed_inputs(packed, ids, pos, dtype)
    was_training = module.training
    module.eval()  # no dropout in the probe
    try:
        return _agree(module, ids, mask, pos, packed, inputs)
    finally:
        module.train(was_training)


def _agree(module, ids, mask, pos, packed, inputs) -> bool:
    with torch.no_grad():
        if isinstance(module, ScalarHeadModel):
            padded = module(input_ids=ids, attention_mask=mask, position_ids=pos)
            got = packed.unpack(module(**inputs))
        else:
            padded = module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            real = mask.bool()
            got = torch.zeros_like(padded)
            got[real] = packed_logits_at(module, packed, inputs, packed.slot[real])
    real = mask.bool()
    return bool(torch.allclose(got[real].float(), padded[real].float(), atol=PROBE_ATOL, rtol=0))
