"""The vllm backend's parts that need no vLLM (the engine itself: tests/distributed/test_vllm_*.py, in the vLLM
environment): undoing an engine's side effects on the process, the KV budget, the shutdown order and its cost."""
from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from rlhf_engine import comm
from rlhf_engine.engine.generation.vllm_engine import VLLMBackend, contained, no_heap_collections
from rlhf_engine.engine.generation.vllm_memory import default_kv_cache_bytes, kv_bytes_per_token


def test_contained_undoes_what_an_engine_does_to_the_process():
    """What building a vLLM engine was measured to do (reseed every generator, replace torch.set_num_threads by a
    no-op, gc.freeze) is undone: the next draws are the ones the run would have made without it."""
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    threads, real = torch.get_num_threads(), torch.set_num_threads
    with contained():
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        torch.set_num_threads = lambda n: None
        gc.freeze()
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    assert torch.set_num_threads is real and torch.get_num_threads() == threads
    assert gc.get_freeze_count() == 0  # nothing was frozen before: nothing is after


def _frozen(obj) -> bool:
    """Whether `obj` is in the collector's permanent generation (tracked, yet in none of generations 0-2)."""
    return gc.is_tracked(obj) and all(o is not obj for o in gc.get_objects())


def test_contained_keeps_a_freeze_that_existed_before():
    """From a start-up freeze (cli.freeze_startup): what was frozen before stays frozen after the engine freezes
    again (vLLM's freeze kept with it), and after an engine thaws everything (then frozen again)."""
    before = [object(), []]  # a tracked object: lists are, plain objects are not
    assert not _frozen(before[1])
    try:
        gc.freeze()
        count = gc.get_freeze_count()
        assert count > 0 and _frozen(before[1])
        with contained():
            during = [1]
            gc.freeze()  # what building the engine does
        assert gc.get_freeze_count() >= count and _frozen(before[1]) and _frozen(during)
        with contained():
            gc.unfreeze()  # what an engine's shutdown does
        assert gc.get_freeze_count() > 0 and _frozen(before[1]) and _frozen(during)
        with contained():
            pass
        assert _frozen(before[1])
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0 and not _frozen(before[1])  # the control: thawed, _frozen says so


def test_the_kv_budget_holds_the_run_s_sequences_in_whole_blocks():
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    per_token = kv_bytes_per_token(cfg, 4)
    assert per_token == 2 * 30 * 3 * 64 * 4  # keys and values, layers, KV heads, head size, fp32
    # 16 rows of 56 tokens: one 128-token block each plus one, a quarter more
    assert default_kv_cache_bytes(cfg, 4, rows=16, max_len=56) == int(1.25 * 16 * 2 * 128 * per_token)
    assert default_kv_cache_bytes(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2), 4, 1,
                                  8) == 16 << 20  # the floor


def test_shutdown_runs_what_holds_the_group_before_destroying_it(monkeypatch):
    """Barrier, then the callbacks newest first (each once, all of them even when one raises), then the group."""
    import torch.distributed as td

    order = []
    monkeypatch.setattr(comm, "_AT_SHUTDOWN", [])
    monkeypatch.setattr(comm, "initialized", lambda: not order or order[-1] != "destroyed")
    monkeypatch.setattr(td, "barrier", lambda: order.append("barrier"))
    monkeypatch.setattr(td, "destroy_process_group", lambda: order.append("destroyed"))

    def broken():
        order.append("broken")
        raise RuntimeError("an engine that fails to shut down")

    comm.at_shutdown(lambda: order.append("first registered"))
    comm.at_shutdown(broken)
    comm.at_shutdown(lambda: order.append("last registered"))
    with pytest.raises(RuntimeError, match="fails to shut down"):
        comm.shutdown(ok=True)
    assert order == ["barrier", "last registered", "broken", "first registered", "destroyed"]
    assert comm._AT_SHUTDOWN == []


