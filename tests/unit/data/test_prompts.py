"""Prompt data: every user error reported at once, deterministic sharded sampling, left-padded collation."""
import json

import pytest
import torch
from transformers import AutoTokenizer

from rlhf_engine import assets
from rlhf_engine.data import PromptSampler, collate_prompts, load_prompt_dataset
from rlhf_engine.errors import ConfigError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(assets.train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), 300))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _error(*args, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        load_prompt_dataset(*args, **kw)
    return str(e.value)


def test_loads_and_tokenizes_once(tmp_path, tok):
    prompts = assets.tiny_prompts(6)
    ds = load_prompt_dataset(_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "id": i} for i, p in enumerate(prompts)]),
                             tok, max_prompt_seq_len=200)
    assert len(ds) == 6 and ds.texts == prompts
    assert ds.input_ids == [tok(p)["input_ids"] for p in prompts]
    assert ds.attention_mask == [[1] * len(ids) for ids in ds.input_ids]
    other = tmp_path / "p.json"
    other.write_text(json.dumps([{"text": p} for p in prompts]))
    assert load_prompt_dataset(str(other), tok, 200, prompt_column="text").input_ids == ds.input_ids


def test_file_errors(tmp_path, tok):
    msg = _error(str(tmp_path / "missing.jsonl"), tok, 10)
    assert "data_path" in msg and "missing.jsonl" in msg and "does not exist" in msg
    for name, text in [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("arr.json", "[]")]:
        (tmp_path / name).write_text(text)
        msg = _error(str(tmp_path / name), tok, 10)
        assert "data_path" in msg and "no rows" in msg
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    assert "could not be read" in _error(str(tmp_path / "bad.jsonl"), tok, 10)


def test_missing_column_names_existing_ones(tmp_path, tok):
    msg = _error(_jsonl(tmp_path / "p.jsonl", [{"question": "a b", "answer": "c"}]), tok, 10)
    assert "prompt_column" in msg and "'question'" in msg and "'answer'" in msg


def test_all_row_problems_in_one_error(tmp_path, tok):
    long = " ".join(["parameter"] * 40)
    rows = [{"prompt": "fine"}, {"prompt": ""}, {"prompt": long}, {"prompt": "   "}, {"prompt": None},
            {"other": "x"}] + [{"prompt": long}] * 6
    with pytest.raises(ConfigError) as e:
        load_prompt_dataset(_jsonl(tmp_path / "p.jsonl", rows), tok, max_prompt_seq_len=20)
    msg, problems = str(e.value), e.value.problems
    assert len(problems) == 2 and "2 problems" in msg
    empty, too_long = problems
    assert empty.field == "data_path" and "1, 3, 4, 5" in empty.fix
    assert too_long.field == "max_prompt_seq_len" and too_long.value == 20
    n = len(tok(long)["input_ids"])
    assert "7 prompt(s)" in too_long.fix and f"row 2 ({n} tokens)" in too_long.fix and "row 9 " in too_long.fix
    assert "row 10 " not in too_long.fix and "2 more" in too_long.fix  # the first 5 are named
    assert "raise max_prompt_seq_len or shorten/remove those prompts" in too_long.fix


def test_sampler_shards_one_epoch():
    n, b, w = 37, 3, 4
    samplers = [PromptSampler(n, b, r, w, seed=7) for r in range(w)]
    bpe = samplers[0].batches_per_epoch
    assert bpe == 3 and samplers[0].dropped_per_epoch == 37 - 36
    shards = [[i for k in range(bpe) for i in s.indices(0, k)] for s in samplers]
    seen = [i for sh in shards for i in sh]
    assert len(seen) == len(set(seen)) == bpe * b * w and set(seen) <= set(range(n))
    for k in range(bpe):  # batch k of rank r is slice r of global batch k
        perm = samplers[0].permutation(0)
        assert sum((s.indices(0, k) for s in samplers), []) == perm[k * b * w: (k + 1) * b * w]


def test_sampler_order_depends_on_seed_and_epoch():
    a, same, other = PromptSampler(50, 4, 1, 2, 3), PromptSampler(50, 4, 1, 2, 3), PromptSampler(50, 4, 1, 2, 4)
    assert a.indices(0, 2) == same.indices(0, 2)
    assert a.indices(0, 2) != other.indices(0, 2)
    assert [a.indices(0, k) for k in range(a.batches_per_epoch)] != [a.indices(1, k) for k in range(a.batches_per_epoch)]
    assert a.permutation(5) == torch.randperm(50, generator=torch.Generator().manual_seed(8)).tolist()


def test_sampler_drop_count_and_resume():
    s = PromptSampler(10, 2, 0, 2, seed=0)
    assert (s.batches_per_epoch, s.dropped_per_epoch) == (2, 2)
    it = s.iter_from()
    first = [next(it) for _ in range(5)]
    assert [(e, k) for e, k, _ in first] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    resumed = s.iter_from(1, 1)
    assert [next(resumed) for _ in range(2)] == first[3:5]
    with pytest.raises(IndexError):
        s.indices(0, 2)
    full = [PromptSampler(10, 2, r, 2, seed=0, drop_last=False) for r in range(2)]
    assert (full[0].batches_per_epoch, full[0].dropped_per_epoch) == (3, 0)
    epoch = [i for s in full for k in range(3) for i in s.indices(0, k)]
    assert len(epoch) == 12 and set(epoch) == set(range(10))


def test_sampler_too_few_prompts():
    with pytest.raises(ConfigError) as e:
        PromptSampler(5, 4, 0, 2, seed=0)
    msg = str(e.value)
    assert "per_device_generation_batch_size" in msg and "5 prompts" in msg and "4 x 2 ranks = 8" in msg
    assert "lower it to 2" in msg


def test_collate_left_pads(tmp_path, tok):
    prompts = assets.tiny_prompts(8, seed=3)
    ds = load_prompt_dataset(_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompts]), tok, 200)
    idx = [5, 0, 3]
    ids, mask = collate_prompts(ds, idx, tok.pad_token_id)
    P = max(len(ds.input_ids[i]) for i in idx)
    want_ids = [[tok.pad_token_id] * (P - len(ds.input_ids[i])) + ds.input_ids[i] for i in idx]
    want_mask = [[0] * (P - len(ds.input_ids[i])) + [1] * len(ds.input_ids[i]) for i in idx]
    assert ids.dtype == mask.dtype == torch.long
    assert ids.tolist() == want_ids and mask.tolist() == want_mask
    assert len({len(ds.input_ids[i]) for i in idx}) > 1  # the padding is exercised
