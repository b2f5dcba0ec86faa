"""Per-iteration metric accumulators shared by the PPO, SFT and reward-model loops."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm import all_reduce


@dataclass
class MetricSums:
    """Token- or sample-weighted sums for one iteration, all-reduced once at the end (no host sync in the loop)."""

    device: torch.device = torch.device("cpu")
    sums: dict = field(default_factory=dict)
    maxes: dict = field(default_factory=dict)
    mins: dict = field(default_factory=dict)

    def add(self, key: str, value: torch.Tensor) -> None:
        v = torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(())
        self.sums[key] = self.sums[key] + v if key in self.sums else v

    def max(self, key: str, value: torch.Tensor) -> None:
        v = torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(())
        self.maxes[key] = torch.maximum(self.maxes[key], v) if key in self.maxes else v

    def min(self, key: str, value: torch.Tensor) -> None:
        v = torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(())
        self.mins[key] = torch.minimum(self.mins[key], v) if key in self.mins else v

    def reduce(self) -> dict[str, float]:
        out = {}
        for table, op in ((self.sums, "sum"), (self.maxes, "max"), (self.mins, "min")):
            if table:
                keys = sorted(table)
                vals = all_reduce(torch.stack([table[k] for k in keys]), op).tolist()
                out.update(zip(keys, vals))
        return out
