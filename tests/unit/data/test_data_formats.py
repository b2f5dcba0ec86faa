"""Prompt data sources and policies: formats, columns, templates, chat templates (no double BOS), blends, splits,
long-prompt and bad-row policies, and their config fields."""
import csv
import glob
import json
import os
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from rlhf_engine import assets
from rlhf_engine.cli import parse_args
from rlhf_engine.config import flat_dict
from rlhf_engine.config import DataConfig, TrainConfig, parse_data_sources
from rlhf_engine.data import blend_counts, load_prompt_data, load_prompt_dataset, split_indices
from rlhf_engine.errors import ConfigError, Problems

CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(assets.train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), 300))


@pytest.fixture(scope="module")
def tok_bos(tmp_path_factory):
    """Adds BOS by default AND has a chat template that starts with BOS: the double-BOS trap."""
    from tokenizers import processors

    t = AutoTokenizer.from_pretrained(assets.train_tiny_tokenizer(str(tmp_path_factory.mktemp("tokb")), 300))
    t.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", t.bos_token_id)])
    t.chat_template = CHAT
    assert t("hello")["input_ids"][0] == t.bos_token_id
    return t


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _data(**kw):
    return DataConfig(**kw)


PROMPTS = assets.tiny_prompts(8)


def test_each_format_loads_with_column_mapping(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": p, "id": i} for i, p in enumerate(PROMPTS)]
    paths = {"jsonl": _jsonl(tmp_path / "p.jsonl", rows)}
    (tmp_path / "p.json").write_text(json.dumps(rows))
    paths["json"] = str(tmp_path / "p.json")
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "p.parquet"))
    paths["parquet"] = str(tmp_path / "p.parquet")
    with open(tmp_path / "p.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, ["question", "id"])
        w.writeheader()
        w.writerows(rows)
    paths["csv"] = str(tmp_path / "p.csv")
    expected = [tok(p)["input_ids"] for p in PROMPTS]
    for fmt, path in paths.items():
        ds = load_prompt_dataset(path, tok, 200, prompt_column="question")
        assert ds.texts == PROMPTS, fmt
        assert ds.input_ids == expected, fmt
        assert ds.stats.sources[0].rows == 8 and ds.stats.sources[0].usable == 8
    with pytest.raises(ConfigError) as e:  # the default column is absent: named, with the columns there are
        load_prompt_dataset(paths["parquet"], tok, 200)
    assert "prompt_column" in str(e.value) and "'question'" in str(e.value)


def test_unknown_extension_and_hub_names(tmp_path, tok, monkeypatch):
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match="unknown file type '.txt'"):
        load_prompt_dataset(str(tmp_path / "p.txt"), tok, 10)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        load_prompt_dataset("someorg/some_prompts", tok, 10)
    assert "not in the Hugging Face datasets cache" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):  # a missing local file is never tried on the hub
        load_prompt_dataset(str(tmp_path / "missing.jsonl"), tok, 10)