def test_every_packed_layer_sharing_its_weight_is_repacked_whatever_its_name():
    """repack_tied_head finds tied layers by identity, not by name (Llama, GPT-2 and OPT name their embeddings
    differently): a layer with a packed GEMM (`cpu_linear`) whose weight is another module's is processed again;
    an untied one, or a model without packing (GPU), is left alone."""
    import torch

    from rlhf_engine.engine.generation.vllm_engine import repack_tied_head

    class Method:
        def __init__(self):
            self.calls = []

        def process_weights_after_loading(self, layer):
            self.calls.append(layer)

    def layer(weight=None, packed=True):
        m = torch.nn.Module()
        m.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(4, 2))
        m.quant_method = Method()
        if packed:
            m.cpu_linear = lambda x, w, b: x
        return m

    for names in (("model", "embed_tokens"), ("transformer", "wte"), ("decoder", "embed_tokens")):
        model = torch.nn.Module()
        inner = torch.nn.Module()
        setattr(inner, names[1], layer())
        setattr(model, names[0], inner)
        model.lm_head = layer(getattr(inner, names[1]).weight)  # tied
        model.other = layer()  # packed, untied
        assert repack_tied_head(model) is True
        assert model.lm_head.quant_method.calls == [model.lm_head] and model.other.quant_method.calls == []
    untied = torch.nn.Module()
    untied.embed, untied.lm_head = layer(), layer()
    assert repack_tied_head(untied) is False and untied.lm_head.quant_method.calls == []
    gpu = torch.nn.Module()  # nothing packed
    gpu.embed = layer(packed=False)
    gpu.lm_head = layer(gpu.embed.weight, packed=False)
    assert repack_tied_head(gpu) is False


class _FakeModel(torch.nn.Module):
    """vLLM's model as its reload sees it: parameters under vLLM's names (`layers.0.qkv.weight`, or top-level
    ones), and a `load_weights` that returns the vLLM names of the pairs it read, fused as vLLM fuses them (q, k and v
    into qkv) and skipping names it does not know, as vLLM's loaders do."""

    FUSED = {"q": "qkv", "k": "qkv", "v": "qkv"}

    def __init__(self, names=("qkv.weight", "o.weight")):
        super().__init__()
        for name in names:
            *path, leaf = name.split(".")
            owner = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(2)))

    def load_weights(self, weights):
        known = {n for n, _ in self.named_parameters()}
        loaded = set()
        for name, _ in weights:
            *path, leaf = name.split(".")
            if path:
                path[-1] = self.FUSED.get(path[-1], path[-1])
            if ".".join(path + [leaf]) in known:
                loaded.add(".".join(path + [leaf]))
        return loaded


