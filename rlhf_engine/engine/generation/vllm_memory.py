"""The colocated vLLM engine's memory: its KV budget, the `gpu_memory_utilization` it starts with, and whether it fits
beside the trainer's DeepSpeed engines (docs/rollout-engines.md, Memory).

vLLM 0.32's GPU worker takes a snapshot of the device at start-up (after `gc.collect()` and `empty_cache()`) and
refuses to start unless free >= ceil(total x gpu_memory_utilization) (vllm/v1/worker/utils.py `request_memory`, called
by vllm/v1/worker/gpu_worker.py `init_device`), even when `kv_cache_memory_bytes` fixes the KV cache: that size only
skips the profiling later (`determine_available_memory`). Its default (0.92) fails once the trainer's engines hold
more than 8% of the GPU, so the backend passes `startup_utilization`, computed from what is free once the DeepSpeed
engines exist, and the plan refuses a run whose floor cannot fit (`plan_problems`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

GiB = 1 << 30
# What vLLM may allocate between our reading of the free memory and its own snapshot (its process groups' NCCL
# communicators: NCCL's default buffers are 4 MiB per channel and peer, a few hundred MiB for a multi-channel one),
# and what the plan's floor leaves out (activations, CUDA graphs): 1 GiB, 1.25% of an 80 GiB GPU.
STARTUP_MARGIN = 1 << 30
BLOCK_TOKENS = 128  # the KV budget rounds every sequence up to whole blocks of this many tokens (a safe upper bound)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_BYTES = 8  # Adam's two moments, fp32, per trained parameter
MASTER_BYTES = 4  # the fp32 master copy DeepSpeed keeps of bf16 / fp16 weights


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def kv_bytes_per_token(model_config: Any, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of keys and values one token takes in one engine member's cache: 2 x layers x KV heads x head size x
    dtype, the KV heads split over a tensor-parallel group of `tp` (replicated, at least one per member, where the
    group is larger than their number)."""
    heads = getattr(model_config, "num_attention_heads", None) or model_config.n_head
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    hidden = getattr(model_config, "hidden_size", None) or model_config.n_embd
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    layers = getattr(model_config, "num_hidden_layers", None) or model_config.n_layer
    return 2 * layers * max(1, kv_heads // tp) * head_dim * dtype_bytes


def default_kv_cache_bytes(model_config: Any, dtype_bytes: int, rows: int, max_len: int, tp: int = 1) -> int:
    """The KV budget of one engine member: `rows` sequences per rank of `max_len` tokens at once (`tp` ranks' worth
    in a tensor-parallel group), each rounded up to whole blocks plus one, with a quarter more for the scheduler; at
    least 16 MiB. A smaller budget is still correct (the engine schedules fewer sequences at a time), only slower."""
    tokens = rows * tp * (math.ceil(max_len / BLOCK_TOKENS) + 1) * BLOCK_TOKENS
    return max(16 << 20, int(1.25 * tokens * kv_bytes_per_token(model_config, dtype_bytes, tp)))


def kv_budget_bytes(kv_cache_mb: int, model_config: Any, dtype_bytes: int, rows: int, max_len: int,
                    tp: int = 1) -> int:
    """One engine member's KV cache: `--vllm_kv_cache_mb` MiB, or (0) `default_kv_cache_bytes` for one generate
    call's rows of every rank of its group."""
    if kv_cache_mb:
        return kv_cache_mb << 20
    return default_kv_cache_bytes(model_config, dtype_bytes, max(rows, 1), max_len, tp)


def passes_vllm_check(free: int, total: int, utilization: float) -> bool:
    """vLLM 0.32's start-up rule (vllm/v1/worker/utils.py `request_memory`): free >= ceil(total x utilization)."""
    return free >= math.ceil(total * utilization)


def startup_utilization(free: int, total: int, need: int, margin: int = STARTUP_MARGIN) -> float:
    """The `gpu_memory_utilization` to start vLLM with, `free` of `total` bytes free with the trainer's engines
    built: (free - margin) / total, rounded down to 1e-6, so its start-up check passes with `margin` to spare. With
    the KV size given, vLLM uses the value for that check only. ValueError, with the numbers, when `need` (the
    engine's weights and KV cache) does not fit in free - margin."""
    room = free - margin
    if need > room:
        raise ValueError(f"the vLLM engine needs {gib(need)} (its weights and KV cache) and {gib(free)} of "
                         f"{gib(total)} is free on this GPU with the trainer's engines built, less a {gib(margin)} "
                         "margin")
    return (room * 10**6 // total) / 10**6  # integer floor: total x the value never exceeds room


def engine_utilization(override: float, free: int, total: int, need: int, margin: int = STARTUP_MARGIN) -> float:
    """`--vllm_gpu_memory_utilization` when given (> 0: passed as is, vLLM checks it), else `startup_utilization`."""
    return float(override) if override else startup_utilization(free, total, need, margin)


@dataclass(frozen=True)
class RoleMemory:
    """One DeepSpeed engine as the plan sees it: its parameter count, dtype bytes and placement."""

    name: str
    params: int
    dtype_bytes: int
    stage: int
    train: bool
    full_training: bool = True  # every parameter trained (no LoRA, no trainable_layers): Adam states for all
    offload: bool = False  # optimizer states (trained) or parameters (eval-only, ZeRO-3) on the CPU
    offload_params: bool = False  # parameters on the CPU (ZeRO-3)


def resident_bytes(role: RoleMemory, world: int) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) one rank's GPU holds for `role` on `world` ranks, a floor: ZeRO-3
    splits the parameters, ZeRO >= 1 the optimizer states (Adam's two fp32 moments, plus an fp32 master copy of bf16 /
    fp16 weights); offloaded parts count 0; gradients, activations and a LoRA adapter's states are left out."""
    on_cpu = role.offload_params or (role.offload and not role.train)
    params = 0 if on_cpu else math.ceil(role.params * role.dtype_bytes / (world if role.stage == 3 else 1))
    if not role.train or not role.full_training or role.offload:
        return params, 0
    per_param = ADAM_BYTES + (MASTER_BYTES if role.dtype_bytes < 4 else 0)
    return params, math.ceil(role.params * per_param / (world if role.stage >= 1 else 1))


def plan_problems(free: int, total: int, roles: list[RoleMemory], world: int, weights: int, kv: int,
                  override: float = 0.0, margin: int = STARTUP_MARGIN) -> list[tuple[str, Any, str]]:
    """(field, value, fix) for each way the run cannot fit one GPU (`free` of `total` bytes free before any engine):
    the engine's `weights` and `kv` beside the trainer's engines as they are during the rollouts (`resident_bytes`,
    optimizer states included) must fit in free - margin; an override must pass vLLM's start-up check with the
    engines built (ZeRO >= 1 allocates its optimizer states then; stage 0's optimizer allocates them at its first
    step)."""
    held = [(r, *resident_bytes(r, world)) for r in roles]
    during = sum(p + o for _, p, o in held)
    at_start = sum(p + (o if r.stage >= 1 else 0) for r, p, o in held)
    out = []
    if during + weights + kv > free - margin:
        each = ", ".join(f"{r.name} {gib(p + o)}" for r, p, o in held)
        out.append(("generation_backend", "vllm", f"the vLLM engine (weights {gib(weights)}, KV cache {gib(kv)}) and "
                    f"the trainer's engines during the rollouts ({each}: {gib(during)}, parameters and optimizer "
                    f"states only) need at least {gib(during + weights + kv)} on each GPU, and {gib(free)} of "
                    f"{gib(total)} is free before they are built, less a {gib(margin)} margin. Lower "
                    "vllm_kv_cache_mb, offload or shard the optimizer states (<role>_offload, a higher ZeRO stage), "
                    "or generate with lean"))
    if override and not passes_vllm_check(free - at_start, total, override):
        most = max(free - at_start, 0) * 10**6 // total / 10**6
        out.append(("vllm_gpu_memory_utilization", override, f"vLLM starts only with total x this free "
                    f"({gib(math.ceil(total * override))} of {gib(total)}), and with the trainer's engines built "
                    f"(at least {gib(at_start)}) at most {gib(free - at_start)} is: at most {most} fits; set 0 "
                    "(computed from the free memory at start-up)"))
    return out


def parameter_count(config: Any, scalar: bool) -> Optional[int]:
    """Parameters of the model `config` describes (tied ones once), built weightless on the meta device; a scalar
    role's is the one-label *ForSequenceClassification. None where transformers cannot build it so."""
    from ..models import weightless_model

    model = weightless_model(config, scalar)
    return None if model is None else sum(p.numel() for p in model.parameters())


def role_memories(cfg: Any, configs: dict, roles: dict) -> tuple[list[RoleMemory], Optional[int]]:
    """(the run's DeepSpeed engines as `RoleMemory`: `roles`, the plan's RolePlans, and the EMA; the actor's parameter
    count), or ([], None) when a model cannot be counted. A role with its own ds_config file is left out: the file
    may place it elsewhere."""
    counts: dict = {}

    def count(name: str) -> Optional[int]:
        key = (roles[name].path, name in ("critic", "reward"))
        if key not in counts:
            counts[key] = parameter_count(configs[name], scalar=key[1]) if name in configs else None
        return counts[key]

    out = []
    for name, plan in roles.items():
        rc = getattr(cfg, name)
        if count(name) is None:
            return [], None
        if (name == "reference" and cfg.engine.reference_from_actor_adapter) or rc.ds_config:
            continue
        out.append(RoleMemory(name, count(name), DTYPE_BYTES[plan.dtype], plan.stage, plan.train,
                              full_training=not rc.lora_dim and not getattr(rc, "trainable_layers", 0),
                              offload=rc.offload is True, offload_params=rc.offload_params is True))
    actor = roles["actor"]
    if cfg.engine.enable_ema:  # engine/rlhf_engine.py `_build_ema`: eval-only, ZeRO 3 with the actor's 3, else 0
        ema = cfg.engine.ema_dtype or actor.dtype
        ema_bytes = 2 if ema == "auto" else DTYPE_BYTES[ema]  # auto: bf16 or fp16 on a GPU (preflight.resolve_dtype)
        out.append(RoleMemory("ema", count("actor"), ema_bytes, 3 if actor.stage == 3 else 0, False))
    return out, count("actor")


def check_plan(cfg: Any, configs: dict, roles: dict, backend: str, max_len: int, p: Any,
               memory: Optional[tuple[int, int]] = None, world: Optional[int] = None) -> None:
    """Plan time, the vllm backend on a GPU: `plan_problems` of this run added to `p`, the same on every rank (the
    first rank's that has any). `memory` (free, total) defaults to this GPU's; on a CPU, or with rollout servers
    (their engines are elsewhere), nothing is checked."""
    if backend != "vllm" or cfg.rollout.servers_on or "actor" not in roles:
        return
    if memory is None:
        import torch

        if not torch.cuda.is_available():
            return
        memory = torch.cuda.mem_get_info()
    from ... import comm

    found: list = []
    members, actor_params = role_memories(cfg, configs, roles)
    if actor_params is not None:
        dtype_bytes = DTYPE_BYTES[roles["actor"].dtype]
        tp = cfg.engine.vllm_tensor_parallel_size
        kv = kv_budget_bytes(cfg.engine.vllm_kv_cache_mb, configs["actor"], dtype_bytes,
                             cfg.batch.generation_rollouts, max_len, tp)
        found = plan_problems(memory[0], memory[1], members, comm.world_size() if world is None else world,
                              math.ceil(actor_params * dtype_bytes / tp), kv,
                              cfg.engine.vllm_gpu_memory_utilization)
    found = next((f for f in comm.all_gather_object(found) if f), [])  # every rank refuses, or none
    for field, value, fix in found:
        p.add(field, value, fix)
