"""DeepSpeed config per role: built from the JSON templates in ds_configs/ and the role's settings, then validated.

DeepSpeed silently ignores unknown top-level keys (a misspelt "gradient_clippping" just does nothing), so every config
we build or load is checked against the known keys here; nested sections are checked by DeepSpeed's own pydantic
models, which reject unknown fields.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Optional

import torch

from ..config import BatchConfig, RoleConfig
from ..errors import Problems, did_you_mean

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A checkout (or an editable install) reads the top-level ds_configs/; an installed wheel carries a copy inside the
# package (setup.py's build step).
TEMPLATE_DIR = next((d for d in (os.path.join(os.path.dirname(_PACKAGE), "ds_configs"),
                                 os.path.join(_PACKAGE, "ds_configs")) if os.path.isdir(d)),
                    os.path.join(os.path.dirname(_PACKAGE), "ds_configs"))

# Top-level keys DeepSpeed 0.19 reads (from its config parser and documentation).
KNOWN_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print optimizer scheduler
fp16 bf16 amp torch_autocast gradient_clipping prescale_gradients gradient_predivide_factor gradient_allreduce_op
communication_data_type seq_parallel_communication_data_type zero_optimization zero_allow_untested_optimizer
zero_force_ds_cpu_optimizer activation_checkpointing hybrid_engine wall_clock_breakdown memory_breakdown dump_state
flops_profiler tensorboard wandb csv_monitor comet monitor_config comms_logger checkpoint data_types aio
compression_training elasticity autotuning sparse_attention sparse_gradients pipeline data_efficiency curriculum_learning
eigenvalue progressive_layer_drop quantize_training disable_allgather dataloader_drop_last use_data_before_expert_parallelism
nebula timers graph_harvesting compile weight_quantization tensor_parallel disable_python_gc zero_quantized_weights
zero_quantized_gradients zero_quantized_nontrainable_weights vocabulary_size use_node_local_storage
""".split())


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def check_keys(cfg: dict, source: str, p: Problems) -> None:
    """Add a problem for every unknown top-level DeepSpeed key in `cfg` (read from `source`)."""
    for key in cfg:
        if key not in KNOWN_KEYS:
            p.add(f"{source}: {key}", cfg[key], "not a DeepSpeed config key; DeepSpeed would ignore it silently"
                  + did_you_mean(key, KNOWN_KEYS))
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict) and zero:
        known = _zero_keys()
        for key in zero:
            if key not in known:
                p.add(f"{source}: zero_optimization.{key}", zero[key], "not a ZeRO config key; DeepSpeed would "
                      "reject it only when this role's engine is built" + did_you_mean(key, known))


def _zero_keys() -> frozenset:
    """Field names and aliases of DeepSpeed's `zero_optimization` section (its pydantic model forbids others)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    return frozenset(fields) | frozenset(f.alias for f in fields.values() if f.alias)


def load_user_config(path: str, source: str, p: Problems) -> Optional[dict]:
    """A role's DeepSpeed JSON file, checked: a missing file, bad JSON or unknown keys become problems (None then)."""
    try:
        cfg = load_json(path)
    except FileNotFoundError:
        p.add(source, path, "no such file; give the path of a DeepSpeed JSON config (or leave it empty)")
        return None
    except (OSError, ValueError) as e:
        p.add(source, path, f"cannot read it as JSON ({type(e).__name__}: {e})")
        return None
    if not isinstance(cfg, dict):
        p.add(source, path, f"must hold a JSON object, not {type(cfg).__name__}")
        return None
    n = len(p)
    check_keys(cfg, f"{source} ({path})", p)
    return cfg if len(p) == n else None


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def build_ds_config(role: RoleConfig, *, stage: int, dtype: str, train: bool, batch: BatchConfig, world_size: int,
                    eval_micro_batch_size: int, user_config: Optional[dict] = None) -> dict:
    """The DeepSpeed config dict of one role.

    `train=False` gives an eval-only engine (no optimizer; stage must be 0 or 3). On CPU the optimizer is torch's AdamW
    (`torch_adam`): DeepSpeed's fused and cpu_adam ops would be JIT-compiled (about 2 minutes on 2 cores); on GPU
    DeepSpeed's own fused / CPU-offload Adam are kept. `user_config` (a role's ds_config file) is merged last.
    """
    cfg = load_json(os.path.join(TEMPLATE_DIR, "train.json" if train else "eval.json"))
    on_gpu = torch.cuda.is_available()
    zero = cfg["zero_optimization"]
    zero["stage"] = stage
    if train:
        cfg["train_micro_batch_size_per_gpu"] = batch.per_device_training_batch_size
        cfg["gradient_accumulation_steps"] = batch.gradient_accumulation_steps
        cfg["train_batch_size"] = batch.mini_batch_size * world_size
        cfg["gradient_clipping"] = role.gradient_clipping
        params = cfg["optimizer"]["params"]
        params.update(lr=role.learning_rate, betas=[role.adam_beta1, role.adam_beta2], eps=role.adam_eps,
                      weight_decay=role.weight_decay)
        if not on_gpu:
            # torch's AdamW (no C++ op build on CPU), its fused kernel: one pass over the partition instead of the
            # single-tensor loop's seven
            params.update(torch_adam=True, fused=True)
        if role.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
        if role.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    else:
        cfg["train_micro_batch_size_per_gpu"] = eval_micro_batch_size
        cfg["train_batch_size"] = eval_micro_batch_size * world_size
        if role.offload and stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 100, "hysteresis": 2}
    if user_config:
        cfg = _merge(cfg, user_config)
    p = Problems()
    check_keys(cfg, "deepspeed config", p)
    p.raise_if_any("invalid DeepSpeed config")
    return cfg


def torch_dtype(dtype: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def as_jsonable(cfg: dict[str, Any]) -> str:
    return json.dumps(cfg, indent=2, sort_keys=True)
