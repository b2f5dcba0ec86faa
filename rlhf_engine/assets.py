"""Tiny offline tokenizers, models and prompts for tests, benchmarks and CI: nothing is downloaded.

The training text is the stdlib's `pydoc_data.topics` (about 0.5 MB, ships with every CPython), so everything here is
deterministic for a given Python version (the text changes between Python releases, and with it the vocabulary).
"""
from __future__ import annotations

import functools
import random
import re

EOS, PAD, BOS = "<|endoftext|>", "<pad>", "<s>"
ARCHS = ("gpt2", "llama", "opt", "qwen2")
HEADS = ("causal_lm", "score")


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    return tuple(topics[k] for k in sorted(topics))  # sorted: a fixed order whatever the dict's


def train_tiny_tokenizer(out_dir: str, vocab_size: int = 512, pad_is_eos: bool = False, bos_is_pad: bool = False) -> str:
    """Train a byte-level BPE tokenizer (left padding) on `pydoc_data.topics`, save it to `out_dir`, return `out_dir`.

    Ids 0, 1, 2 are `<|endoftext|>` (eos), `<pad>` (pad), `<s>` (bos); BOS is never prepended automatically.
    `pad_is_eos`: the pad token is the eos token (same id), as in GPT-2-style models. `bos_is_pad`: bos == pad (as in
    some Llama-style tokenizers), the case where a mask derived from `ids != pad` goes wrong. The vocabulary is the
    same whatever the flags; only the roles of the special tokens change.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + 3:
        raise ValueError(f"vocab_size must be >= 259 (256 bytes + 3 special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # no prefix space: text round-trips exactly
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD, BOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # every byte: no unknowns
    tok.train_from_iterator(_corpus(), trainer=trainer)
    pad = EOS if pad_is_eos else PAD
    bos = pad if bos_is_pad else BOS
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=pad, bos_token=bos,
                                   padding_side="left", clean_up_tokenization_spaces=False)
    fast.save_pretrained(out_dir)
    return out_dir


def build_tiny_model(out_dir: str, tokenizer_dir: str, arch: str = "gpt2", head: str = "causal_lm", n_layer: int = 2,
                     hidden: int = 64, n_head: int = 4, max_positions: int = 256, dropout: float = 0.1,
                     seed: int = 0, tie_embeddings: bool = False) -> str:
    """Save a random-weight model (safetensors) plus its tokenizer into `out_dir`; return `out_dir`.

    arch "gpt2" (absolute position embeddings), "llama" (rotary), "opt" (learned positions, offset 2) or "qwen2"
    (rotary, biases on q, k and v, two query heads per key-value head where `n_head` is even); head "causal_lm" or
    "score" (a sequence classification model with one label: a reward model / critic). The weights depend on `seed`
    only, and the caller's global torch RNG is left untouched. `tie_embeddings` (llama, qwen2): the LM head is the
    embedding, as in SmolLM2 (gpt2 always ties; opt never here).
    """
    import torch
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GPT2Config,
                              LlamaConfig, OPTConfig, Qwen2Config)

    if arch not in ARCHS or head not in HEADS:
        raise ValueError(f"arch must be one of {ARCHS} and head one of {HEADS}; got arch={arch!r}, head={head!r}")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, num_labels=1)  # num_labels only matters for the score head
    if arch == "gpt2":
        config = GPT2Config(n_layer=n_layer, n_embd=hidden, n_head=n_head, n_positions=max_positions,
                            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **common)
    elif arch == "opt":  # learned positions with an offset of 2
        config = OPTConfig(num_hidden_layers=n_layer, hidden_size=hidden, ffn_dim=2 * hidden, num_attention_heads=n_head,
                           max_position_embeddings=max_positions, word_embed_proj_dim=hidden, dropout=dropout,
                           attention_dropout=dropout, **common)
    elif arch == "qwen2":
        config = Qwen2Config(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_attention_heads=n_head,
                             num_key_value_heads=n_head // 2 if n_head % 2 == 0 else n_head,
                             max_position_embeddings=max_positions, attention_dropout=dropout,
                             tie_word_embeddings=tie_embeddings, **common)
    else:
        config = LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_attention_heads=n_head, num_key_value_heads=n_head,
                             max_position_embeddings=max_positions, attention_dropout=dropout,
                             tie_word_embeddings=tie_embeddings, **common)
    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = auto.from_config(config)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    return tuple(sorted({w.lower() for t in _corpus() for w in re.findall(r"[A-Za-z]{2,10}", t)}))


def tiny_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` deterministic prompts of 2-12 lower-case words from `pydoc_data.topics` (their token lengths differ)."""
    rng, words = random.Random(seed), _words()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(n)]
