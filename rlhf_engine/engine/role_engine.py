"""One model as one DeepSpeed engine: the pieces PPO (`RLHFEngine`, four roles) and the SFT / reward-model trainers
(one model each) share, so the three entry points build, score, step and export models the same way.

* `build_role_engine`: DeepSpeed config (`build_ds_config`) + model loading (`load_causal_lm` / `load_scalar_model`,
  dropout off, ZeRO-3 construction) + `deepspeed.initialize` (with the LR schedule when trained; eval mode and frozen
  parameters when not).
* `sequence_scores`: a scalar-head model's score of each sequence, read at the last real token
  (`Rollout.score_index` = `rollout.last_token_index`). The PPO scorer (`RLHFEngine.reward_scores`) and the reward-model
  trainer both call it, so the reward model is trained on exactly the position PPO reads.
* `backward_global`: backward of a loss normalised by a GLOBAL count (tokens or pairs of the whole mini-batch on all
  ranks): DeepSpeed averages gradients over ranks and divides by the accumulation steps; this undoes both.
* `full_state_dict` / `export_engine`: the full (ZeRO-3 consolidated) weights, and a plain Hugging Face folder.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from ..comm import run_on_main
from ..config import RoleConfig
from ..rollout import Rollout, gather_at
from .ds_config import _merge, build_ds_config, load_json, torch_dtype
from .cpu_matmul import fp32_kernel_layers
from .freezing import freeze_below_top
from .models import add_lora, load_causal_lm, load_scalar_model, merged_copy, peft_model_of

KINDS = ("causal_lm", "scalar")


def scheduler_factory(name: str, warmup: int, total: int):
    """A DeepSpeed `lr_scheduler` callable: transformers' `get_scheduler(name)` over `total` optimizer steps."""
    from transformers import get_scheduler

    def make(optimizer):
        return get_scheduler(name, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=max(total, 1))

    return make


def build_role_engine(role_cfg: RoleConfig, path: str, *, kind: str, stage: int, dtype: str, train: bool, batch: Any,
                      world_size: int, eval_micro_batch_size: int, num_training_steps: int,
                      pad_token_id: Optional[int] = None, ds_overrides: Optional[dict] = None,
                      matmul: str = "native") -> tuple[Any, dict]:
    """One model as a DeepSpeed engine -> (engine, its DeepSpeed config).

    kind "causal_lm" loads an `AutoModelForCausalLM`; "scalar" a `ScalarHeadModel` (a `*ForSequenceClassification`
    folder, or a causal LM folder that gets a new one-label head: seed torch first). `batch` needs
    `per_device_training_batch_size`, `gradient_accumulation_steps` and `mini_batch_size` (a `BatchConfig` or a
    `SupervisedConfig`). Trained engines get AdamW and the role's LR schedule over `num_training_steps`; eval-only
    engines (stage 0 or 3) get frozen parameters and eval mode.

    `role_cfg.lora_dim > 0` (trained roles): the model gets a peft LoRA adapter (`models.add_lora`) and only the
    adapter (and a scalar model's head) is handed to the optimizer. `ds_overrides` (e.g. a `hybrid_engine` section)
    is merged into the built DeepSpeed config before the role's own ds_config file (which wins). `matmul` "fp32"
    (`RolePlan.matmul`, bf16 on a CPU without bf16 instructions): every Linear layer, the adapter's included, multiplies
    in the fp32 kernel (`cpu_matmul.fp32_kernel_layers`).
    """
    import deepspeed

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if role_cfg.lora_dim and not train:
        raise ValueError("LoRA (lora_dim > 0) is for trained roles; an eval-only engine takes no adapter")
    user = load_json(role_cfg.ds_config) if role_cfg.ds_config else None
    if ds_overrides:
        user = _merge(ds_overrides, user or {})
    ds_cfg = build_ds_config(role_cfg, stage=stage, dtype=dtype, train=train, batch=batch, world_size=world_size,
                             eval_micro_batch_size=eval_micro_batch_size, user_config=user)
    checkpointing = role_cfg.gradient_checkpointing and train
    if kind == "causal_lm":
        model = load_causal_lm(path, torch_dtype(dtype), ds_cfg, checkpointing, role_cfg.attn_implementation)
    else:
        model = load_scalar_model(path, torch_dtype(dtype), ds_cfg, pad_token_id, checkpointing,
                                  role_cfg.attn_implementation)
    if train and role_cfg.trainable_layers:
        freeze_below_top(model, role_cfg.trainable_layers)
    if train and role_cfg.lora_dim:
        model = add_lora(model, role_cfg, checkpointing)
    if matmul == "fp32":
        fp32_kernel_layers(model)
    if train:
        sched = scheduler_factory(role_cfg.lr_scheduler_type, role_cfg.num_warmup_steps, num_training_steps)
        engine, *_ = deepspeed.initialize(model=model, config=ds_cfg, lr_scheduler=sched,
                                          model_parameters=[q for q in model.parameters() if q.requires_grad])
    else:
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
        engine.eval()
    return engine, ds_cfg


