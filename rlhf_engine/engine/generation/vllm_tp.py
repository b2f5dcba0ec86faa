"""Tensor parallelism of the colocated vLLM engine (`--vllm_tensor_parallel_size T`, TRL's colocate mode with T > 1):
the trainer's ranks form groups of T consecutive ranks (vLLM's own layout under an external launcher: its
tensor-parallel groups are ranks [k T, (k + 1) T)), and each group runs one engine, every member holding 1/T of it.

    group = TensorParallelGroup(T)                 # collective: every rank builds every group
    merged = group.merge(prompts, limits, seeds)   # every member's requests, in member order (one all_gather_object)
    rows = group.own(answers)                      # this member's answers, in its own order

* Every member of a group must hand the engine the same requests in the same calls (each forward all-reduces across
  the group), so each call gathers the group's requests, every member generates all of them, and each keeps its own
  slice. Every request keeps the seed its own rank drew, so a group samples what its ranks would have sampled alone.
* The generate calls are collective (`VLLMBackend.collective_calls`): every rank makes the same calls, as under
  ZeRO-3, so that no group waits in a forward for a member that stopped calling.
* Weights: every member streams the actor's full tensors; vLLM's weight loaders keep each member's shard.
* Memory: a member holds 1/T of the engine's weights and of its KV heads (`kv_bytes_per_token`); the group serves T
  ranks' rows at once.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ... import comm


def group_members(rank: int, size: int) -> list[int]:
    """The ranks of `rank`'s group of `size` consecutive ranks."""
    first = rank - rank % size
    return list(range(first, first + size))


def merge(per_member: list) -> tuple[list, list, list, list]:
    """Every member's (prompts, limits, seeds), in member order, as one request list: (prompts, limits, seeds, each
    member's row count)."""
    prompts, limits, seeds, counts = [], [], [], []
    for p, lim, s in per_member:
        if not len(p) == len(lim) == len(s):
            raise ValueError(f"a member's requests disagree in length: {len(p)} prompts, {len(lim)} limits, "
                             f"{len(s)} seeds")
        prompts += list(p)
        limits += list(lim)
        seeds += list(s)
        counts.append(len(p))
    return prompts, limits, seeds, counts


def own_slice(rows: list, counts: list, position: int) -> list:
    """The member at `position`'s answers out of `rows` (the engine's, in `merge`'s order)."""
    if len(rows) != sum(counts):
        raise ValueError(f"the engine answered {len(rows)} rows for {sum(counts)} requests")
    start = sum(counts[:position])
    return rows[start:start + counts[position]]


def tp_problems(size: Any, world: int, backend: str, model_config: Any, servers: bool,
                local_world: Optional[int] = None) -> list[tuple[str, Any, str]]:
    """(field, value, fix) for each way `--vllm_tensor_parallel_size` cannot split this run (plan time, before any
    engine): T must divide the world and the ranks of one node, and vLLM must be able to split the actor's attention
    heads T ways; T > 1 applies to the colocated vllm engine only."""
    field = "vllm_tensor_parallel_size"
    if not isinstance(size, int) or size <= 1:
        return []
    if servers:
        return [(field, size, "the rollout servers run their own engines: give vllm serve its --tensor-parallel-size "
                 "and leave this 1")]
    if backend != "vllm":
        return [(field, size, f"applies to generation_backend vllm (this run generates with {backend}); leave it 1")]
    out = []
    if world % size:
        out.append((field, size, f"the engine's groups are {size} consecutive ranks, and {world} ranks do not split "
                    f"into them; use a divisor of {world}"))
    if local_world and local_world % size:
        out.append((field, size, f"a group would span two nodes ({local_world} ranks per node): use a divisor of "
                    f"{local_world}"))
    heads = getattr(model_config, "num_attention_heads", None) or getattr(model_config, "n_head", None)
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and heads % size:
        out.append((field, size, f"vLLM splits the actor's {heads} attention heads evenly over the group; use a "
                    f"divisor of {heads}"))
    elif isinstance(kv, int) and kv % size and size % kv:
        out.append((field, size, f"vLLM splits (or replicates) the actor's {kv} key-value heads over the group; use "
                    f"a divisor or a multiple of {kv}"))
    return out


def local_world_size(environ=None) -> Optional[int]:
    """The ranks on this node, as the launcher says (torchrun and our SLURM setup: LOCAL_WORLD_SIZE; the deepspeed
    launcher: LOCAL_SIZE), or None where none says it."""
    env = os.environ if environ is None else environ
    value = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
    return int(value) if value and value.isdigit() else None


class TensorParallelGroup:
    """This rank's engine group: `index` (which group), `position` (which member), `members` (global ranks)."""

    def __init__(self, size: int):
        self.size = size
        self.group, self.members = comm.consecutive_groups(size)
        self.position = self.members.index(comm.rank())
        self.index = self.members[0] // size
        self._counts: Optional[list] = None

    def merge(self, prompts: list, limits: list, seeds: list) -> tuple[list, list, list]:
        """The group's requests (every member's, in member order); remembers each member's share for `own`.
        Collective over the group."""
        prompts, limits, seeds, self._counts = merge(comm.all_gather_object((prompts, limits, seeds), self.group))
        return prompts, limits, seeds

    def own(self, rows: list) -> list:
        """This member's answers out of the engine's answers to the last `merge`."""
        counts, self._counts = self._counts, None
        if counts is None:
            raise RuntimeError("TensorParallelGroup.own: no merge to answer")
        return own_slice(rows, counts, self.position)