def _cache_hub_dataset(cache: str, repo: str, rows: list) -> None:
    """Leave `repo` in a datasets cache the way `load_dataset(repo)` with network would (datasets 5 layout:
    <cache>/<user>___<name>/default/0.0.0/<hash>/{dataset_info.json,<name>-train.arrow}), built by datasets' own
    json builder from a local file."""
    from datasets.packaged_modules.json.json import Json

    user, name = repo.split("/")
    src = os.path.join(os.path.dirname(cache), "src.jsonl")
    with open(src, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    Json(cache_dir=cache, dataset_name=name, config_name="default", hash="0123abcd",
         data_files={"train": src}).download_and_prepare()
    built = glob.glob(os.path.join(cache, name, "default*", "0.0.0", "0123abcd"))[0]
    target = os.path.join(cache, f"{user}___{name}", "default", "0.0.0")
    os.makedirs(target)
    shutil.move(built, target)


def test_hub_dataset_read_from_the_local_cache_when_offline(tmp_path, tok, monkeypatch):
    import datasets

    cache = str(tmp_path / "hf_datasets")
    _cache_hub_dataset(cache, "someorg/cached_prompts", [{"prompt": "first cached prompt"}, {"prompt": "second one"}])
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ds = load_prompt_dataset("someorg/cached_prompts", tok, 200)
    assert ds.texts == ["first cached prompt", "second one"]
    assert ds.input_ids[0] == tok("first cached prompt")["input_ids"]
    with pytest.raises(ConfigError, match="not in the Hugging Face datasets cache"):  # negative control: not cached
        load_prompt_dataset("someorg/other_prompts", tok, 200)


def test_save_to_disk_folders(tmp_path, tok):
    import datasets

    rows = {"prompt": ["saved one", "saved two", "saved three"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict({"prompt": ["held out"]})}).save_to_disk(
        str(tmp_path / "dd"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "no_train"))
    (tmp_path / "plain").mkdir()
    assert load_prompt_dataset(str(tmp_path / "ds"), tok, 200).texts == rows["prompt"]
    assert load_prompt_dataset(str(tmp_path / "dd"), tok, 200).texts == rows["prompt"]  # its train split
    with pytest.raises(ConfigError, match=r"no 'train' split \(its splits: \['validation'\]\)"):
        load_prompt_dataset(str(tmp_path / "no_train"), tok, 200)
    with pytest.raises(ConfigError, match="is a directory but not one written by datasets' save_to_disk"):
        load_prompt_dataset(str(tmp_path / "plain"), tok, 200)


def test_prompt_template(tmp_path, tok):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": p, "topic": f"t{i}"} for i, p in enumerate(PROMPTS)])
    tpl = "Topic {topic}.\nQuestion: {prompt}\nAnswer: {{json}}"
    ds = load_prompt_dataset(path, tok, 200, prompt_template=tpl)
    rendered = [f"Topic t{i}.\nQuestion: {p}\nAnswer: {{json}}" for i, p in enumerate(PROMPTS)]
    assert ds.input_ids == [tok(r)["input_ids"] for r in rendered]
    assert ds.texts == PROMPTS  # the raw prompts, for logging
    with pytest.raises(ConfigError, match=r"fields \['nope'\] are no columns"):
        load_prompt_dataset(path, tok, 200, prompt_template="{nope}: {prompt}")
    p = Problems()
    DataConfig(prompt_template="Q: {question}").validate(p)
    DataConfig(prompt_template="Q: {} {prompt}").validate(p)
    DataConfig(prompt_template="Q: {prompt").validate(p)
    assert [x.field for x in p] == ["prompt_template"] * 3
    assert "must contain {prompt}" in p[0].fix and "positional" in p[1].fix and "not a valid format" in p[2].fix


def test_chat_template_adds_bos_once(tmp_path, tok_bos, tok):
    bos = tok_bos.bos_token_id
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    ds = load_prompt_dataset(path, tok_bos, 200, use_chat_template=True, prompt_template="Q: {prompt}")
    for ids, p in zip(ds.input_ids, PROMPTS):
        text = f"<s><|user|>Q: {p}\n<|assistant|>"
        assert tok_bos.apply_chat_template([{"role": "user", "content": f"Q: {p}"}], tokenize=False,
                                           add_generation_prompt=True) == text
        assert ids == tok_bos(text, add_special_tokens=False)["input_ids"]
        assert ids[0] == bos and ids[1] != bos and ids.count(bos) == 1
        assert tok_bos(text)["input_ids"][:2] == [bos, bos]  # negative control: the naive way doubles it
    plain = load_prompt_dataset(path, tok_bos, 200)  # no chat template: the tokenizer's own BOS, once
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in plain.input_ids)
    with pytest.raises(ConfigError, match="has no chat_template"):
        load_prompt_dataset(path, tok, 200, use_chat_template=True)


def _two_sources(tmp_path, n_a=14, n_b=100):
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i} x"} for i in range(n_a)])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i} y"} for i in range(n_b)])
    return a, b


def test_blend_ratios_exact_and_deterministic(tmp_path, tok):
    assert blend_counts([7, 100], ["0.7", "0.3"]) == [7, 3]
    assert blend_counts([3, 1000], [1, 2]) == [3, 6]  # N = 9: source a is used up
    assert blend_counts([10, 10], [0.5, 0.5]) == [10, 10]
    assert blend_counts([100, 100], [0.7, 0.3]) == [99, 43]  # N = floor(100/0.7) = 142: 99.4 -> 99, 42.6 -> 43
    a, b = _two_sources(tmp_path)
    ds = load_prompt_dataset(f"{a}:0.7,{b}:0.3", tok, 50, seed=5)
    # weights 0.7/0.3: N = min(floor(14/0.7), floor(100/0.3)) = 20 -> 14 from a, 6 from b
    assert [s.selected for s in ds.stats.sources] == [14, 6] and len(ds) == 20
    assert ds.texts[:14] == [f"a{i} x" for i in range(14)]
    want_b = sorted(torch.randperm(100, generator=torch.Generator().manual_seed(5 + 2))[:6].tolist())
    assert ds.texts[14:] == [f"b{i} y" for i in want_b]  # the documented rule, reproduced by hand
    again = load_prompt_dataset([f"{a}:0.7", [b, 0.3]], tok, 50, seed=5)  # list form, same draw
    assert again.texts == ds.texts and again.input_ids == ds.input_ids
    other = load_prompt_dataset(f"{a}:0.7,{b}:0.3", tok, 50, seed=6)
    assert other.texts[:14] == ds.texts[:14] and other.texts[14:] != ds.texts[14:]
    both = load_prompt_dataset(f"{a},{b}", tok, 50)  # no ratios: each in full
    assert len(both) == 114 and [s.selected for s in both.stats.sources] == [14, 100]
    # data_seed overrides the run seed
    cfg = _data(data_path=f"{a}:0.7,{b}:0.3", data_seed=5)
    assert load_prompt_data(cfg, tok, 50, seed=999).train.texts == ds.texts