def rollout_inputs(rollout: Rollout, use_position_ids: bool = True) -> dict:
    """The forward arguments of a rollout-layout batch (position ids always, except for the trlx-bug test hook)."""
    return dict(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                position_ids=rollout.position_ids if use_position_ids else None)


def sequence_scores(engine: Any, rollout: Rollout, use_position_ids: bool = True) -> torch.Tensor:
    """[B] fp32 score of each sequence of a `ScalarHeadModel` engine, read at its last real token (EOS included).

    The one scoring function of the project: PPO's reward scores and the reward-model trainer's scores (training and
    evaluation) both come from here. Runs with or without grad, in whatever mode the engine is in.
    """
    return gather_at(engine(**rollout_inputs(rollout, use_position_ids)), rollout.score_index())


def backward_global(engine: Any, loss: torch.Tensor, world_size: int) -> None:
    """Backward of a loss share normalised by the mini-batch's GLOBAL count (all ranks, all micro-batches).

    DeepSpeed averages gradients over ranks (x 1/world) and divides by the accumulation steps; the loss is scaled by
    the world size and the accumulation scaling is turned off, so the gradients SUM the shares: 1 rank or N, and any
    micro-batch split, give the same update.
    """
    engine.backward(loss * world_size, scale_wrt_gas=False)


def full_state_dict(engine: Any, stage: int, is_main: bool) -> Optional[dict]:
    """The engine's full (ZeRO-3 consolidated) state dict on the main rank, None elsewhere. Collective: call on all
    ranks."""
    if stage == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
    else:
        sd = engine.module.state_dict()
    return {k: v.detach().cpu().clone() for k, v in sd.items()} if is_main and sd else None


def export_engine(engine: Any, stage: int, out_dir: str, tokenizer: Any, is_main: bool) -> None:
    """Write the engine's model as a plain Hugging Face folder (weights + config + tokenizer) that reloads with
    `from_pretrained`: a causal LM, or a `*ForSequenceClassification` for a `ScalarHeadModel`. Collective.

    A model with a LoRA adapter is exported merged (`models.merged_copy`: the consolidated weights loaded into a
    fresh CPU copy, then peft's `merge_and_unload`): a plain model, no peft needed to load it."""
    sd = full_state_dict(engine, stage, is_main)

    def write() -> None:  # rank 0 alone, for as long as a large model takes: the others wait off the default group
        os.makedirs(out_dir, exist_ok=True)
        if peft_model_of(engine.module) is not None:
            merged_copy(engine.module, sd).save_pretrained(out_dir)
        else:
            engine.module.save_pretrained(out_dir, state_dict=sd)
        tokenizer.save_pretrained(out_dir)

    run_on_main(write, f"export {out_dir}")
