import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_engine.engine.freezing import freeze_below_top, transformer_blocks


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_only_top_blocks_norm_and_head_train(tiny, tiny_llama, arch):
    setup = tiny if arch == "gpt2" else tiny_llama
    model = AutoModelForSequenceClassification.from_pretrained(setup.actor, num_labels=1)
    blocks = transformer_blocks(model)
    assert len(blocks) == 2
    n = freeze_below_top(model, 1)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    top = {f"{i}." for i in [len(blocks) - 1]}
    for name in trainable:  # every trainable parameter is in the top block, the final norm or the score head
        assert any(f".{t}" in name for t in top) or name.startswith("score") or "norm" in name or "ln_f" in name, name
    assert any(name.startswith("score") for name in trainable)
    assert not any(".0." in name for name in trainable)  # the lower block is frozen, its norms too
    assert not any("embed" in name or "wte" in name or "wpe" in name for name in trainable)
    assert n == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # backward reaches only trainable parameters
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(input_ids=ids).logits.sum()
    out.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, name


def test_zero_keeps_everything_trainable(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny.actor)
    total = sum(p.numel() for p in model.parameters())
    assert freeze_below_top(model, 0) == total
