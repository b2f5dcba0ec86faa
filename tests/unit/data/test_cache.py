"""The tokenized-data cache: a second load reads what the first built, equal to an uncached load; every input the
result depends on is in the key; broken or unwritable caches never break a run; errors are never cached."""
import dataclasses
import json
import logging
import os
import shutil

import pytest
from transformers import AutoTokenizer

from rlhf_engine import assets
from rlhf_engine.config import DataConfig
from rlhf_engine.data import cache as cache_mod
from rlhf_engine.data import load_prompt_data, load_sft_data
from rlhf_engine.errors import ConfigError


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return assets.train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), 300)


@pytest.fixture()
def tok(tok_dir):  # a fresh instance per test: some tests change it
    return AutoTokenizer.from_pretrained(tok_dir)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _data(tmp_path, n=12, **kw):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": p, "response": p[::-1]} for p in assets.tiny_prompts(n)])
    return DataConfig(data_path=path, data_cache_dir=str(tmp_path / "cache"), eval_split=0.25, **kw)


def _same(a, b):
    for x, y in ((a.train, b.train), (a.eval, b.eval)):
        assert (x.input_ids, x.attention_mask, x.texts, x.extra) == (y.input_ids, y.attention_mask, y.texts, y.extra)
    assert a.stats == b.stats


def test_second_load_reads_the_entry_and_equals_an_uncached_load(tmp_path, tok):
    data = _data(tmp_path)
    first = load_prompt_data(data, tok, 200, seed=3)
    second = load_prompt_data(data, tok, 200, seed=3)
    plain = load_prompt_data(dataclasses.replace(data, data_cache_dir="none"), tok, 200, seed=3)
    assert (first.cache.status, second.cache.status, plain.cache.status) == ("built", "read", "off")
    assert second.cache.path == first.cache.path and os.path.dirname(first.cache.path) == data.data_cache_dir
    assert len(second.train) == 9 and len(second.eval) == 3
    _same(first, plain)
    _same(second, plain)
    assert os.listdir(data.data_cache_dir) == [os.path.basename(first.cache.path)]  # no temporary file left


def test_sft_payloads_are_cached_and_keyed_on_the_hook_settings(tmp_path, tok):
    data = _data(tmp_path)
    a = load_sft_data(data, tok, 200, 200)
    b = load_sft_data(data, tok, 200, 200)
    assert (a.cache.status, b.cache.status) == ("built", "read") and b.train.extra["response"]
    _same(a, b)
    c = load_sft_data(data, tok, 200, 5, long_response_policy="truncate")  # another hook setting: another entry
    assert c.cache.status == "built" and max(map(len, c.train.extra["response"])) == 5
    assert load_prompt_data(data, tok, 200).cache.status == "built"  # no hook is not the SFT hook


def _change_file(data, tok, tmp_path):
    rows = [{"prompt": p, "response": "r"} for p in assets.tiny_prompts(12)]
    rows[0]["prompt"] = "a changed first prompt"
    _jsonl(tmp_path / "p.jsonl", rows)
    return data, tok


def _change_tokenizer(data, tok, tmp_path):
    tok.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    return data, tok


def _change_chat_template(data, tok, tmp_path):
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return data, tok


