"""ZeRO-3 helpers: gather-once generation, the generation replica and the EMA update.

* `gathered_for_generation`: every partitioned parameter of a module gathered ONCE for a whole `generate` call and
  kept resident until it returns. A plain `deepspeed.zero.GatheredParameters` is not enough: ZeRO-3's post-forward
  hooks release ("re-partition") any available parameter whose module has finished, so the next token would fetch
  every layer again. Each parameter is therefore also marked as in use by a sentinel sub-module id for the duration
  (the coordinator releases only parameters whose `ds_active_sub_modules` is empty); the hooks then find every
  parameter available and issue no collective at all, so ranks may even stop generating at different times.
* `GenerationReplica`: a plain (unpartitioned, hook-free) copy of a ZeRO-3 module that generation runs on. Built once
  on the meta device; before every generate call its weights are allocated as one buffer and filled from the
  partitions a few parameters at a time, and after the call the buffer is dropped: one copy of the weights exists
  only while generating. Decoding on it runs no ZeRO-3 hook and no collective (measured x3.8 generation against
  per-layer fetching, bench/README).
* `ema_update_`: ema = decay * ema + (1 - decay) * actor, parameter by parameter; under ZeRO-3 on both sides each rank
  updates its own partition from the actor's same partition (no communication).
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch import nn

from .cpu_matmul import fp32_kernel_layers, has_fp32_kernel_layers

# Never a real module id (DeepSpeed numbers modules from 0): marks a parameter as "in use" while generate runs.
_GENERATION_SENTINEL = -7_000_001


def is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def full_param_bytes(module: nn.Module) -> int:
    """Bytes of the module's full (unpartitioned) weights."""
    return sum((p.ds_numel if is_zero3_param(p) else p.numel()) * p.element_size() for p in module.parameters())


