"""Forwards on packed rows (rlhf_engine/packing.py), and the start-up check that a model computes them right.

A causal LM runs as its backbone on the packed rows, then its output head on the hidden states of the positions
that predict response tokens only (as `logits_to_keep` does for padded rows: prompt logits are never computed). That
forward runs inside DeepSpeed's own forward (the module's forward swapped for it for the one call): ZeRO-3 counts its
micro-batches there, and without the count every micro-batch's gradient replaces the previous one's instead of adding
to it. A scalar-head model (critic, reward) runs as it always does, with the packed rows' additive mask as its
attention mask.

`packing_works` runs both paths on a probe as long as the run's longest sequence: a model whose head adds a transform
of its own (logit soft-capping, scaling), that ignores a 4D attention mask, or whose attention reaches less far than
the run's sequences (a sliding window or chunked attention the config check of engine/preflight.py does not know)
fails it, and packing is then refused for it by name.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from ..packing import Packed, pack_rows, sliding_window
from .models import ScalarHeadModel, unwrap_peft
from ..hf_fields import max_positions

PROBE_ATOL = 1e-3  # packed vs padded logits of the probe in the model's dtype (fp32 agrees to ~1e-6)
PROBE_TOKENS = 64  # the probe's longer sequence when the caller does not give the run's longest
PROBE_MAX_TOKENS = 512  # the probe compares full-vocabulary logits: [2, n, V] (n = 512, V = 152k: ~0.6 GB in bf16)


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


def _is_deepspeed_engine(model: Any) -> bool:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return isinstance(model, DeepSpeedEngine)


def _zero3_partitioned(module: torch.nn.Module) -> bool:
    p = next(iter(module.parameters()), None)
    return p is not None and hasattr(p, "ds_id")


@contextlib.contextmanager
def _forward_replaced(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """`module(...)` calls `forward` inside this block (its hooks still run: ZeRO-3 gathers and releases as usual)."""
    own = module.__dict__.get("forward")  # an instance-level forward (a wrapper's) is put back, not dropped
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def packed_logits_at(model: Any, packed: Packed, inputs: dict, positions: torch.Tensor) -> torch.Tensor:
    """[K, V] logits at `positions` [K] (flat slots of the packed rows). `model`: the role's DeepSpeed engine, which a
    forward with gradients under ZeRO-3 must be (module docstring); or a bare module (the probe)."""
    engine = model if _is_deepspeed_engine(model) else None
    module = engine.module if engine is not None else model

    def forward(**kw):
        hidden = packed_hidden(module, kw)
        _, head = causal_parts(module)
        return head(hidden.reshape(-1, hidden.shape[-1])[positions])

    if engine is not None:
        with _forward_replaced(module, forward):
            return engine(**inputs)
    if torch.is_grad_enabled() and _zero3_partitioned(module):
        raise RuntimeError("a packed forward with gradients under ZeRO-3 must run through the DeepSpeed engine "
                           "(pass the engine, not engine.module): ZeRO-3 counts micro-batches in the engine's "
                           "forward, and gradient accumulation depends on that count")
    return forward(**inputs)


def model_dtype(module: Any) -> torch.dtype:
    p = next(iter(module.parameters()), None)
    return p.dtype if p is not None and p.is_floating_point() else torch.float32


def _hf_config(module: Any) -> Any:
    hf = module.hf_model if isinstance(module, ScalarHeadModel) else unwrap_peft(module)
    return hf.config


def probe_lengths(module: Any, longest: Optional[int] = None) -> tuple[int, int]:
    """(n, m): the probe's two sequences. n is the run's longest sequence (`longest`, at most PROBE_MAX_TOKENS), so
    that an attention limit shorter than what the run packs shows in the probe; without it PROBE_TOKENS, within a sliding window the config
    declares (preflight has refused a window shorter than the run's sequences). At most the model's positions. m, a
    quarter of n (at least 3 when n allows), shares n's packed row: it starts mid-row, where its positions must
    restart and the first sequence must be out of its sight."""
    config = _hf_config(module)
    n = int(longest) if longest else min(PROBE_TOKENS, sliding_window(config) or PROBE_TOKENS)
    # capped, for its memory at start-up: a declared window shorter than the run's sequences is refused from the
    # config (preflight), whatever its length; the probe catches what a config does not declare, up to this length
    n = max(2, min(n, PROBE_MAX_TOKENS, max_positions(config) or n))
    return n, min(n - 1, max(3, n // 4))


def packing_gap(module: Any, longest: Optional[int] = None) -> float:
    """Largest |packed - padded| output at the real tokens of the probe (`probe_lengths`; ids drawn below the model's
    vocabulary size): the long sequence alone in its padded row, the short one left-padded with one right pad after
    it, as rollouts are. Both sequences share one packed row. Eval mode (no dropout); collective under ZeRO-3 (every
    rank runs the same probe)."""
    device = next(iter(module.parameters())).device
    vocab_size = int(_hf_config(module).vocab_size)
    n, m = probe_lengths(module, longest)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(vocab_size, 4), (2, n), generator=gen).to(device)
    right = 1 if n - m >= 2 else 0
    mask = torch.ones(2, n, dtype=torch.long, device=device)
    mask[1, :n - m - right] = 0
    mask[1, n - right:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = pack_rows(mask, width=n + m)  # both sequences in one row
    inputs = packed_inputs(packed, ids, pos, model_dtype(module))
    was_training = module.training
    module.eval()  # no dropout in the probe
    try:
        return _gap(module, ids, mask, pos, packed, inputs)
    finally:
        module.train(was_training)


def packing_works(module: Any, longest: Optional[int] = None) -> bool:
    """Packed and padded forwards agree on the probe within PROBE_ATOL (`packing_gap`)."""
    return packing_gap(module, longest) <= PROBE_ATOL  # NaN: False


def _gap(module, ids, mask, pos, packed, inputs) -> float:
    real = mask.bool()
    with torch.no_grad():
        if isinstance(module, ScalarHeadModel):
            padded = module(input_ids=ids, attention_mask=mask, position_ids=pos)
            got = packed.unpack(module(**inputs))
        else:
            padded = module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            got = torch.zeros_like(padded)
            got[real] = packed_logits_at(module, packed, inputs, packed.slot[real])
    return float((got[real].float() - padded[real].float()).abs().max())
