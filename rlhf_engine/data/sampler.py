"""The order in which a run reads its rows, and where it stands in that order.

`PromptSampler` is the deterministic sharded order over a dataset (prompts, SFT rows, preference pairs, ptx
documents); `DataCursor` iterates it and is the checkpoint state provider of a data position, so a resumed run draws
exactly the batch the interrupted one would have drawn.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from ..errors import ConfigError, Problem

log = logging.getLogger(__name__)


class PromptSampler:
    """Deterministic sharded order over `num_prompts` prompts.

    Epoch e is a permutation of range(num_prompts) drawn from `torch.Generator().manual_seed(seed + e)`: identical on
    every rank, it depends on seed and epoch only. A global batch is batch_size * world_size prompts; rank r of global
    batch k gets perm[k*G + r*batch_size : k*G + (r+1)*batch_size]. With drop_last (the default) the short last batch
    is dropped, and counted: `dropped_per_epoch` prompts per epoch are not seen in that epoch (another epoch's
    permutation puts them elsewhere). With drop_last=False the short last batch is filled from the start of the same
    permutation, so a few prompts repeat in that epoch.

    `batch_field` names the setting behind `batch_size` in the error raised when one global batch cannot be filled
    (PPO: the generation batch; SFT / reward model: the training mini-batch).
    """

    def __init__(self, num_prompts: int, batch_size: int, rank: int, world_size: int, seed: int,
                 drop_last: bool = True, batch_field: str = "per_device_generation_batch_size"):
        if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size > 0 and 0 <= rank < world_size; got batch_size={batch_size}, "
                             f"rank={rank}, world_size={world_size}")
        G = batch_size * world_size
        if num_prompts < G:
            fit = num_prompts // world_size
            hint = f"lower it to {fit} or below, or add prompts" if fit else "add prompts"
            raise ConfigError([Problem(batch_field, batch_size,
                                        f"{num_prompts} prompts cannot fill one global batch of {batch_size} x "
                                        f"{world_size} ranks = {G} prompts; {hint}")], "not enough prompts")
        self.num_prompts, self.batch_size, self.rank, self.world_size = num_prompts, batch_size, rank, world_size
        self.seed, self.drop_last, self.global_batch_size = seed, drop_last, G
        self.dropped_per_epoch = num_prompts % G if drop_last else 0
        self._cache: tuple[int, list[int]] | None = None  # (epoch, permutation): recomputed once per epoch

    @property
    def batches_per_epoch(self) -> int:
        G = self.global_batch_size
        return self.num_prompts // G if self.drop_last else -(-self.num_prompts // G)

    def permutation(self, epoch: int) -> list[int]:
        if self._cache is None or self._cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_prompts, generator=g).tolist()
            if not self.drop_last:  # num_prompts >= G, so one wrap fills the last batch
                perm += perm[: self.batches_per_epoch * self.global_batch_size - self.num_prompts]
            self._cache = (epoch, perm)
        return self._cache[1]

    def indices(self, epoch: int, k: int) -> list[int]:
        """This rank's prompt indices in global batch `k` of `epoch`."""
        if not 0 <= k < self.batches_per_epoch:
            raise IndexError(f"batch {k} out of range: an epoch holds {self.batches_per_epoch} batches")
        start = k * self.global_batch_size + self.rank * self.batch_size
        return self.permutation(epoch)[start: start + self.batch_size]

    def iter_from(self, epoch: int = 0, batch: int = 0) -> Iterator[tuple[int, int, list[int]]]:
        """Yield (epoch, k, indices) forever, starting at (epoch, batch): resume a checkpoint from where it stopped."""
        if not 0 <= batch < self.batches_per_epoch:
            raise IndexError(f"batch {batch} out of range: an epoch holds {self.batches_per_epoch} batches")
        while True:
            for k in range(batch, self.batches_per_epoch):
                yield epoch, k, self.indices(epoch, k)
            epoch, batch = epoch + 1, 0




class DataCursor:
    """An iterator over a `PromptSampler` that knows where it is: yields (epoch, k, indices) like
    `sampler.iter_from`, and its state is the position of the NEXT batch, so a resumed run continues with exactly
    the batch the interrupted one would have drawn (mid-epoch too)."""

    strict_on_resume = True  # takes the checkpointer's strict flag (--resume_force remaps the position)

    def __init__(self, sampler: Any, epoch: int = 0, batch: int = 0):
        self.sampler = sampler
        self.consumed = 0
        self._seek(epoch, batch)

    def _seek(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch
        self._it = self.sampler.iter_from(epoch, batch)

    def __iter__(self) -> "DataCursor":
        return self

    def __next__(self) -> tuple[int, int, list]:
        epoch, k, idx = next(self._it)
        self.consumed += 1
        self.epoch, self.batch = (epoch, k + 1) if k + 1 < self.sampler.batches_per_epoch else (epoch + 1, 0)
        return epoch, k, idx

    def state_dict(self) -> dict:
        s = self.sampler
        return {"epoch": self.epoch, "batch": self.batch, "consumed": self.consumed, "num_prompts": s.num_prompts,
                "global_batch_size": s.global_batch_size, "seed": s.seed}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        s = self.sampler
        same = (state["num_prompts"], state["global_batch_size"], state["seed"]) == (
            s.num_prompts, s.global_batch_size, s.seed)
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if not same:
            if strict:
                raise ConfigError([Problem("data", f"{s.num_prompts} prompts, global batch {s.global_batch_size}, "
                                           f"seed {s.seed}", f"the checkpoint's data position is for "
                                           f"{state['num_prompts']} prompts, global batch "
                                           f"{state['global_batch_size']}, seed {state['seed']}")],
                                  "cannot resume the data position")
            # --resume_force: keep the epoch, move to the batch holding the same share of it
            batch = min(s.batches_per_epoch - 1, batch * int(state["global_batch_size"]) // s.global_batch_size)
            log.warning("--resume_force: the data changed; continuing at epoch %d, batch %d of %d", epoch, batch,
                        s.batches_per_epoch)
        self.consumed = int(state.get("consumed", 0))
        self._seek(epoch, batch)