class _FakeLLM:
    """A recording stand-in for vLLM's `LLM` and its model runner, holding vLLM 0.32's sleep state as its executor
    does: sleep(level >= 1) puts the tags 'weights' and 'kv_cache' to sleep; wake_up(tags) wakes those (None: all)
    and answers whether the engine is fully awake; a weight pushed into sleeping weights is an error. Its reload
    goes through the model's `load_weights`, as vLLM's does."""

    def __init__(self, model=None):
        self.calls, self.sleeping = [], set()
        self.model = model if model is not None else _FakeModel(("weight", "bias"))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.sleeping |= {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        assert tags is None or set(tags) <= self.sleeping, f"vLLM ignores a tag that is not asleep: {tags}"
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        self.sleeping -= set(tags) if tags else set(self.sleeping)
        return not self.sleeping

    def reload_weights(self, weights_iterator):
        assert "weights" not in self.sleeping, "weights pushed into an engine whose weights are asleep"
        pairs = list(weights_iterator)
        self.calls.append(("push", "kv_cache" in self.sleeping, sorted(n for n, _ in pairs)))
        self.model.load_weights(pairs)

    def get_model(self):
        return self.model

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


def _backend(sleep_level: int, actor_steps: int):
    """A VLLMBackend without an engine (the fields sync_weights and release use), its `llm` and runner the fake,
    the actor a real 2-parameter module, pushed at step 1."""
    from types import SimpleNamespace

    from rlhf_engine.engine.generation.vllm_engine import VLLMBackend

    backend = object.__new__(VLLMBackend)
    backend.llm = backend.runner = _FakeLLM()
    backend.actor = SimpleNamespace(global_steps=actor_steps, module=torch.nn.Linear(2, 2))
    backend.sleep_level, backend._asleep, backend._pushed_version = sleep_level, False, 1
    backend.sync_seconds, backend.pushes = 0.0, 0
    return backend


@pytest.mark.parametrize("level, steps, pushed", [(1, 2, True), (2, 1, True), (1, 1, False)])
def test_a_sleeping_engine_wakes_its_weights_then_takes_the_push_then_wakes_its_kv_cache(level, steps, pushed):
    """Level 1 after an actor step and level 2 (weights discarded: pushed again whatever the step) push between the
    two wake-ups, the KV cache still asleep; level 1 without a step (the negative control) wakes both, pushes
    nothing."""
    backend = _backend(level, steps)
    backend.release()
    assert backend.sync_weights() is pushed
    push = [("push", True, ["bias", "weight"]), ("reset_prefix_cache",)] if pushed else []
    assert backend.llm.calls == [("sleep", level), ("wake_up", ("weights",)), *push, ("wake_up", ("kv_cache",))]
    assert backend.weights_current() and not backend.llm.sleeping and backend.pushes == int(pushed)
    backend.llm.calls.clear()
    assert backend.sync_weights() is False and backend.llm.calls == []  # awake and current: nothing to do


def test_an_engine_that_never_sleeps_is_only_pushed():
    backend = _backend(0, 2)
    backend.release()
    assert backend.sync_weights() is True
    assert backend.llm.calls == [("push", False, ["bias", "weight"]), ("reset_prefix_cache",)]


# ---- a push that proves itself (vllm_push_check.py; the real engine: tests/distributed/test_vllm_generation.py) ----
def test_a_push_that_reaches_every_engine_parameter_passes_and_one_missing_a_layer_stops_naming_it():
    from rlhf_engine.engine.generation.vllm_push_check import WeightPushIncomplete

    names = ("layers.0.qkv.weight", "layers.0.o.weight", "layers.1.qkv.weight", "layers.1.o.weight", "norm.weight")
    full = ["layers.0.q.weight", "layers.0.k.weight", "layers.0.v.weight", "layers.0.o.weight",
            "layers.1.q.weight", "layers.1.k.weight", "layers.1.v.weight", "layers.1.o.weight", "norm.weight"]

    def push(pushed):
        backend = _backend(0, 2)
        backend.llm = backend.runner = _FakeLLM(_FakeModel(names))
        backend.load_weights([(n, torch.zeros(3, 2)) for n in pushed])

    push(full)  # every parameter reached: no error
    with pytest.raises(WeightPushIncomplete) as e:
        push([n for n in full if not n.startswith("layers.1.")])
    msg = str(e.value)
    assert "layers.1: layers.1.o.weight (no weight), layers.1.qkv.weight (no weight)" in msg, msg
    assert "layers.0" not in msg and "5 tensors, 30 elements" in msg
    with pytest.raises(WeightPushIncomplete, match=r"norm: norm.weight \(no weight\)"):
        push(full[:-1])


def test_the_shortfall_names_missing_parameters_and_layers_short_of_elements_by_block():
    from rlhf_engine.engine.generation.vllm_push_check import push_shortfall

    expected = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj.weight",
                "model.norm.weight"}
    loaded = {"model.layers.0.self_attn.qkv_proj.weight", "model.norm.weight"}
    short = [("model.layers.0.self_attn.qkv_proj", 8192, 12288)]  # q and v arrived, k did not
    assert push_shortfall(expected, loaded, short) == [
        "model.layers.0: model.layers.0.self_attn.qkv_proj (8192 of 12288 elements)",
        "model.layers.1: model.layers.1.mlp.down_proj.weight (no weight)"]
    assert push_shortfall(expected, expected, []) == []
    # a layer with no weight at all is named by its parameters, not again by its counts
    assert push_shortfall(expected, loaded, [("model.layers.1.mlp.down_proj", 0, 8192)]) == [
        "model.layers.1: model.layers.1.mlp.down_proj.weight (no weight)"]
    assert push_shortfall(expected, None, None) == []  # nothing reported: nothing to name (warned by check_push)


def test_a_vocabulary_s_padding_rows_are_not_expected_from_a_push():
    """GPT-2's 50257 rows are padded to 50304 in vLLM; no checkpoint fills the 47 extra rows."""
    from types import SimpleNamespace

    from rlhf_engine.engine.generation.vllm_push_check import vocab_padding

    idx = SimpleNamespace(num_elements_padded=50304, num_org_elements=50257, num_added_elements=0)
    assert vocab_padding(SimpleNamespace(shard_indices=idx, embedding_dim=768)) == 47 * 768
    assert vocab_padding(torch.nn.Linear(2, 2)) == 0


