"""Shipped config files validate; a misspelt key in a copy is named with the right one; flags override a config file;
the resolved config a run saves (<output_dir>/config.json) reproduces the run."""
import glob
import json
import os

import pytest
import yaml

import launch.train_ppo as train_ppo
from rlhf_engine.cli import parse_args
from rlhf_engine.engine.ds_config import check_keys, load_json
from rlhf_engine.errors import ConfigError, Problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DS_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml")))
VOLATILE = ("time/", "throughput/", "memory/")


def test_the_shipped_files_are_found():
    assert {os.path.basename(p) for p in DS_CONFIGS} >= {"train.json", "eval.json"}
    assert {os.path.basename(p) for p in EXAMPLES} >= {"ppo_sentiment.yaml"}


@pytest.mark.parametrize("path", DS_CONFIGS, ids=os.path.basename)
def test_every_shipped_ds_config_passes_the_key_check(path):
    p = Problems()
    check_keys(load_json(path), path, p)
    assert list(p) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_every_shipped_example_validates_without_the_models(path):
    """parse_args validates the file as it is: `builtin:` names stay names (nothing is resolved or loaded)."""
    values = yaml.safe_load(open(path))
    cfg = parse_args(["--config", path])
    assert cfg.actor.model_name_or_path == values["actor_model_name_or_path"]
    assert cfg.max_steps == values["max_steps"] and cfg.run.output_dir == values["output_dir"]


def _misspell(key: str) -> str:
    """Drop one letter from the middle of the name: a typo close enough for a suggestion."""
    i = len(key) // 2
    return key[:i] + key[i + 1:]


@pytest.mark.parametrize("path", DS_CONFIGS, ids=os.path.basename)
def test_a_ds_config_copy_with_a_misspelt_key_names_the_right_one(path, tmp_path):
    for section in (None, "zero_optimization"):
        data = load_json(path)
        table = data if section is None else data[section]
        key = sorted(k for k in table if k != "zero_optimization")[0]
        table[_misspell(key)] = table.pop(key)
        copy = tmp_path / os.path.basename(path)
        copy.write_text(json.dumps(data))
        p = Problems()
        check_keys(load_json(str(copy)), str(copy), p)
        assert len(p) == 1, list(p)
        assert _misspell(key) in p[0].field and f'did you mean "{key}"' in p[0].fix, p[0]


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_an_example_copy_with_a_misspelt_key_names_the_right_one(path, tmp_path):
    values = yaml.safe_load(open(path))
    key = "actor_learning_rate" if "actor_learning_rate" in values else sorted(values)[0]
    values[_misspell(key)] = values.pop(key)
    copy = tmp_path / os.path.basename(path)
    copy.write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(copy)])
    assert len(e.value.problems) == 1, str(e.value)
    assert f'{_misspell(key)} = ' in str(e.value) and f'unknown key (did you mean "{key}"?)' in str(e.value)
    assert str(copy) in str(e.value)


# ---- flags over a config file, and the saved config reproducing the run (in-process, tiny models) -----------------
def _stable(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)} for line in f]


def test_flags_override_the_file_and_the_saved_config_reproduces_the_run(tiny, tmp_path, capsys, dist_single):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "actor_model_name_or_path": tiny.actor, "reward_model_name_or_path": tiny.reward, "data_path": tiny.prompts,
        "max_prompt_seq_len": 64, "max_answer_seq_len": 8, "per_device_generation_batch_size": 2,
        "per_device_training_batch_size": 2, "max_steps": 5, "seed": 3, "kl_coef": 0.5, "actor_learning_rate": 1e-3,
        "critic_learning_rate": 1e-3, "output_dir": str(tmp_path / "never_used")}))
    first = tmp_path / "first"
    rc = train_ppo.main(["--config", str(config), "--max_steps", "3", "--kl_coef", "0.02", "--seed", "5",
                         "--output_dir", str(first), "--num_warmup_steps", "1", "--lr_scheduler_type", "linear"])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((first / "config.json").read_text())
    # the flags won over the file; what the file alone set is kept; aliases are saved as their target fields
    assert (saved["max_steps"], saved["kl_coef"], saved["seed"], saved["output_dir"]) == (3, 0.02, 5, str(first))
    assert saved["actor_learning_rate"] == 1e-3 and saved["max_prompt_seq_len"] == 64
    assert saved["actor_num_warmup_steps"] == saved["critic_num_warmup_steps"] == 1
    assert saved["actor_lr_scheduler_type"] == saved["critic_lr_scheduler_type"] == "linear"
    assert "num_warmup_steps" not in saved and "offload" not in saved
    assert not (tmp_path / "never_used").exists()
    # the saved config alone (plus a new output_dir) runs the same run again
    again = tmp_path / "again"
    rc = train_ppo.main(["--config", str(first / "config.json"), "--output_dir", str(again)])
    assert rc == 0, capsys.readouterr().err
    a, b = _stable(first / "metrics.jsonl"), _stable(again / "metrics.jsonl")
    assert len(a) == 3 and a == b
    assert a[-1]["objective/kl"] != 0  # the actor moved (warm-up: lr 0 at the first step): not a trivial equality
