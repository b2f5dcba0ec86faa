"""The embedded model's conversion (rlhf_engine/pretrained.py): GGUF -> a Hugging Face folder.

The conversion reads the GGUF once (`parse_once`, the default) where transformers alone reads it three times; on a
tiny Llama GGUF written here with gguf-py both paths must write the same files. Needs gguf-py (the demo packages), so
it runs in the learning job, where the example converts the real SmolLM2 file.
"""
import filecmp
import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.learning]  # the demo environment's packages (gguf)


def _tiny_llama_gguf(path: str) -> None:
    """A 2-block Llama with grouped KV heads and a byte-level BPE vocabulary of 33 tokens (4 merges), fp32."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, "llama")
    hidden, layers, ffn, heads, kv_heads = 16, 2, 32, 4, 2
    tokens = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
              + ["\u0120", "th", "the", "\u0120t", "an"])
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(["t h", "th e", "\u0120 t", "a n"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    kv = hidden // heads * kv_heads
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                       f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_conversion_read_once_writes_what_transformers_own_path_writes(tmp_path):
    gguf = pytest.importorskip("gguf")  # here, not at import: the other jobs deselect this file without a skip
    from transformers import AutoTokenizer

    from rlhf_engine.pretrained import _gguf_parsed_once, convert_gguf

    path = str(tmp_path / "tiny.gguf")
    _tiny_llama_gguf(path)
    once, plain = str(tmp_path / "once"), str(tmp_path / "plain")
    convert_gguf(path, once, end_of_turn="<|im_end|>")
    convert_gguf(path, plain, end_of_turn="<|im_end|>", parse_once=False)
    names = sorted(os.listdir(plain))
    assert sorted(os.listdir(once)) == names and "model.safetensors" in names and "tokenizer.json" in names
    match, mismatch, errors = filecmp.cmpfiles(once, plain, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    tok = AutoTokenizer.from_pretrained(once)
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens(tok("the tan").input_ids) == ["the", "\u0120t", "an"]  # the merges are used
    # within the conversion the reader is made once per path; outside it, gguf-py is as it was
    with _gguf_parsed_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(path)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
