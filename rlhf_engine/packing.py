"""Packed rows: a padded batch's real tokens laid end to end in fewer, fuller rows, each sequence on its own.

    packed = pack_rows(attention_mask, position_ids, width)       # [B, L] -> N rows of `width` slots
    model(input_ids=packed.take(sequences), position_ids=packed.take(position_ids),  # empty slots: 0
          attention_mask=packed.attention_bias(dtype))              # [N, 1, W, W] block-diagonal causal
    per_position = packed.unpack(outputs)                           # [N, W, ...] -> [B, L, ...], 0 at padding

Every sequence keeps its own position ids (they restart at 0, from the rollout's mask), and the additive mask lets a
token see only the earlier tokens of its own sequence, so a packed forward computes what the padded one does at
every real token (up to fp32 rounding: other GEMM shapes). The mask is ours, not inferred from restarting position
ids (transformers infers it only for models that pass position ids to their mask builder; OPT does not). Sequences
are placed first-fit in order of decreasing length (stable: the same rows give the same packing), into rows of
`width` slots, at least the longest sequence. Rows are as wide as the padded batch by default, so attention costs
no more per row than before (a single row of every token would cost quadratically more on a CPU, which has no
variable-length attention kernel). Torch only.

The mask has no sliding window: a model that attends within a window (Mistral, Gemma 2/3, Qwen2 with one) computes
packed rows as padded ones only while no sequence is longer than its window. `sliding_window` reads the window from
the model's config; engine/preflight.py refuses `--packing on` (and turns `auto` off) where it is shorter than the
run's longest sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Packed:
    """`slot` [B, L] long: where each token of the padded batch sits in the flattened [N * W] packed rows (-1 at
    padding); `segment` [N, W] long: the sequence of each slot (its row in the batch; -1 for an empty slot)."""

    slot: torch.Tensor
    segment: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.segment.shape)

    def take(self, per_token: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """[B, L] -> [N, W]: the batch's values at their packed slots (`fill` in empty slots)."""
        out = per_token.new_full((self.segment.numel(),), fill)
        real = self.slot >= 0
        out[self.slot[real]] = per_token[real]
        return out.view(self.shape)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[N, W, ...] -> [B, L, ...]: each token's output back at its padded place, 0 at padding."""
        flat = packed.reshape(self.segment.numel(), *packed.shape[2:])
        out = flat.new_zeros((*self.slot.shape, *packed.shape[2:]))
        real = self.slot >= 0
        out[real] = flat[self.slot[real]]
        return out

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, 1, W, W] additive mask: 0 where query q may see key k (same sequence, k <= q), the dtype's minimum
        elsewhere. An empty slot sees itself only (a row of all minimum would give NaN in the softmax)."""
        seg = self.segment
        W = seg.shape[1]
        q = torch.arange(W, device=seg.device)
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        allowed = (same & (q[None, None, :] <= q[None, :, None])) | torch.eye(W, dtype=torch.bool, device=seg.device)
        return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def pack_rows(attention_mask: torch.Tensor, width: Optional[int] = None) -> Packed:
    """[B, L] 0/1 mask -> the packing of each row's real tokens (module docstring). `width` defaults to L."""
    m = attention_mask.bool()
    B, L = m.shape
    lengths = m.sum(-1).tolist()
    W = max(int(width or L), max(lengths, default=1), 1)
    order = sorted(range(B), key=lambda b: -lengths[b])  # stable: ties keep their batch order
    fill: list[int] = []  # slots used per packed row
    start = [0] * B
    row_of = [0] * B
    for b in order:
        n = lengths[b]
        r = next((i for i, used in enumerate(fill) if used + n <= W), None)
        if r is None:
            fill.append(0)
            r = len(fill) - 1
        row_of[b], start[b] = r, fill[r]
        fill[r] += n
    N = max(len(fill), 1)
    device = attention_mask.device
    # the k-th real token of row b goes to slot row_of[b] * W + start[b] + k
    rank = m.long().cumsum(-1) - 1
    base = torch.tensor([row_of[b] * W + start[b] for b in range(B)], dtype=torch.long, device=device)
    slot = torch.where(m, base[:, None] + rank, -1)
    segment = torch.full((N * W,), -1, dtype=torch.long, device=device)
    segment[slot[m]] = torch.arange(B, device=device)[:, None].expand(B, L)[m]
    return Packed(slot=slot, segment=segment.view(N, W))


def padding_fraction(attention_mask: torch.Tensor, packed: Optional[Packed] = None) -> float:
    """The share of a forward's slots that hold no token: of the padded [B, L] batch, or of its packed rows."""
    real = float(attention_mask.sum())
    total = attention_mask.numel() if packed is None else packed.segment.numel()
    return 1.0 - real / max(total, 1)


def token_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows in groups of at most `budget` real tokens (a longer row is a group of its own): the
    micro-batches of --max_tokens_per_micro_batch, by row index."""
    groups: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if not groups or tokens + n > budget:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += n
    return groups


def micro_batch_rows(lengths: list[int], mini_batch: int, rows: int, budget: int) -> list[list[list[int]]]:
    """Per mini-batch (`mini_batch` consecutive rows), its micro-batches as row indices of the whole buffer: `rows`
    rows each, or by a token budget. The experience forwards and the training use the same ones, so both see the same
    packed rows."""
    out = []
    for start in range(0, len(lengths), mini_batch):
        n = min(mini_batch, len(lengths) - start)
        groups = (token_groups(lengths[start:start + n], budget) if budget
                  else [list(range(i, min(i + rows, n))) for i in range(0, n, rows)])
        out.append([[start + i for i in g] for g in groups])
    return out


SLIDING_LAYER_TYPES = ("sliding_attention",)  # transformers' name, in `config.layer_types`, for a windowed layer


def sliding_window(config: Any) -> Optional[int]:
    """The sliding attention window of a Hugging Face model config (how many tokens a query sees, itself included), or
    None where no layer slides: `sliding_window` when it is set, but not where Qwen2's `use_sliding_window` is false,
    nor where `layer_types` is given and names no sliding layer (Qwen2 past `max_window_layers`). A multimodal config
    (Gemma 3) is read at its text config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None
    if getattr(text, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and not any(t in SLIDING_LAYER_TYPES for t in layer_types):
        return None
    return window
