"""The vllm backend's parts that need no vLLM (the engine itself: tests/distributed/test_vllm_*.py, in the vLLM
environment): undoing an engine's side effects on the process, the KV budget, the shutdown order."""
from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from rlhf_engine import comm
from rlhf_engine.engine.generation.vllm_engine import contained, default_kv_cache_bytes, kv_bytes_per_token


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
    assert gc.get_freeze_count() == 0


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