def test_parse_data_sources():
    from fractions import Fraction

    assert parse_data_sources("a.jsonl:0.7, b.csv:0.3") == [("a.jsonl", Fraction(7, 10)), ("b.csv", Fraction(3, 10))]
    assert parse_data_sources("org/name,c.parquet") == [("org/name", None), ("c.parquet", None)]
    assert parse_data_sources(["C:\\data\\a.jsonl"]) == [("C:\\data\\a.jsonl", None)]
    for bad, msg in [("a:0.7,b", "for every source"), ("a:0", "must be > 0"), ("a,,b", "empty entry"),
                     ([["a", "x"]], "not a number")]:
        with pytest.raises(ValueError, match=msg):
            parse_data_sources(bad)


def test_split_deterministic_and_disjoint(tmp_path, tok):
    a, _ = _two_sources(tmp_path, n_a=20)
    cfg = _data(data_path=a, eval_split=0.25)
    d1 = load_prompt_data(cfg, tok, 50, seed=3)
    d2 = load_prompt_data(cfg, tok, 50, seed=3)
    assert len(d1.eval) == 5 and len(d1.train) == 15 and (d1.stats.train, d1.stats.eval) == (15, 5)
    assert d1.train.texts == d2.train.texts and d1.eval.texts == d2.eval.texts
    assert set(d1.train.texts).isdisjoint(d1.eval.texts) and len(set(d1.train.texts) | set(d1.eval.texts)) == 20
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(3)).tolist()
    assert d1.eval.texts == [f"a{i} x" for i in sorted(perm[:5])]  # the documented rule
    d3 = load_prompt_data(_data(data_path=a, eval_split=0.25, data_seed=4), tok, 50, seed=3)
    assert d3.eval.texts != d1.eval.texts
    assert load_prompt_data(_data(data_path=a), tok, 50).eval is None
    assert split_indices(10, 0.01, 0)[1] != [] and len(split_indices(10, 0.01, 0)[1]) == 1  # at least one
    tiny = _jsonl(tmp_path / "one.jsonl", [{"prompt": "x"}])
    with pytest.raises(ConfigError, match="eval_split"):
        load_prompt_data(_data(data_path=tiny, eval_split=0.5), tok, 50)


def test_long_prompt_policies(tmp_path, tok, tok_bos):
    long = " ".join(["parameter"] * 30)
    rows = [{"prompt": "short one"}, {"prompt": long}, {"prompt": "short two"}, {"prompt": long + " again"}]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    n_long = len(tok(long)["input_ids"])
    limit = 10
    assert n_long > limit
    with pytest.raises(ConfigError) as e:
        load_prompt_dataset(path, tok, limit)
    assert "2 prompt(s)" in str(e.value) and "long_prompt_policy" in str(e.value) and "row 1 " in str(e.value)
    skipped = load_prompt_dataset(path, tok, limit, long_prompt_policy="skip")
    assert skipped.texts == ["short one", "short two"] and skipped.stats.sources[0].too_long_skipped == 2
    assert skipped.stats.totals()["data/too_long_skipped"] == 2
    cut = load_prompt_dataset(path, tok, limit, long_prompt_policy="truncate_left")
    assert len(cut) == 4 and cut.stats.sources[0].truncated == 2 and cut.stats.sources[0].too_long_skipped == 0
    full = tok(long + " again")["input_ids"]
    assert cut.input_ids[3] == full[-limit:] and cut.attention_mask[3] == [1] * limit
    assert cut.input_ids[0] == tok("short one")["input_ids"]
    # a leading BOS is kept: BOS + the last limit-1 tokens
    cut_bos = load_prompt_dataset(path, tok_bos, limit, long_prompt_policy="truncate_left")
    full_bos = tok_bos(long + " again")["input_ids"]
    assert cut_bos.input_ids[3] == [tok_bos.bos_token_id] + full_bos[-(limit - 1):]


