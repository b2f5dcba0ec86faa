"""policy_weights: the actor's weights as plain Hugging Face (name, tensor) pairs, block by block, what an inference
engine of its own loads (the vllm backend's push). In process, no vLLM needed: plain models, LoRA merged (Linear and
GPT-2's Conv1D), and a ZeRO-3 engine on one rank, where no block is gathered beside the one being read."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from rlhf_engine.engine.policy_weights import stream_weights, weight_groups

CONFIGS = {
    "llama_tied": LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gpt2": GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4),
}


def _model(name: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[name]).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_plain_model_streams_its_state_dict_block_by_block(name):
    model = _model(name)
    pairs = list(stream_weights(model))
    expected = dict(model.named_parameters())  # tied weights once
    assert [n for n, _ in pairs] == list(expected)
    assert all(v is expected[n].data or torch.equal(v, expected[n]) for n, v in pairs)
    groups = [g for g, _ in weight_groups(model)]
    layers = [g for g in groups if g.split(".")[-1].isdigit()]
    assert len(layers) == CONFIGS[name].num_hidden_layers and len(set(groups)) == len(groups)  # each block once


@pytest.mark.parametrize("name,targets", [("llama_tied", ["q_proj", "v_proj", "down_proj"]),
                                          ("gpt2", ["c_attn", "c_fc"])])
def test_a_lora_actor_streams_merged_weights_under_the_plain_names(name, targets):
    from peft import LoraConfig, get_peft_model

    model = _model(name)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                            fan_in_fan_out=name == "gpt2"))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # B starts at 0: make the adapter matter
    pairs = dict(stream_weights(peft))
    merged = peft.merge_and_unload()
    want = dict(merged.named_parameters())
    assert list(pairs) == list(want) and not any("lora_" in n or "base_layer" in n for n in pairs)
    worst = max(float((pairs[n] - want[n]).abs().max()) for n in want)
    assert worst < 1e-6, worst
    base = _model(name)  # negative control: the unmerged base weights are far from the stream
    assert max(float((pairs[n] - p.detach()).abs().max()) for n, p in base.named_parameters()) > 1e-2


def test_under_zero3_each_block_is_gathered_alone_and_the_stream_is_the_full_model(tiny, dist_single):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from rlhf_engine.config import BatchConfig, RoleConfig
    from rlhf_engine.engine.role_engine import build_role_engine, full_state_dict

    engine, _ = build_role_engine(RoleConfig(), tiny.actor, kind="causal_lm", stage=3, dtype="fp32", train=True,
                                  batch=BatchConfig(), world_size=1, eval_micro_batch_size=2, num_training_steps=1,
                                  pad_token_id=0)
    module = engine.module
    full = full_state_dict(engine, 3, True)
    group_of = {id(p): g for g, params in weight_groups(module) for _, p in params}
    # partitioned for real, in several blocks (the small ones stay resident): the check below can fail
    assert len({group_of[id(p)] for p in module.parameters() if not p.ds_persist}) >= 3
    seen, stray = {}, []
    for name, value in stream_weights(module):
        seen[name] = value
        owner = group_of[id(dict(module.named_parameters())[name])]
        # while a block's values are in hand, no parameter of another block is gathered (persistent ones aside)
        stray += [n for n, p in module.named_parameters() if group_of[id(p)] != owner
                  and p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist]
    assert not stray, stray[:5]
    assert set(seen) == {n for n in full if n in dict(module.named_parameters())}
    assert max(float((seen[n] - full[n]).abs().max()) for n in seen) == 0.0
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in module.parameters() if not p.ds_persist)
