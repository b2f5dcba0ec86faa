"""The colocated vLLM engine's memory arithmetic (engine/generation/vllm_memory.py) on a fake device: free and total
bytes given by hand, numbers computed by hand. No GPU and no vLLM needed."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from rlhf_engine.config import TrainConfig
from rlhf_engine.engine.generation.vllm_memory import (GiB, RoleMemory, check_plan, engine_utilization,
                                                       parameter_count, passes_vllm_check, plan_problems,
                                                       resident_bytes, role_memories, startup_utilization)
from rlhf_engine.engine.preflight import RolePlan
from rlhf_engine.errors import Problems


def test_the_computed_utilization_passes_vllm_s_start_up_check_where_its_default_fails():
    """80 GiB GPU, 30 GiB free once the trainer's engines are built: (30 - 1) / 80 = 0.3625 passes vLLM's rule
    free >= ceil(total x utilization) even if vLLM's own reading finds 0.9 GiB less; its default 0.92 asks 73.6 GiB."""
    total, free = 80 * GiB, 30 * GiB
    u = startup_utilization(free, total, need=10 * GiB)
    assert u == 0.3625
    assert passes_vllm_check(free, total, u) and passes_vllm_check(free - int(0.9 * GiB), total, u)
    assert not passes_vllm_check(free, total, 0.92)  # the negative control: what a run without it met
    # a total that does not divide: rounded down, never above free - margin
    u = startup_utilization(free, 81 * GiB, need=10 * GiB)
    assert u == 0.358024  # 29 / 81 = 0.3580246...
    assert passes_vllm_check(free - GiB, 81 * GiB, u)


def test_an_engine_that_does_not_fit_beside_the_engines_is_refused_with_the_numbers():
    total, free = 80 * GiB, 30 * GiB
    assert startup_utilization(free, total, need=29 * GiB) == 0.3625  # exactly free - margin: fits
    with pytest.raises(ValueError) as err:
        startup_utilization(free, total, need=29 * GiB + 1)
    assert "needs 29.00 GiB" in str(err.value) and "30.00 GiB of 80.00 GiB is free" in str(err.value)
    assert "1.00 GiB margin" in str(err.value)


def test_the_override_is_passed_as_given_and_0_computes():
    total, free = 80 * GiB, 30 * GiB
    assert engine_utilization(0.5, free, total, need=40 * GiB) == 0.5  # no check of ours (vLLM checks it)
    assert engine_utilization(0, free, total, need=10 * GiB) == 0.3625
    with pytest.raises(ValueError):
        engine_utilization(0, free, total, need=40 * GiB)


