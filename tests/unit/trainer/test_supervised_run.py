"""launch/train_sft.py and launch/train_reward.py on one in-process rank: user errors exit 2 before any weight is read,
the output-directory policy, and the run files (the 2-rank learning checks are in tests/distributed/test_sft_reward.py).
"""
import dataclasses
import importlib.util
import json
import os

import pytest

from rlhf_engine.config import RewardTrainConfig, SFTConfig, SupervisedConfig
from rlhf_engine.outputs.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _main(name):
    spec = importlib.util.spec_from_file_location(name[:-3] + "_entry", os.path.join(ROOT, "launch", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _args(**kw):
    out = []
    for k, v in kw.items():
        out += [f"--{k}", str(v)]
    return out


def test_every_new_field_has_help_text():
    for cls in (SupervisedConfig, SFTConfig, RewardTrainConfig):
        for f in dataclasses.fields(cls):
            assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), f"{cls.__name__}.{f.name}"


def test_sft_run_files_export_and_output_dir_policy(tiny, dist_single, tmp_path, capsys):
    sft = _main("train_sft.py")
    data = _jsonl(tmp_path / "sft.jsonl", [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(10)])
    out = str(tmp_path / "run")
    argv = _args(model_name_or_path=tiny.actor, data_path=data, output_dir=out, per_device_training_batch_size=2,
                 eval_split=0.2, max_prompt_seq_len=32, max_answer_seq_len=16, learning_rate=1e-3)
    assert sft(argv) == 0
    recs = read_metrics(out)
    # 8 train rows / 2 per step = 4 steps; the last carries the evaluation
    assert [r["iteration"] for r in recs] == [0, 1, 2, 3] and "sft/eval_loss" in recs[-1]
    for name in ("config.json", "command.txt", "ds_config_actor.json", "metrics.png", "model/config.json",
                 "model/tokenizer.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    # a second run into the same folder is refused, naming the fixes
    capsys.readouterr()
    assert sft(argv) == 2
    err = capsys.readouterr().err
    assert "holds another run" in err and "--overwrite_output_dir" in err
    # --overwrite_output_dir keeps the previous run's files (the model included), renamed *.bak
    assert sft(argv + ["--overwrite_output_dir"]) == 0
    names = os.listdir(out)
    assert any(n.startswith("model.") and n.endswith(".bak") for n in names)
    assert any(n.startswith("metrics.jsonl.") and n.endswith(".bak") for n in names)
    assert len(read_metrics(out)) == 4


def test_user_errors_exit_2_before_any_model_is_built(tiny, dist_single, tmp_path, capsys):
    sft, reward = _main("train_sft.py"), _main("train_reward.py")
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "a"}] * 3)
    # a missing column: named with the file and the flag that selects another
    assert sft(_args(model_name_or_path=tiny.actor, data_path=data, output_dir=str(tmp_path / "a"),
                     max_prompt_seq_len=16, max_answer_seq_len=8)) == 2
    err = capsys.readouterr().err
    assert "response_column = 'response': no such column" in err and data in err
    assert not os.path.exists(tmp_path / "a")  # nothing written
    # too few rows for one global mini-batch: the batch flags are named
    ok = _jsonl(tmp_path / "ok.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3)
    assert reward(_args(model_name_or_path=tiny.actor, data_path=ok, output_dir=str(tmp_path / "b"),
                        per_device_training_batch_size=4, max_prompt_seq_len=16, max_answer_seq_len=8)) == 2
    err = capsys.readouterr().err
    assert "per_device_training_batch_size x gradient_accumulation_steps = 4: 3 prompts cannot fill" in err
    # the model cannot hold prompt + response, and a stage without offload: one error, both problems
    assert reward(_args(model_name_or_path=tiny.actor, data_path=ok, output_dir=str(tmp_path / "c"),
                        max_prompt_seq_len=200, max_answer_seq_len=100, offload="true")) == 2
    err = capsys.readouterr().err
    assert "max_prompt_seq_len + max_answer_seq_len = 300" in err and "offload = True" in err
    with pytest.raises(SystemExit):
        reward(["--model_name_or_path", tiny.actor, "--kl_coef", "0.1"])  # a PPO flag is no reward-model flag
