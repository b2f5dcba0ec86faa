"""Data columns kept for a reward function: aligned with their prompts through blending and the eval split, part of
the tokenized-data cache's key, missing required columns named before anything else."""
import json

import pytest
from transformers import AutoTokenizer

from rlhf_engine import assets
from rlhf_engine.config import DataConfig
from rlhf_engine.data import ColumnRequest, load_prompt_data
from rlhf_engine.errors import ConfigError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(assets.train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), 300))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(tag, n, **extra):
    return [{"prompt": f"{tag} question {i}", "answer": f"{tag}-{i}", **{k: f"{v}{i}" for k, v in extra.items()}}
            for i in range(n)]


def _answer_of(text):  # what _rows put beside each prompt
    tag, _, i = text.split()
    return f"{tag}-{i}"


def test_columns_follow_their_rows_through_blend_and_split(tmp_path, tok):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 10, level="x"))
    b = _jsonl(tmp_path / "b.jsonl", _rows("b", 20))  # no "level"
    data = DataConfig(data_path=f"{a}:0.5,{b}:0.5", eval_split=0.2, data_cache_dir="none")
    out = load_prompt_data(data, tok, 64, seed=3, columns=ColumnRequest(("answer",), ("level",)))
    for ds in (out.train, out.eval):
        assert set(ds.columns) == {"answer"}  # "level" is optional and one source lacks it: not kept
        assert ds.columns["answer"] == [_answer_of(t) for t in ds.texts]
    rows = out.train.rows([2, 0], repeat=3)  # a prompt's N samples each carry its row
    assert [r.columns["answer"] for r in rows] == [_answer_of(out.train.texts[2])] * 3 + [
        _answer_of(out.train.texts[0])] * 3
    every = load_prompt_data(DataConfig(data_path=a, data_cache_dir="none"), tok, 64,
                             columns=ColumnRequest(all_columns=True)).train
    assert set(every.columns) == {"answer", "level"}  # **kwargs: all but the prompt column
    assert load_prompt_data(DataConfig(data_path=a, data_cache_dir="none"), tok, 64).train.columns == {}


def test_a_missing_required_column_names_it_and_the_source(tmp_path, tok):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 4))
    with pytest.raises(ConfigError) as e:
        load_prompt_data(DataConfig(data_path=a, data_cache_dir="none"), tok, 64,
                         columns=ColumnRequest(("answer", "solution")))
    msg = str(e.value)
    assert "reward_fn" in msg and "['solution']" in msg and a in msg and "'answer'" in msg


def test_columns_are_part_of_the_cache_key_and_survive_it(tmp_path, tok):
    a = _jsonl(tmp_path / "a.jsonl", _rows("a", 8))
    data = DataConfig(data_path=a, data_cache_dir=str(tmp_path / "cache"), eval_split=0.25)
    plain = load_prompt_data(data, tok, 64)
    first = load_prompt_data(data, tok, 64, columns=ColumnRequest(("answer",)))
    again = load_prompt_data(data, tok, 64, columns=ColumnRequest(("answer",)))
    assert (plain.cache.status, first.cache.status, again.cache.status) == ("built", "built", "read")
    assert plain.train.columns == {} and again.train.columns == first.train.columns
    assert again.eval.columns["answer"] == [_answer_of(t) for t in again.eval.texts]