def test_bad_rows_counted_or_named(tmp_path, tok, caplog):
    lines = [b'{"prompt": "good zero"}', b'{"prompt": "bad \xff\xfe bytes"}', b"", b'{"prompt": ""}',
             b'{"prompt": "good three"}', b"{not json", b'{"prompt": null}', b'{"other": "x"}', b'{"prompt": 7}',
             b"[1, 2]", b'{"prompt": "   "}', b'{"prompt": "good ten \xc3\xa9"}', b'{"prompt": "bad \xc3"}']
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    # rows (0-based, the blank line is no row): 0 good, 1 non-UTF-8, 2 empty, 3 good, 4 malformed, 5 null,
    # 6 missing, 7 non-text, 8 not an object, 9 blank, 10 good, 11 non-UTF-8 (cut multi-byte char)
    with caplog.at_level("WARNING", logger="rlhf_engine.data"):
        ds = load_prompt_dataset(str(path), tok, 50, bad_row_policy="skip")
    assert ds.texts == ["good zero", "good three", "good ten é"]
    s = ds.stats.sources[0]
    assert (s.rows, s.non_utf8, s.malformed, s.empty, s.not_text, s.usable) == (12, 2, 2, 4, 1, 3)
    assert ds.stats.totals()["data/bad_rows_skipped"] == 9
    assert "skipped 2 invalid UTF-8, 2 invalid JSON, 1 non-text, 4 empty" in caplog.text
    with pytest.raises(ConfigError) as e:  # error policy: every kind named at once, with its rows
        load_prompt_dataset(str(path), tok, 50)
    fixes = [p.fix for p in e.value.problems]
    assert len(fixes) == 4
    assert "1, 11 are not valid UTF-8" in fixes[0] and "4, 8 are not JSON objects" in fixes[1]
    assert "rows (0-based) 7 is not a string" in fixes[2] and "2, 5, 6, 9 hold an empty prompt" in fixes[3]
    assert all("bad_row_policy=skip" in f for f in fixes)
    allbad = tmp_path / "allbad.jsonl"
    allbad.write_bytes(b'{"prompt": "\xff"}\n{oops\n')
    with pytest.raises(ConfigError, match="no usable prompts"):
        load_prompt_dataset(str(allbad), tok, 50, bad_row_policy="skip")


def test_config_fields_and_flags(tmp_path):
    cfg = parse_args(["--actor_model_name_or_path", "m", "--data_path", "a.jsonl:0.7,b.jsonl:0.3", "--eval_split",
                      "0.1", "--long_prompt_policy", "skip", "--bad_row_policy", "skip", "--use_chat_template",
                      "--prompt_template", "Q: {prompt}", "--data_seed", "7", "--wandb_project", "p",
                      "--tensorboard", "--overwrite_output_dir"])
    assert cfg.data == DataConfig("a.jsonl:0.7,b.jsonl:0.3", "prompt", "Q: {prompt}", True, 0.1, "skip", "skip", 7)
    assert cfg.data_path == cfg.data.data_path and cfg.logging.wandb_project == "p" and cfg.logging.tensorboard
    assert cfg.run.overwrite_output_dir is True and cfg.run.resume == ""
    flat = flat_dict(cfg)
    assert flat["data_path"] == "a.jsonl:0.7,b.jsonl:0.3" and flat["wandb_sample_interval"] == 10
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("actor_model_name_or_path: m\ndata_path: [a.jsonl:0.5, b.jsonl:0.5]\nresume: auto\n")
    cfg = parse_args(["--config", str(yaml_file)])
    assert cfg.data_path == ["a.jsonl:0.5", "b.jsonl:0.5"] and cfg.run.resume == "auto"
    bad = TrainConfig()
    bad.actor.model_name_or_path = "m"
    bad.data = DataConfig(data_path="a:0.5,b", eval_split=1.0, long_prompt_policy="cut", bad_row_policy="ignore")
    bad.logging.wandb_sample_interval = 0
    bad.run.resume, bad.run.overwrite_output_dir = "auto", True
    with pytest.raises(ConfigError) as e:
        bad.validate()
    assert {p.field for p in e.value.problems} == {"data_path", "eval_split", "long_prompt_policy", "bad_row_policy",
                                                   "wandb_sample_interval", "overwrite_output_dir"}
