"""Frozen blocks computed once per rollout: with `actor_trainable_layers k`, the output of the frozen prefix (the
embeddings and every block below the top k) is kept from the experience forward and replayed in the forwards that
follow on the same inputs (every training forward of every epoch, and the reference's where its prefix is the
actor's), instead of being computed again.

    prefix = FrozenPrefix.of(actor_module, k)        # None where nothing is frozen
    with prefix.capturing(inputs):                   # the experience forward: keeps the boundary block's output
        model(**inputs)
    with prefix.replaying(inputs, model):            # a later forward on equal inputs: the prefix is not computed
        model(**inputs)
    prefix.clear()                                   # the rollout's training is over

A replayed forward computes the same function of the same inputs: the prefix's weights never change (requires_grad
off, checked at construction), dropout is 0 in every model the engine builds (`models.no_dropout_config`), and an
entry is used only for inputs equal, tensor by tensor, to those it was captured with (or to consecutive rows of them:
a training micro-batch inside a larger experience chunk, whose rows' outputs are sliced); any other forward (a
packing that differs, a ptx batch) computes the whole model as before. Replaying swaps, for the duration of one
forward, the skipped blocks' `forward` for a pass-through and the boundary block's for the kept output.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from .freezing import transformer_blocks


@dataclass
class _Entry:
    inputs: dict  # the model inputs the output was captured for (tensors)
    output: Any  # the boundary block's output (a tensor, or a tuple whose first item is the hidden states)


def _same_inputs(a: Mapping, b: Mapping) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


class FrozenPrefix:
    """The frozen prefix of one model (its `blocks` below the top `k`, all parameters outside the top blocks that
    come before them frozen) and the outputs kept for it."""

    def __init__(self, model: nn.Module, k: int):
        blocks = list(transformer_blocks(model))
        if not 0 < k < len(blocks):
            raise ValueError(f"a frozen prefix needs 0 < k < {len(blocks)} blocks, got k = {k}")
        self.skipped, self.boundary = blocks[:-k - 1], blocks[-k - 1]
        trainable = [n for b in blocks[:-k] for n, p in b.named_parameters() if p.requires_grad]
        if trainable:
            raise ValueError(f"the blocks below the top {k} are not frozen (e.g. {trainable[0]} requires grad)")
        self.entries: list[_Entry] = []
        self.hits = self.misses = 0

    @classmethod
    def of(cls, model: nn.Module, k: int) -> Optional["FrozenPrefix"]:
        """The prefix of `model` with its top `k` blocks trained, or None where it has none (k <= 0: every block
        trains) or a block below them trains (a LoRA adapter, for one)."""
        if k <= 0:
            return None
        try:
            return cls(model, k)
        except ValueError:
            return None

    @property
    def nbytes(self) -> int:
        """Bytes held by the kept outputs."""
        return sum(_hidden(e.output).numel() * _hidden(e.output).element_size() for e in self.entries)

    def clear(self) -> None:
        self.entries = []

    def lookup(self, inputs: Mapping) -> Optional[_Entry]:
        """The kept output for `inputs`: an entry captured for equal inputs, or for a batch whose consecutive rows
        o..o+n equal them (a training micro-batch inside a larger experience chunk), those rows of its output."""
        exact = next((e for e in self.entries if _same_inputs(e.inputs, inputs)), None)
        if exact is not None:
            return exact
        for e in self.entries:
            part = self._rows_of(e, inputs)
            if part is not None:
                return part
        return None

    @staticmethod
    def _rows_of(e: _Entry, inputs: Mapping) -> Optional[_Entry]:
        """`e`'s consecutive rows that equal `inputs` (every input a [B, ...] tensor), as an entry of their own."""
        if isinstance(e.output, tuple) or e.inputs.keys() != inputs.keys():
            return None  # a tuple's other items may not be per row: only tensors are sliced
        tensors = [(e.inputs[k], v) for k, v in inputs.items()]
        if not all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and
                   a.dim() >= 1 and a.shape[1:] == b.shape[1:] and a.shape[0] > b.shape[0] for a, b in tensors):
            return None
        n = tensors[0][1].shape[0]
        for o in range(tensors[0][0].shape[0] - n + 1):
            if all(torch.equal(a[o:o + n], b) for a, b in tensors):
                return _Entry(dict(inputs), e.output[o:o + n])
        return None

    @contextlib.contextmanager
    def capturing(self, inputs: Mapping) -> Iterator[None]:
        """Keep the boundary block's output of the forward run inside, for `inputs` (detached: nothing of the
        prefix is trained)."""
        def keep(_module, _args, output):
            out = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in output) \
                if isinstance(output, tuple) else output.detach()
            self.entries.append(_Entry(dict(inputs), out))

        handle = self.boundary.register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def replaying(self, entry: _Entry, blocks: Optional[list] = None) -> Iterator[None]:
        """The forward run inside skips the prefix and starts from `entry`'s output. `blocks`: the prefix of another
        model with the same blocks and weights (the reference's, `same_prefix` checked), else this model's."""
        skipped, boundary = (self.skipped, self.boundary) if blocks is None else (blocks[:-1], blocks[-1])
        tuple_out = isinstance(entry.output, tuple)

        def through(*args, **kwargs):  # the block's output is never read: the boundary returns the kept one
            hidden = args[0] if args else kwargs["hidden_states"]
            return (hidden,) if tuple_out else hidden

        for b in skipped:
            b.forward = through
        boundary.forward = lambda *a, **k: entry.output
        try:
            yield
        finally:
            for b in [*skipped, boundary]:
                del b.forward  # the class's forward again

    def blocks_of(self, model: nn.Module) -> list:
        """The blocks of `model` at this prefix's positions (skipped and boundary)."""
        return list(transformer_blocks(model))[: len(self.skipped) + 1]


def same_prefix(actor: nn.Module, other: nn.Module) -> bool:
    """Whether `other` computes the actor's frozen prefix: every parameter the actor does not train, and every
    buffer, present in `other` by name and equal. Frozen, they never change, so one check at start (the reference is
    the initial actor) holds for the run."""
    theirs = dict([*other.named_parameters(), *other.named_buffers()])
    mine = [(n, t) for n, t in actor.named_parameters() if not t.requires_grad] + list(actor.named_buffers())
    return all(n in theirs and theirs[n].shape == t.shape and torch.equal(theirs[n], t) for n, t in mine)
