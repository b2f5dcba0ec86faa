"""The frozen prefix kept and replayed (engine/frozen_prefix.py) on 4-block GPT-2 and Llama models with the top 2
blocks trained: a replayed forward gives the same logits as a full one, without running a prefix block; an entry is
found only for equal inputs; models whose frozen weights differ are told apart."""
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from rlhf_engine.engine.freezing import freeze_below_top, transformer_blocks
from rlhf_engine.engine.frozen_prefix import FrozenPrefix, same_prefix

K = 2  # trained blocks of 4: prefix = block 0 skipped, block 1 the boundary


def _model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = (GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0) if arch == "gpt2" else
           LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=32))
    model = AutoModelForCausalLM.from_config(cfg).eval()
    freeze_below_top(model, K)
    return model


def _inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_replayed_forward_equals_the_full_one_without_running_the_prefix(arch):
    model = _model(arch)
    prefix = FrozenPrefix(model, K)
    blocks = transformer_blocks(model)
    assert prefix.skipped == [blocks[0]] and prefix.boundary is blocks[1]
    a, b = _inputs(1), _inputs(2)
    with torch.no_grad():
        for x in (a, b):
            with prefix.capturing(x):
                model(**x)
        full = model(**a).logits
    assert len(prefix.entries) == 2 and prefix.nbytes == 2 * 3 * 7 * 32 * 4  # [3, 7, 32] fp32 each
    calls = []
    hooks = [blk.register_forward_pre_hook(lambda *_: calls.append(1)) for blk in (blocks[0].mlp, blocks[1].mlp)]
    model.train()  # a training forward, with grad: as the trainer's
    with prefix.replaying(prefix.lookup(a)):
        replayed = model(**a).logits
    assert calls == []  # neither prefix block computed anything
    assert torch.equal(replayed, full)  # same inputs to the same top blocks: the same numbers
    replayed.sum().backward()  # the top blocks train; the prefix holds no graph
    assert blocks[2].mlp.c_fc.weight.grad is not None if arch == "gpt2" else blocks[2].mlp.up_proj.weight.grad is not None
    assert all(p.grad is None for p in blocks[0].parameters())
    for h in hooks:
        h.remove()
    # the blocks are themselves again afterwards, and a replay of the other inputs' entry gives other logits (the
    # negative control: the kept output is what the top blocks read)
    assert "forward" not in vars(blocks[0]) and "forward" not in vars(blocks[1])
    with torch.no_grad():
        assert torch.equal(model(**a).logits, full)
        with prefix.replaying(prefix.lookup(b)):
            assert not torch.allclose(model(**a).logits, full)


def test_an_entry_is_found_only_for_equal_inputs():
    model = _model("gpt2")
    prefix = FrozenPrefix(model, K)
    a = _inputs(1)
    with torch.no_grad(), prefix.capturing(a):
        model(**a)
    assert prefix.lookup({k: v.clone() for k, v in a.items()}) is prefix.entries[0]
    other = {**a, "attention_mask": a["attention_mask"].clone()}
    other["attention_mask"][1, 0] = 0
    assert prefix.lookup(other) is None
    # consecutive rows of a kept batch (a training micro-batch in an experience chunk): those rows of its output
    part = prefix.lookup({k: v[1:3] for k, v in a.items()})
    assert part is not None and torch.equal(part.output, prefix.entries[0].output[1:3])
    assert prefix.lookup({k: v[[0, 2]] for k, v in a.items()}) is None  # rows that are not consecutive
    assert prefix.lookup({k: v[:, 1:] for k, v in a.items()}) is None  # another width
    assert prefix.lookup({k: v for k, v in a.items() if k != "position_ids"}) is None
    prefix.clear()
    assert prefix.lookup(a) is None and prefix.nbytes == 0


def test_no_prefix_where_nothing_is_frozen_or_a_low_block_trains():
    model = _model("gpt2")
    assert FrozenPrefix.of(model, 0) is None
    transformer_blocks(model)[0].attn.c_attn.weight.requires_grad_(True)
    assert FrozenPrefix.of(model, K) is None
    with pytest.raises(ValueError, match="not frozen"):
        FrozenPrefix(model, K)


def test_same_prefix_compares_the_frozen_weights_only():
    actor, reference = _model("llama"), _model("llama")
    assert same_prefix(actor, reference)  # the same seed: the initial actor
    with torch.no_grad():
        transformer_blocks(actor)[3].mlp.up_proj.weight.add_(1.0)  # a trained block moved: still the same prefix
    assert same_prefix(actor, reference)
    with torch.no_grad():
        transformer_blocks(reference)[1].mlp.up_proj.weight[0, 0] += 1e-6  # a frozen weight differs
    assert not same_prefix(actor, reference)
    assert not same_prefix(actor, _model("llama", seed=1))