CHANGES = {
    "file content": _change_file,
    "tokenizer vocabulary": _change_tokenizer,
    "chat template": _change_chat_template,
    "prompt_template": lambda d, t, _: (dataclasses.replace(d, prompt_template="Q: {prompt}"), t),
    "eval_split": lambda d, t, _: (dataclasses.replace(d, eval_split=0.5), t),
    "data_seed": lambda d, t, _: (dataclasses.replace(d, data_seed=99), t),
    "long_prompt_policy": lambda d, t, _: (dataclasses.replace(d, long_prompt_policy="skip"), t),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_input_is_in_the_key(tmp_path, tok, change):
    data = _data(tmp_path)
    assert load_prompt_data(data, tok, 200).cache.status == "built"
    data2, tok2 = CHANGES[change](data, tok, tmp_path)
    changed = load_prompt_data(data2, tok2, 200)
    assert changed.cache.status == "built"
    _same(changed, load_prompt_data(dataclasses.replace(data2, data_cache_dir="none"), tok2, 200))


def test_max_prompt_seq_len_and_seed_are_in_the_key(tmp_path, tok):
    data = _data(tmp_path)
    load_prompt_data(data, tok, 200, seed=1)
    assert load_prompt_data(data, tok, 199, seed=1).cache.status == "built"
    assert load_prompt_data(data, tok, 200, seed=2).cache.status == "built"
    assert load_prompt_data(data, tok, 200, seed=1).cache.status == "read"


def test_negative_control_without_the_file_digest_a_changed_file_reads_stale_prompts(tmp_path, tok, monkeypatch):
    data = _data(tmp_path)
    monkeypatch.setattr(cache_mod, "file_digest", lambda path: "same")  # the wrong variant: path-only keys
    before = load_prompt_data(data, tok, 200)
    _change_file(data, tok, tmp_path)
    stale = load_prompt_data(data, tok, 200)
    assert stale.cache.status == "read" and "a changed first prompt" not in stale.train.texts + stale.eval.texts
    assert stale.train.texts == before.train.texts


def test_a_corrupt_entry_is_rebuilt_with_a_warning(tmp_path, tok, caplog):
    data = _data(tmp_path)
    good = load_prompt_data(data, tok, 200)
    with open(good.cache.path, "r+b") as f:
        f.truncate(os.path.getsize(good.cache.path) // 2)
    with caplog.at_level(logging.WARNING, logger="rlhf_engine.data"):
        again = load_prompt_data(data, tok, 200)
    assert again.cache.status == "built" and "unreadable" in caplog.text and good.cache.path in caplog.text
    _same(again, good)
    assert load_prompt_data(data, tok, 200).cache.status == "read"  # rewritten whole


def test_an_unwritable_cache_dir_warns_and_still_loads(tmp_path, tok, caplog):
    (tmp_path / "a_file").write_text("not a folder")
    data = dataclasses.replace(_data(tmp_path), data_cache_dir=str(tmp_path / "a_file" / "cache"))
    with caplog.at_level(logging.WARNING, logger="rlhf_engine.data"):
        out = load_prompt_data(data, tok, 200)
    assert out.cache.status == "built_unsaved" and "data_cache_dir" in caplog.text
    _same(out, load_prompt_data(dataclasses.replace(data, data_cache_dir="none"), tok, 200))


def test_errors_are_not_cached(tmp_path, tok):
    data = _data(tmp_path)
    for _ in range(2):  # the second load fails the same way: nothing was stored
        with pytest.raises(ConfigError, match="longer than 2 tokens"):
            load_prompt_data(data, tok, 2)
    assert not os.path.exists(data.data_cache_dir) or not os.listdir(data.data_cache_dir)


def test_none_turns_it_off_and_the_default_follows_the_environment(tmp_path, tok, monkeypatch):
    data = dataclasses.replace(_data(tmp_path), data_cache_dir="none")
    assert load_prompt_data(data, tok, 200).cache.status == "off" and not (tmp_path / "cache").exists()
    monkeypatch.setenv("RLHF_ENGINE_DATA_CACHE", str(tmp_path / "env_cache"))
    out = load_prompt_data(dataclasses.replace(data, data_cache_dir=""), tok, 200)
    assert out.cache.status == "built" and out.cache.path.startswith(str(tmp_path / "env_cache"))
    monkeypatch.delenv("RLHF_ENGINE_DATA_CACHE")
    monkeypatch.setenv("RLHF_ENGINE_CACHE", str(tmp_path / "root"))
    assert cache_mod.resolve_cache_dir("") == str(tmp_path / "root" / "tokenized")


def test_sources_that_cannot_be_keyed_are_not_cached(tmp_path, tok):
    assert cache_mod.cache_key("prompts", ["some/hub_dataset"], tok, {}) is None  # not a local file

    class NoBackend:  # a tokenizer without a serializable fast backend (a Python-only tokenizer)
        pass

    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    assert cache_mod.cache_key("prompts", [path], NoBackend(), {}) is None
    assert cache_mod.cache_key("prompts", [path], tok, {}) is not None


def test_a_row_hook_without_a_cache_key_turns_the_cache_off(tmp_path, tok):
    def hook(raw, prep, stats, p):
        return prep

    assert load_prompt_data(_data(tmp_path), tok, 200, row_hook=hook).cache.status == "uncacheable"


def test_a_save_to_disk_folder_is_keyed_on_its_files(tmp_path, tok):
    import datasets

    folder = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"prompt": assets.tiny_prompts(6)}).save_to_disk(folder)
    data = DataConfig(data_path=folder, data_cache_dir=str(tmp_path / "cache"))
    assert load_prompt_data(data, tok, 200).cache.status == "built"
    assert load_prompt_data(data, tok, 200).cache.status == "read"
    datasets.Dataset.from_dict({"prompt": assets.tiny_prompts(5)}).save_to_disk(str(tmp_path / "other"))
    shutil.rmtree(folder)
    shutil.move(str(tmp_path / "other"), folder)  # same path, other rows
    again = load_prompt_data(data, tok, 200)
    assert again.cache.status == "built" and len(again.train) == 5
