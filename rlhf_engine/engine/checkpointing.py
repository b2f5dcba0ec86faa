"""The engines' part of a checkpoint (see rlhf_engine/outputs/checkpoint.py for the folder layout and the marker).

* Trained roles (actor, critic): DeepSpeed `save_checkpoint(<checkpoint folder>, tag=<role>, save_latest=False)`, so
  each lands in `<checkpoint folder>/<role>/` with its module, optimizer and LR-scheduler state and step counters
  (per-rank ZeRO partitions included); loaded with `load_checkpoint(<checkpoint folder>, tag=<role>)`.
* The EMA role ("ema", when the engine keeps one): an eval-only engine has no optimizer for DeepSpeed to checkpoint,
  so its full weights (ZeRO-3 consolidated) go to `<checkpoint folder>/ema/model.pt` from rank 0, and are loaded
  back into every rank (under ZeRO-3 through `GatheredParameters(modifier_rank=0)`, which re-partitions them).
* The reference and reward models are frozen and never saved: a resumed run builds them from their paths again.
* Another world size (`load_engines(..., universal=True)`): a ZeRO-partitioned optimizer state (stages 1-3, and the
  bf16 optimizer of stage 0) is converted once by DeepSpeed's own `ds_to_universal` into
  `<checkpoint folder>/universal/<role>/` (rank 0; a `.done` file marks a finished conversion) and loaded as a
  universal checkpoint, which re-partitions it for the new ranks. The other ranks wait for the conversion on a gloo
  group of its own, with a timeout of hours (`comm.run_on_main`: it may outlast the collective timeout);
  `convert_checkpoint` (launch/convert_checkpoint.py) does it ahead of the resume, offline. Stage 0 with an
  unpartitioned optimizer (fp32, or the unfused fp16/bf16 optimizer with its fp32 master weights) keeps the whole
  state in one file and loads as it is.

Every function is collective (call it on all ranks), except the offline `partitioned_roles` and `convert_checkpoint`.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..comm import barrier, rank, run_on_main
from ..config import TRAINED_ROLES

WEIGHTS_ONLY = ("ema",)
EMA_FILE = "model.pt"
UNIVERSAL_DIR = "universal"


def checkpoint_roles(engine: Any) -> list[str]:
    """The roles of an RLHFEngine a checkpoint holds: the trained ones, then the EMA when there is one."""
    return [r for r in TRAINED_ROLES + WEIGHTS_ONLY if r in engine.engines]


def _is_zero3(ds_engine: Any) -> bool:
    fn = getattr(ds_engine, "zero_optimization_partition_weights", None)
    return bool(fn()) if callable(fn) else False


def save_trained(ds_engine: Any, ckpt_dir: str, tag: str) -> None:
    """A trained engine's module, optimizer, LR scheduler and counters into `<ckpt_dir>/<tag>/` (no 'latest' file)."""
    ds_engine.save_checkpoint(ckpt_dir, tag=tag, save_latest=False)


def needs_universal(ds_engine: Any) -> bool:
    """Whether the engine's optimizer state is partitioned over the ranks (so another world size needs a
    conversion): ZeRO 1-3, or DeepSpeed's BF16_Optimizer (which partitions its fp32 master weights at stage 0; the
    unfused fp16/bf16 optimizer DeepSpeed picks for a torch optimizer keeps them whole)."""
    return ds_engine.zero_optimization_stage() > 0 or type(ds_engine.optimizer).__name__ == "BF16_Optimizer"


def partitioned_roles(ckpt_dir: str) -> list[str]:
    """The role folders of a checkpoint whose optimizer state is partitioned over the ranks (ZeRO 1-3 or DeepSpeed's
    BF16_Optimizer: `*zero_pp_rank_*_optim_states.pt` files), read from the files alone: what a resume on another
    world size must convert."""
    out = []
    for name in sorted(os.listdir(ckpt_dir)):
        folder = os.path.join(ckpt_dir, name)
        if name != UNIVERSAL_DIR and os.path.isdir(folder) and any(
                "zero_pp_rank_" in f and f.endswith("optim_states.pt") for f in os.listdir(folder)):
            out.append(name)
    return out


def _convert(ckpt_dir: str, tag: str) -> None:
    """`<ckpt_dir>/<tag>/` -> `<ckpt_dir>/universal/<tag>/` with DeepSpeed's ds_to_universal, unless done before;
    `<tag>.done` marks a finished conversion (a cut one leaves only `<tag>.tmp`, redone next time). One process."""
    import argparse
    import shutil

    root = os.path.join(ckpt_dir, UNIVERSAL_DIR)
    out = os.path.join(root, tag)
    if os.path.exists(out + ".done"):
        return
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    # inject_missing_state: our checkpoints carry no Megatron-style universal_checkpoint_info
    ds_to_universal(argparse.Namespace(input_folder=os.path.join(ckpt_dir, tag), output_folder=tmp,
                                       num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                       strict=True, inject_missing_state=True))
    os.replace(tmp, out)
    open(out + ".done", "w").close()