def test_what_one_rank_holds_per_engine():
    """1 Gi parameters. bf16 trained: 2 bytes each, Adam's 8 + a 4-byte master copy split by ZeRO >= 1 (parameters
    only by ZeRO-3); fp32 has no master copy; offloaded parts and LoRA's states count 0."""
    n = 1 << 30
    bf16 = dict(params=n, dtype_bytes=2, train=True)
    assert resident_bytes(RoleMemory("actor", stage=0, **bf16), world=4) == (2 * GiB, 12 * GiB)
    assert resident_bytes(RoleMemory("actor", stage=2, **bf16), world=4) == (2 * GiB, 3 * GiB)
    assert resident_bytes(RoleMemory("actor", stage=3, **bf16), world=4) == (GiB // 2, 3 * GiB)
    assert resident_bytes(RoleMemory("actor", n, 4, stage=1, train=True), world=2) == (4 * GiB, 4 * GiB)
    assert resident_bytes(RoleMemory("actor", stage=2, offload=True, **bf16), world=4) == (2 * GiB, 0)
    assert resident_bytes(RoleMemory("actor", stage=3, offload_params=True, **bf16), world=4) == (0, 3 * GiB)
    assert resident_bytes(RoleMemory("actor", stage=2, full_training=False, **bf16), world=4) == (2 * GiB, 0)
    assert resident_bytes(RoleMemory("reward", n, 2, stage=3, train=False), world=4) == (GiB // 2, 0)
    assert resident_bytes(RoleMemory("reward", n, 2, stage=3, train=False, offload=True), world=4) == (0, 0)


def _four_engines(stage: int) -> list:
    """2 Gi-parameter actor and critic trained in bf16 at `stage`, reference and reward eval-only at ZeRO 0."""
    n = 2 << 30
    return [RoleMemory("actor", n, 2, stage, True), RoleMemory("critic", n, 2, stage, True),
            RoleMemory("reference", n, 2, 0, False), RoleMemory("reward", n, 2, 0, False)]


def test_the_plan_refuses_a_run_whose_floor_does_not_fit_and_names_the_numbers():
    """One rank, ZeRO 2: actor and critic 4 GiB of weights + 24 GiB of states each, reference and reward 4 GiB
    each: 64 GiB; the engine's 4 GiB of weights and 2 GiB of KV: 70 GiB. 71 GiB free leaves exactly that after the
    1 GiB margin; 70 does not."""
    engines, weights, kv = _four_engines(2), 4 * GiB, 2 * GiB
    assert plan_problems(71 * GiB, 80 * GiB, engines, 1, weights, kv) == []
    found = plan_problems(70 * GiB, 80 * GiB, engines, 1, weights, kv)
    assert [f[:2] for f in found] == [("generation_backend", "vllm")]
    fix = found[0][2]
    for says in ("weights 4.00 GiB, KV cache 2.00 GiB", "actor 28.00 GiB, critic 28.00 GiB, reference 4.00 GiB, "
                 "reward 4.00 GiB: 64.00 GiB", "at least 70.00 GiB", "70.00 GiB of 80.00 GiB is free"):
        assert says in fix, (says, fix)
    # 8 ranks shard the states: 4 + 3 GiB per trained engine, 22 GiB in all, fits
    assert plan_problems(70 * GiB, 80 * GiB, engines, 8, weights, kv) == []


def test_the_plan_checks_an_override_against_vllm_s_rule_with_the_engines_built():
    """8 ranks, ZeRO 2: 22 GiB held when the engine starts (ZeRO 2 allocates its states at build), 79 GiB free
    before: 57 GiB left, so 0.7 (56 GiB) passes, 0.72 (57.6 GiB) does not; 57 / 80 = 0.7125 is the most."""
    engines, total = _four_engines(2), 80 * GiB
    assert plan_problems(79 * GiB, total, engines, 8, 4 * GiB, 2 * GiB, override=0.7) == []
    found = plan_problems(79 * GiB, total, engines, 8, 4 * GiB, 2 * GiB, override=0.72)
    assert [f[:2] for f in found] == [("vllm_gpu_memory_utilization", 0.72)]
    assert "at least 22.00 GiB" in found[0][2] and "at most 0.7125 fits" in found[0][2]
    # ZeRO 0 allocates Adam's states at its first step, after the engine started: only the parameters count then
    # (4 x 4 GiB: 63 GiB left, 0.72 passes); during the rollouts they count, unsharded (64 + 6 + 1 <= 79: fits)
    assert plan_problems(79 * GiB, total, _four_engines(0), 8, 4 * GiB, 2 * GiB, override=0.72) == []

TINY = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2)


def test_the_plan_counts_the_run_s_models_weightless_and_does_nothing_on_a_cpu():
    """A tiny Llama (vocabulary 1000, hidden 64, MLP 128, 2 layers, untied head): 64000 embedding + 2 x (4 x 64 x 64
    attention + 3 x 64 x 128 MLP + 2 x 64 norms) + 64 final norm + 64000 head = 210240 parameters. fp32 actor trained
    at ZeRO 0 (4 + 8 bytes each), fp32 reference (4): 3363840 bytes; the engine's weights 840960 and its 16 MiB KV
    floor: 20982016 bytes beside the 1 GiB margin."""
    tiny = TINY
    assert parameter_count(tiny, scalar=False) == 210240
    assert parameter_count(tiny, scalar=True) == 210240 - 64000 + 64  # the one-label score head instead
    cfg = TrainConfig()
    cfg.engine.generation_backend = "vllm"
    roles = {"actor": RolePlan("tiny", 0, "fp32", True), "reference": RolePlan("tiny", 0, "fp32", False)}
    configs = {"actor": tiny, "reference": tiny}

    def problems(memory, backend="vllm"):
        p = Problems()
        check_plan(cfg, configs, roles, backend, 64, p, memory=memory, world=1)
        return [x.field for x in p]

    need = 3363840 + 840960 + (16 << 20)
    assert problems((GiB + need, 80 * GiB)) == []
    assert problems((GiB + need - 1, 80 * GiB)) == ["generation_backend"]
    assert problems((GiB + need - 1, 80 * GiB), backend="lean") == []
    if not torch.cuda.is_available():
        assert problems(None) == []  # this machine's own device: no CUDA, nothing checked (nothing changes on CPU)


def test_the_plan_s_engines_are_the_ones_the_run_builds():
    """No reference engine when it is the actor's disabled adapter; a LoRA actor's states are not counted; the EMA is
    an fp32 eval-only copy of the actor at ZeRO 3 with the actor's 3; a critic counts its one-label head."""
    cfg = TrainConfig()
    cfg.engine.enable_ema, cfg.engine.reference_from_actor_adapter, cfg.actor.lora_dim = True, True, 8
    roles = {"actor": RolePlan("tiny", 3, "bf16", True), "reference": RolePlan("tiny", 3, "bf16", False),
             "critic": RolePlan("tiny", 2, "bf16", True)}
    members, actor_params = role_memories(cfg, {r: TINY for r in roles}, roles)
    assert actor_params == 210240
    assert members == [RoleMemory("actor", 210240, 2, 3, True, full_training=False),
                       RoleMemory("critic", 146304, 2, 2, True), RoleMemory("ema", 210240, 4, 3, False)]
    assert role_memories(cfg, {"actor": TINY}, roles) == ([], None)  # a model it cannot count: no estimate


def test_the_backend_reads_the_device_once_the_engines_exist(monkeypatch):
    """A fake CUDA device (80 GiB, 30 GiB free): the backend asks vLLM for (30 - 1) / 80; an engine that cannot fit
    (the actor's 24 bytes of weights beside a 29 GiB KV cache) stops the run with the numbers; an override is passed
    as given."""
    from types import SimpleNamespace

    from rlhf_engine.engine.generation.vllm_engine import VLLMBackend
    from rlhf_engine.errors import ConfigError

    read = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: read.append("emptied"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: read.append(device) or (30 * GiB, 80 * GiB))
    backend = object.__new__(VLLMBackend)
    backend.actor = SimpleNamespace(module=torch.nn.Linear(2, 2))  # 6 fp32 parameters: 24 bytes
    backend.dist = SimpleNamespace(rank=0, device=torch.device("cuda", 3))
    assert backend.gpu_memory_utilization(0, kv=29 * GiB - 24) == 0.3625
    assert read == ["emptied", torch.device("cuda", 3)]  # the cache released before the reading, as vLLM does
    with pytest.raises(ConfigError) as err:
        backend.gpu_memory_utilization(0, kv=29 * GiB - 23)
    assert "needs 29.00 GiB" in str(err.value) and "generation_backend" in str(err.value)
    assert backend.gpu_memory_utilization(0.5, kv=29 * GiB - 23) == 0.5
    backend.tp = SimpleNamespace(size=2)  # tensor parallel 2: each member holds half the weights (12 bytes)
    assert backend.gpu_memory_utilization(0, kv=29 * GiB - 12) == 0.3625
    with pytest.raises(ConfigError):
        backend.gpu_memory_utilization(0, kv=29 * GiB - 11)