def _not_available(params: Iterable[torch.Tensor]) -> list:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in params if is_zero3_param(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


@contextlib.contextmanager
def gathered_for_generation(module: nn.Module):
    """Gather every partitioned parameter of `module` once (one coalesced all-gather) and keep it resident until the
    block ends; then re-partition. Collective on entry (every rank must enter). Inside, forwards issue no
    collective. Parameters already resident (ZeRO-3 "persistent" small ones) are left as they are."""
    import deepspeed

    params = list(module.parameters())
    todo = _not_available(params)
    with deepspeed.zero.GatheredParameters(todo, enabled=bool(todo)):
        marked = [p for p in params if is_zero3_param(p)]
        for p in marked:
            p.ds_active_sub_modules.add(_GENERATION_SENTINEL)
        try:
            yield
        finally:
            for p in marked:
                p.ds_active_sub_modules.discard(_GENERATION_SENTINEL)


class GenerationReplica:
    """A hook-free copy of the ZeRO-3 Hugging Face model `source` (same class and config, the source's dtype) whose
    weights exist only while generating: `refresh` allocates them as ONE flat buffer (parameters are views into it)
    and fills it from the partitions; `release` drops the buffer. One allocation of that size is handed back to the
    operating system (a large block, mmap-ed by the C allocator) or to PyTorch's cache on a GPU, so the training
    phase that follows gets the memory back: the replica costs no memory between generate calls."""

    CHUNK_BYTES = 256 * 2**20  # full-size bytes gathered at once while refreshing

    def __init__(self, source: nn.Module, device: torch.device):
        self.dtype, self.device = next(source.parameters()).dtype, device
        with torch.device("meta"):
            replica = type(source)(source.config)  # a direct constructor call: no zero.Init (only from_pretrained)
        replica = replica.to(self.dtype)
        if has_fp32_kernel_layers(source):  # decode in the kernels of the actor's own forwards (cpu_bf16_matmul)
            fp32_kernel_layers(replica)
        if hasattr(replica, "tie_weights"):  # one Parameter for tied embeddings, listed once below
            replica.tie_weights()
        modules = dict(replica.named_modules())
        for name, buf in source.named_buffers():  # buffers are never partitioned (rotary tables, position ids): kept
            owner, _, leaf = name.rpartition(".")
            modules[owner]._buffers[leaf] = buf.detach().to(device).clone()
        self.meta = dict(replica.named_parameters())  # unique parameters (tied ones once), on the meta device
        missing = set(dict(source.named_parameters())) ^ set(self.meta)
        if missing:
            raise RuntimeError(f"generation replica: parameter names differ from the model's: {sorted(missing)[:5]}")
        name_of = {id(p): n for n, p in self.meta.items()}
        self.owners: dict[str, list] = {n: [] for n in self.meta}  # every (module, attribute) holding a parameter
        for mod in replica.modules():
            for leaf, q in mod._parameters.items():
                if q is not None:
                    self.owners[name_of[id(q)]].append((mod, leaf))
        self.numel = sum(p.numel() for p in self.meta.values())
        self.module = replica.eval().requires_grad_(False)
        self.params: dict[str, nn.Parameter] = {}
        self._flat = None

    @property
    def resident(self) -> bool:
        """Whether the weights are allocated (between `refresh` and `release`)."""
        return self._flat is not None

    def _install(self, params: dict) -> None:
        for n, q in params.items():
            for mod, leaf in self.owners[n]:
                mod._parameters[leaf] = q

    def release(self) -> None:
        """Drop the weights: the module holds its meta (storage-free) parameters again, and its buffers."""
        self._install(self.meta)
        self.params, self._flat = {}, None

    @torch.no_grad()
    def refresh(self, source: nn.Module) -> nn.Module:
        """Allocate the weights and copy the source's current ones in (collective: every rank must call it); returns
        the replica. Call `release` when generation is done."""
        import deepspeed

        if self._flat is None:
            self._flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            offset = 0
            for n, m in self.meta.items():
                view = self._flat[offset:offset + m.numel()].view(m.shape)
                self.params[n] = nn.Parameter(view, requires_grad=False)
                offset += m.numel()
            self._install(self.params)
        mine = self.params
        chunk, size = [], 0
        named = list(source.named_parameters())
        for i, (name, p) in enumerate(named):
            chunk.append((name, p))
            size += (p.ds_numel if is_zero3_param(p) else p.numel()) * p.element_size()
            if size >= self.CHUNK_BYTES or i == len(named) - 1:
                todo = _not_available([q for _, q in chunk])
                with deepspeed.zero.GatheredParameters(todo, enabled=bool(todo)):
                    for n, q in chunk:
                        mine[n].copy_(q.data)
                chunk, size = [], 0
        return self.module


@torch.no_grad()
def _lerp_(dst: torch.Tensor, src: torch.Tensor, decay: float) -> None:
    """dst <- decay * dst + (1 - decay) * src, computed in fp32."""
    src = src.to(device=dst.device, dtype=torch.float32)
    dst.copy_(torch.lerp(src, dst.float(), decay))


@torch.no_grad()
def ema_update_(ema: nn.Module, actor: nn.Module, decay: float) -> dict:
    """One EMA step over the parameters of `ema` (same names as `actor`'s). Returns counts per path taken.

    * both ZeRO-3 with equal partitions (the normal case: one world group, same parameter shapes): each rank lerps
      its partition (`ds_tensor`) from the actor's same partition; a parameter the EMA keeps resident (ZeRO-3
      "persistent") is also updated in full, from the actor's full copy (gathered if the actor does not keep it).
    * other ZeRO-3 combinations: the actor parameter is gathered and / or the EMA parameter gathered with rank 0 as
      the modifier (every rank computes the same value; rank 0's is kept).
    * no ZeRO-3: plain tensors.
    """
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    actor_params = dict(actor.named_parameters())
    counts = {"partition": 0, "gathered": 0, "plain": 0}
    for name, e in ema.named_parameters():
        a = actor_params.get(name)
        if a is None:
            raise RuntimeError(f"EMA parameter {name} has no counterpart in the actor")
        e3, a3 = is_zero3_param(e), is_zero3_param(a)
        if e3 and a3 and e.ds_numel == a.ds_numel and e.ds_tensor.shape == a.ds_tensor.shape:
            _lerp_(e.ds_tensor, a.ds_tensor, decay)
            if e.ds_status == ZeroParamStatus.AVAILABLE:  # resident full copy: keep it equal to the partitions
                if a.ds_status == ZeroParamStatus.AVAILABLE:
                    _lerp_(e.data, a.data, decay)
                else:
                    with deepspeed.zero.GatheredParameters([a]):
                        _lerp_(e.data, a.data, decay)
            counts["partition"] += 1
        elif e3 or a3:
            gather_a = deepspeed.zero.GatheredParameters(_not_available([a]), enabled=a3 and bool(_not_available([a])))
            gather_e = deepspeed.zero.GatheredParameters([e], modifier_rank=0, enabled=e3)
            with gather_a, gather_e:
                _lerp_(e.data, a.data, decay)
            counts["gathered"] += 1
        else:
            _lerp_(e.data, a.data, decay)
            counts["plain"] += 1
    return counts

