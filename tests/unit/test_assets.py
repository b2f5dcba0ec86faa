"""Tiny offline tokenizers and models: exact round-trips, requested special ids, determinism, reload offline."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_engine import assets


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return assets.train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_tokenizer_round_trip_and_left_padding(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == 512 and tok.padding_side == "left"
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (0, 1, 2)
    for text in ["Hello  world ,\n\ttabs é 日本 . ' don't", " leading space", "x"]:
        ids = tok(text)["input_ids"]
        assert tok.bos_token_id not in ids  # BOS is not prepended
        assert tok.decode(ids) == text
    batch = tok(["a much longer prompt here", "a"], padding=True)
    assert batch["attention_mask"][1][0] == 0 and batch["attention_mask"][1][-1] == 1
    assert batch["input_ids"][1][0] == tok.pad_token_id


def test_tokenizer_is_deterministic(tmp_path, tok_dir):
    again = assets.train_tiny_tokenizer(str(tmp_path / "again"))
    assert open(f"{again}/tokenizer.json").read() == open(f"{tok_dir}/tokenizer.json").read()


@pytest.mark.parametrize("pad_is_eos,bos_is_pad", [(True, False), (False, True), (True, True)])
def test_tokenizer_special_roles(tmp_path, pad_is_eos, bos_is_pad):
    tok = AutoTokenizer.from_pretrained(assets.train_tiny_tokenizer(str(tmp_path), 300, pad_is_eos, bos_is_pad))
    assert len(tok) == 300 and tok.padding_side == "left"
    assert (tok.pad_token_id == tok.eos_token_id) == pad_is_eos
    assert (tok.bos_token_id == tok.pad_token_id) == bos_is_pad


def _state(path, auto):
    return auto.from_pretrained(path).state_dict()


@pytest.mark.parametrize("arch", assets.ARCHS)
@pytest.mark.parametrize("head", assets.HEADS)
def test_build_tiny_model(tmp_path, tok_dir, arch, head):
    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    rng = torch.get_rng_state()
    a = assets.build_tiny_model(str(tmp_path / "a"), tok_dir, arch=arch, head=head, dropout=0.2)
    assert torch.equal(rng, torch.get_rng_state())  # the caller's RNG is untouched
    b = assets.build_tiny_model(str(tmp_path / "b"), tok_dir, arch=arch, head=head, dropout=0.2)
    c = assets.build_tiny_model(str(tmp_path / "c"), tok_dir, arch=arch, head=head, dropout=0.2, seed=1)
    sa, sb, sc = _state(a, auto), _state(b, auto), _state(c, auto)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)

    model = auto.from_pretrained(a).eval()
    tok = AutoTokenizer.from_pretrained(a)  # the tokenizer travels with the model
    cfg = model.config
    assert cfg.vocab_size == len(tok)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (tok.pad_token_id, tok.eos_token_id,
                                                                      tok.bos_token_id)
    if arch == "gpt2":
        assert (cfg.attn_pdrop, cfg.resid_pdrop, cfg.embd_pdrop) == (0.2, 0.2, 0.2)
    else:
        assert cfg.attention_dropout == 0.2
    ids = tok(["one two three", "four"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == ((2, ids["input_ids"].shape[1], len(tok)) if head == "causal_lm" else (2, 1))


def test_tiny_prompts():
    ps = assets.tiny_prompts(20)
    assert ps == assets.tiny_prompts(20) and ps != assets.tiny_prompts(20, seed=1)
    assert all(2 <= len(p.split()) <= 12 for p in ps)
    assert len({len(p.split()) for p in ps}) > 3