def convert_checkpoint(ckpt_dir: str) -> list[str]:
    """Convert every partitioned role of a checkpoint folder ahead of a resume on another world size (the offline
    command `launch/convert_checkpoint.py`); returns the roles. A resume then finds them done and waits for
    nothing."""
    roles = partitioned_roles(ckpt_dir)
    for role in roles:
        _convert(ckpt_dir, role)
    return roles


def convert_to_universal(ckpt_dir: str, tag: str) -> str:
    """`<ckpt_dir>/<tag>/` -> `<ckpt_dir>/universal/<tag>/` once, by rank 0; returns `<ckpt_dir>/universal`.
    Collective: the other ranks wait on a group of their own (`comm.run_on_main`), since a large ZeRO-3 checkpoint
    converts for longer than the collective timeout."""
    run_on_main(lambda: _convert(ckpt_dir, tag),
                f"convert {os.path.join(ckpt_dir, tag)} to a universal checkpoint")
    return os.path.join(ckpt_dir, UNIVERSAL_DIR)


def load_trained(ds_engine: Any, ckpt_dir: str, tag: str, universal: bool = False) -> None:
    """The reverse of `save_trained`; a missing `<ckpt_dir>/<tag>/` is an error. `universal`: the checkpoint was
    written by another number of ranks (module docstring)."""
    load_dir = ckpt_dir
    if universal and needs_universal(ds_engine):
        load_dir = convert_to_universal(ckpt_dir, tag)
        # DeepSpeed reads this setting when loading only (its "checkpoint.load_universal" config key)
        ds_engine._config.load_universal_checkpoint = True
    try:
        path, _ = ds_engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                            load_lr_scheduler_states=True)
    finally:
        ds_engine._config.load_universal_checkpoint = False
    if path is None:
        raise FileNotFoundError(f"no {tag} checkpoint in {ckpt_dir} (expected {ckpt_dir}/{tag}/)")


def save_engines(engine: Any, ckpt_dir: str) -> list[str]:
    """Save every checkpointed role of `engine` (an RLHFEngine) under `ckpt_dir`; returns the roles."""
    roles = checkpoint_roles(engine)
    for role in roles:
        ds = engine.engines[role]
        if role in TRAINED_ROLES:
            save_trained(ds, ckpt_dir, role)
        else:
            save_weights(ds, os.path.join(ckpt_dir, role))
    return roles


def load_engines(engine: Any, ckpt_dir: str, roles: list[str] | None = None, universal: bool = False) -> list[str]:
    """Load the checkpointed roles of `engine` from `ckpt_dir` (module, optimizer, LR scheduler and step counters of
    the trained roles; weights of the EMA). A role missing from the checkpoint is an error. `universal`: written by
    another number of ranks."""
    roles = checkpoint_roles(engine) if roles is None else roles
    for role in roles:
        ds = engine.engines[role]
        if role in TRAINED_ROLES:
            load_trained(ds, ckpt_dir, role, universal=universal)
        else:
            load_weights(ds, os.path.join(ckpt_dir, role))
    return roles


def save_weights(ds_engine: Any, out_dir: str) -> None:
    """The engine's full weights (ZeRO-3 consolidated, dtype kept) to `<out_dir>/model.pt` from rank 0."""
    if _is_zero3(ds_engine):
        sd = ds_engine._zero3_consolidated_16bit_state_dict()  # dtype of the parameters, despite the name
    else:
        sd = ds_engine.module.state_dict()

    def write() -> None:
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, EMA_FILE + ".tmp")
        torch.save({k: v.detach().cpu().clone() for k, v in sd.items()}, tmp)
        os.replace(tmp, os.path.join(out_dir, EMA_FILE))

    run_on_main(write, f"write {os.path.join(out_dir, EMA_FILE)}")


def load_weights(ds_engine: Any, in_dir: str) -> None:
    """Load `<in_dir>/model.pt` (written by `save_weights`) into the engine on every rank."""
    path = os.path.join(in_dir, EMA_FILE)
    module = ds_engine.module
    if _is_zero3(ds_engine):
        import deepspeed

        sd = torch.load(path, map_location="cpu", weights_only=True) if rank() == 0 else None
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            if rank() == 0:
                module.load_state_dict(sd)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
        module.load_state_dict(sd)
    barrier()
