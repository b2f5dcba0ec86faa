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


def test_the_reference_carries_the_actors_requires_grad_flags(tiny, dist_single, tmp_path):
    """ATen's matmul picks mm or bmm by the weight's requires_grad flag, under no_grad too, and the two round
    differently on some CPUs: the frozen reference must compute with the actor's flags (top block trained, the rest
    frozen here, so both values occur) for the actor-reference KL to be exactly 0 by construction."""
    from rlhf_engine.cli import parse_args
    from rlhf_engine.engine import RLHFEngine, plan_engine

    from _support import as_flags

    cfg = parse_args(as_flags(dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=tiny.reward,
                                   data_path=tiny.prompts, output_dir=str(tmp_path), actor_trainable_layers=1,
                                   max_prompt_seq_len=64, max_answer_seq_len=8)))
    e = RLHFEngine(cfg, dist_single, plan_engine(cfg, 1))
    actor = {n: p.requires_grad for n, p in e.actor.module.named_parameters()}
    ref = {n: p.requires_grad for n, p in e.reference.module.named_parameters()}
    assert ref == actor and any(actor.values()) and not all(actor.values())
    assert not any(p.requires_grad for p in e.reward.module.parameters())  # not the actor's architecture: frozen


def test_mirror_requires_grad_matches_by_name(tiny):
    from rlhf_engine.engine.freezing import mirror_requires_grad

    like = AutoModelForCausalLM.from_pretrained(tiny.actor)
    freeze_below_top(like, 1)
    model = AutoModelForCausalLM.from_pretrained(tiny.actor).requires_grad_(False)
    assert mirror_requires_grad(model, like) == len(list(model.named_parameters()))
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in like.parameters()]
