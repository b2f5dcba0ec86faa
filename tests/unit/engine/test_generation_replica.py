"""GenerationReplica: a copy of the actor whose weights exist only between `refresh` and `release` (one buffer)."""
import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

from rlhf_engine.engine.cpu_matmul import fp32_kernel_layers, has_fp32_kernel_layers
from rlhf_engine.engine.zero3 import GenerationReplica

CONFIGS = {
    "llama_tied": LlamaConfig(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "opt": OPTConfig(vocab_size=211, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=32),
}


@pytest.mark.parametrize("name, fp32_kernel", [(n, False) for n in sorted(CONFIGS)] + [("opt", True)])
def test_the_replica_decodes_like_the_model_and_holds_no_weights_between_calls(name, fp32_kernel):
    """fp32_kernel: the model's bf16 Linear layers take the fp32 kernel (cpu_bf16_matmul): the replica's too, so its
    logits still equal the model's exactly."""
    torch.manual_seed(0)
    src = AutoModelForCausalLM.from_config(CONFIGS[name]).to(torch.bfloat16).eval()
    if fp32_kernel:
        fp32_kernel_layers(src)
    replica = GenerationReplica(src, torch.device("cpu"))
    assert has_fp32_kernel_layers(replica.module) is fp32_kernel
    assert not replica.resident and all(p.is_meta for p in replica.module.parameters())  # nothing allocated yet
    x = torch.randint(0, 211, (2, 9))
    for _ in range(2):  # refreshed twice: the second allocation is a new buffer, filled again
        model = replica.refresh(src)
        assert replica.resident and model.lm_head.weight is model.get_input_embeddings().weight  # still tied
        with torch.no_grad():
            assert torch.equal(model(x).logits, src(x).logits)
        flat = weakref.ref(replica._flat)
        replica.release()
        gc.collect()
        assert flat() is None, "the weights' buffer is still referenced after release"
        assert not replica.resident and all(p.is_meta for p in model.parameters())
        assert all(not b.is_meta for b in model.buffers())  # buffers (position tables) stay


def test_weights_copied_in_follow_the_source():
    """After the source moves, the next refresh carries the new weights (negative control: the old ones differ)."""
    torch.manual_seed(0)
    src = AutoModelForCausalLM.from_config(CONFIGS["opt"]).eval()
    replica = GenerationReplica(src, torch.device("cpu"))
    x = torch.randint(0, 211, (1, 5))
    with torch.no_grad():
        before = replica.refresh(src)(x).logits
        replica.release()
        for p in src.parameters():
            p.add_(0.01)
        after = replica.refresh(src)(x).logits
        assert not torch.equal(before, after) and torch.equal(after, src(x).logits)