def test_loader_warnings_reach_the_log_less_the_layers_no_push_can_fill(caplog):
    """vLLM at ERROR (quiet_vllm) hides its loaders' warnings; the kept handler passes them to our log, except the
    per-push 'Failed to load weights' of a class whose every layer has no parameter of its own (a rotary cache
    buffer, a head tied to the embedding)."""
    import logging

    from rlhf_engine.engine.generation.vllm_push_check import (LOADER_LOGGER, keep_loader_warnings,
                                                                loader_noise_classes)

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(4), persistent=False)

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 2)
    model.rotary = Rotary()
    model.head = torch.nn.Module()
    model.head.weight = model.embed.weight  # tied: listed once, under embed
    model.norm = torch.nn.LayerNorm(2)
    noise = loader_noise_classes(model)
    assert noise == {"Rotary", "Module"} and "LayerNorm" not in noise
    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.level, vllm_logger.propagate
    vllm_logger.setLevel(logging.ERROR)  # what VLLM_LOGGING_LEVEL=ERROR sets
    handler = keep_loader_warnings(noise)
    try:
        layerwise = logging.getLogger(LOADER_LOGGER + ".reload.layerwise")
        with caplog.at_level(logging.WARNING):
            layerwise.warning("%s: Failed to load weights", "Rotary")
            layerwise.warning("%s: Failed to load weights", "LayerNorm")
            logging.getLogger(LOADER_LOGGER + ".reload.inplace").warning(
                "Following weights were not loaded from checkpoint: %s", {"model.layers.1.mlp.down_proj.weight"})
            logging.getLogger("vllm.v1.engine").warning("per-request noise")  # vLLM's other loggers stay quiet
        got = [r.getMessage() for r in caplog.records]
        assert got == ["LayerNorm: Failed to load weights",
                       "Following weights were not loaded from checkpoint: {'model.layers.1.mlp.down_proj.weight'}"]
        assert keep_loader_warnings() is handler  # once
    finally:
        logging.getLogger(LOADER_LOGGER).removeHandler(handler)
        logging.getLogger(LOADER_LOGGER).propagate = True
        vllm_logger.setLevel(saved[0])
        vllm_logger.propagate = saved[1]


# ---- MoE actors: refused before any engine is built ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_a_mixture_of_experts_actor_is_refused_by_the_plan_with_the_reason(kind):
    """Tiny configs built in-process (no download): Qwen2-MoE's num_experts, Mixtral's num_local_experts. The
    reason comes before any vLLM question (it needs only the config), so the plan refuses it where vLLM is absent
    too."""
    from transformers import AutoConfig

    from rlhf_engine.engine.generation.vllm_engine import moe_reason, unavailable_reasons

    config = AutoConfig.for_model(kind, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, vocab_size=512)
    reason = moe_reason(config)
    assert reason and "mixture of experts" in reason and "experts.gate_up_proj" in reason
    assert unavailable_reasons(config)[0] == reason
    from rlhf_engine.cli import parse_args
    from rlhf_engine.engine.preflight import plan_generation
    from rlhf_engine.errors import Problems

    problems = Problems()  # the plan's check, run before any engine is built
    cfg = parse_args(["--actor_model_name_or_path", "a", "--reward_model_name_or_path", "r", "--data_path", "d",
                      "--output_dir", "unused", "--generation_backend", "vllm"])
    plan_generation(cfg, {"actor": config}, problems)
    assert [(q.field, q.fix) for q in problems][0] == ("generation_backend", reason)
    dense = AutoConfig.for_model(kind, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 **{"num_experts" if kind == "qwen2_moe" else "num_local_experts": 1})
    dense.architectures = ["LlamaForCausalLM"]
    assert moe_reason(dense) is None  # one expert is a dense MLP: the negative control
    assert moe_reason(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2)) is None
    named = LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2)
    named.architectures = ["Qwen3MoeForCausalLM"]
    assert "Qwen3MoeForCausalLM" in moe_reason(named)


def test_closing_the_engine_skips_vllm_s_whole_heap_collections():
    """vLLM's engine shutdown collects the whole heap (twice); close() runs it where `gc.collect()` does nothing:
    a cycle made before stays uncollected through the shutdown, and is collected by the next real collection."""
    import types
    import weakref

    class Cycle:
        pass

    seen = []

    def shutdown():  # what vLLM's EngineCore.shutdown does to the heap, and a cycle to see whether it ran
        seen.append((alive() is not None, gc.collect(), alive() is not None))

    c = Cycle()
    c.me = c
    alive = weakref.ref(c)
    del c
    backend = object.__new__(VLLMBackend)
    backend.llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=types.SimpleNamespace(
        shutdown=shutdown)))
    collect = gc.collect
    backend.close()
    backend.close()  # once only
    assert seen == [(True, 0, True)]
    assert gc.collect is collect and backend.llm is None
    gc.collect()
    assert alive() is None  # the control: a real collection takes the cycle
    with no_heap_collections():
        assert gc.collect() == 0
    assert gc.collect is collect
