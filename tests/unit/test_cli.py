"""The command line and config files generated from the config dataclasses (field name = flag = config-file key)."""
import dataclasses
import json

import pytest
import yaml

from rlhf_engine.cli import build_parser, parse_args
from rlhf_engine.config import flat_dict
from rlhf_engine.config import TrainConfig
from rlhf_engine.engine.generation.choice import resolve_auto
from rlhf_engine.errors import ConfigError

BASE = ["--actor_model_name_or_path", "some/actor"]


def test_flags_map_to_nested_fields():
    cfg = parse_args(BASE + ["--actor_learning_rate", "0.1", "--kl_coef", "0.05", "--generation_batches", "2",
                             "--do_sample", "false", "--reward_zero_stage", "3", "--critic_offload",
                             "--stop_token_ids", "7", "8", "--max_steps", "3", "--dtype", "bf16"])
    assert cfg.actor.learning_rate == 0.1 and cfg.critic.learning_rate == 1e-6  # only the actor's
    assert cfg.ppo.kl_coef == 0.05
    assert cfg.batch.generation_batches == 2 and isinstance(cfg.batch.generation_batches, int)
    assert cfg.generation.do_sample is False
    assert cfg.reward.zero_stage == 3 and cfg.reference.zero_stage is None
    assert cfg.critic.offload is True  # a bare bool flag means true
    assert cfg.generation.stop_token_ids == [7, 8]
    assert (cfg.max_steps, cfg.dtype) == (3, "bf16")
    assert parse_args(BASE + ["--do_sample", "yes"]).generation.do_sample is True


def test_defaults_are_untouched_without_flags():
    cfg = parse_args(BASE)
    expected = TrainConfig()
    expected.actor.model_name_or_path = "some/actor"
    resolve_auto(expected)  # the one default parse_args settles: generation_backend auto names its choice
    assert expected.engine.generation_backend != "auto" and cfg == expected


def test_optional_fields_accept_none():
    cfg = parse_args(BASE + ["--dual_clip", "3", "--reference_zero_stage", "0"])
    assert cfg.ppo.dual_clip == 3.0 and cfg.reference.zero_stage == 0
    cfg = parse_args(BASE + ["--dual_clip", "none", "--reference_zero_stage", "null"])
    assert cfg.ppo.dual_clip is None and cfg.reference.zero_stage is None


@pytest.mark.parametrize("ext", ["json", "yaml"])
def test_config_file_is_read_and_flags_override_it(tmp_path, ext):
    values = {"actor_model_name_or_path": "from/file", "kl_coef": 0.3, "generation_batches": 2,
              "per_device_training_batch_size": 2, "do_sample": False, "critic_learning_rate": 2e-6,
              "stop_token_ids": [3]}
    path = tmp_path / f"run.{ext}"
    path.write_text(json.dumps(values) if ext == "json" else yaml.safe_dump(values))
    cfg = parse_args(["--config", str(path)])
    assert cfg.actor.model_name_or_path == "from/file" and cfg.ppo.kl_coef == 0.3
    assert cfg.batch.generation_batches == 2 and cfg.generation.do_sample is False
    assert cfg.critic.learning_rate == 2e-6 and cfg.generation.stop_token_ids == [3]
    cfg = parse_args(["--config", str(path), "--kl_coef", "0.7", "--do_sample", "--actor_model_name_or_path", "x"])
    assert cfg.ppo.kl_coef == 0.7 and cfg.generation.do_sample is True and cfg.actor.model_name_or_path == "x"
    assert cfg.batch.generation_batches == 2  # not overridden: still from the file


def test_yaml_values_are_coerced_to_the_field_type(tmp_path):
    # PyYAML reads `1e-6` (no dot) as the STRING "1e-6": the file value must still become a float
    path = tmp_path / "run.yaml"
    path.write_text("actor_model_name_or_path: a\nactor_learning_rate: 1e-6\nkl_coef: 0\nmax_steps: 4.0\n"
                    "do_sample: 'off'\ndual_clip: null\n")
    assert yaml.safe_load(path.read_text())["actor_learning_rate"] == "1e-6"
    cfg = parse_args(["--config", str(path)])
    assert cfg.actor.learning_rate == 1e-6 and isinstance(cfg.actor.learning_rate, float)
    assert cfg.ppo.kl_coef == 0.0 and cfg.max_steps == 4 and isinstance(cfg.max_steps, int)
    assert cfg.generation.do_sample is False and cfg.ppo.dual_clip is None


def test_config_file_values_of_the_wrong_type_are_listed(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"actor_model_name_or_path": "a", "max_steps": 2.5, "kl_coef": "lots",
                                "do_sample": "maybe", "stop_token_ids": 5, "seed": None}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)])
    fields = [p.field.split(": ")[-1] for p in info.value.problems]
    assert sorted(fields) == ["do_sample", "kl_coef", "max_steps", "seed", "stop_token_ids"]
    assert "max_steps = 2.5" in str(info.value)


def test_unknown_config_key_says_did_you_mean(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"actor_model_name_or_path": "a", "kl_coeff": 0.2, "actor_learnig_rate": 1e-5}))
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)])
    msg = str(info.value)
    assert 'kl_coeff = 0.2: unknown key (did you mean "kl_coef"?)' in msg
    assert '(did you mean "actor_learning_rate"?)' in msg
    assert len(info.value.problems) == 2 and str(path) in msg


def test_missing_config_file_exits(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--config", str(tmp_path / "nope.json")])
    assert info.value.code == 2 and "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("flag,suggestion", [("--kl_coeff", "kl_coef"), ("--actor_lerning_rate", "actor_learning_rate"),
                                             ("--generation_batch", "generation_batches")])
def test_unknown_flag_exits_with_did_you_mean(capsys, flag, suggestion):
    with pytest.raises(SystemExit) as info:
        parse_args(BASE + [flag, "0.1"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "unrecognized arguments" in err and flag in err and f'did you mean "{suggestion}"' in err


def test_abbreviated_flags_are_rejected(capsys):
    # argparse's default allow_abbrev would silently read --ppo as --ppo_epochs
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--ppo", "2"])
    assert "--ppo" in capsys.readouterr().err


def test_local_rank_is_accepted_and_dropped():
    for extra in (["--local_rank", "0"], ["--local_rank=1"]):
        cfg = parse_args(BASE + extra)
        assert cfg.actor.model_name_or_path == "some/actor"
        assert "local_rank" not in flat_dict(cfg)


def test_invalid_values_raise_one_config_error():
    with pytest.raises(ConfigError) as info:
        parse_args(["--kl_coef", "-1", "--per_device_generation_batch_size", "3",
                    "--per_device_training_batch_size", "2"])
    assert {p.field for p in info.value.problems} == {"actor_model_name_or_path", "kl_coef",
                                                        "per_device_training_batch_size"}


@pytest.mark.parametrize("ext", ["json", "yaml"])
def test_flat_dict_round_trips_through_a_config_file(tmp_path, ext):
    cfg = parse_args(BASE + ["--actor_learning_rate", "3e-7", "--kl_coef", "0.02", "--reference_zero_stage", "3",
                             "--dual_clip", "2.5", "--stop_token_ids", "4", "5", "--top_p", "0.9",
                             "--do_sample", "false", "--critic_init_from", "actor", "--generation_batches", "2"])
    flat = flat_dict(cfg)
    assert flat["actor_learning_rate"] == 3e-7 and flat["reference_zero_stage"] == 3 and flat["kl_coef"] == 0.02
    assert len(flat) == sum(len(dataclasses.fields(type(getattr(cfg, f.name)))) - len(f.metadata.get("skip_flags", ()))
                            if dataclasses.is_dataclass(getattr(cfg, f.name)) else 1
                            for f in dataclasses.fields(cfg))  # no two fields share a key
    path = tmp_path / f"resolved.{ext}"
    path.write_text(json.dumps(flat) if ext == "json" else yaml.safe_dump(flat))
    again = parse_args(["--config", str(path)])
    assert again == cfg and flat_dict(again) == flat


def test_help_lists_grouped_sections_with_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    out = out[out.index("options:"):]  # skip the usage line, which lists every flag too
    cfg = TrainConfig()
    sections = [f"{role} role:" for role in ("actor", "critic", "reference", "reward")]
    sections += [f"{type(getattr(cfg, f.name)).__name__}:" for f in dataclasses.fields(cfg)
                 if dataclasses.is_dataclass(getattr(cfg, f.name)) and f.name not in ("actor", "critic", "reference",
                                                                                     "reward")]
    sections.append("TrainConfig:")  # the run-level fields
    assert {"PPOConfig:", "GenerationConfig:", "BatchConfig:"} <= set(sections)
    for section in sections:
        assert section in out, section
    assert out.index("actor role:") < out.index("--actor_learning_rate") < out.index("critic role:")
    assert out.index("critic role:") < out.index("--critic_learning_rate") < out.index("reference role:")
    assert out.index("PPOConfig:") < out.index("--kl_coef") < out.index("--clip_eps")
    assert out.index("BatchConfig:") < out.index("--generation_batches")
    assert "--config" in out and "--local_rank" not in out
    kl = out[out.index("--kl_coef"):out.index("--kl_estimator")]
    assert "KL penalty" in kl and "(default: 0.1)" in kl  # help text and the dataclass default
    assert "DeepSpeed-Chat aliases:" in out
    # positionals/options + one per section + the aliases
    assert len(build_parser()._action_groups) == 2 + len(sections) + 1


def test_deepspeed_chat_aliases_set_their_fields_and_a_specific_flag_wins(capsys):
    cfg = parse_args(BASE + ["--offload", "--critic_offload", "false", "--num_warmup_steps", "5",
                             "--lr_scheduler_type", "cosine", "--offload_reference_model", "--offload_reward_model",
                             "--reference_zero_stage", "3", "--reward_zero_stage", "3", "--enable_hybrid_engine",
                             "false"])
    assert (cfg.actor.offload, cfg.critic.offload) == (True, False)  # the specific flag wins, in any order
    assert cfg.actor.num_warmup_steps == cfg.critic.num_warmup_steps == 5
    assert cfg.actor.lr_scheduler_type == cfg.critic.lr_scheduler_type == "cosine"
    assert cfg.reference.offload is True and cfg.reward.offload is True
    assert cfg.actor.learning_rate == TrainConfig().actor.learning_rate  # nothing else moved
    flat = flat_dict(cfg)
    assert not {"offload", "num_warmup_steps", "lr_scheduler_type", "offload_reward_model"} & set(flat)
    assert flat["critic_num_warmup_steps"] == 5
    assert parse_args(BASE + ["--offload", "false"]).actor.offload is False
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--lr_scheduler_type"])  # a value is required
    capsys.readouterr()
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + ["--lr_scheduler_type", "cosin"])
    assert {p.field for p in e.value.problems} == {"actor_lr_scheduler_type", "critic_lr_scheduler_type"}


def test_aliases_in_a_config_file_and_flags_over_them(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"actor_model_name_or_path": "a", "num_warmup_steps": 7,
                                    "critic_num_warmup_steps": 2, "offload": True}))
    cfg = parse_args(["--config", str(path)])
    assert (cfg.actor.num_warmup_steps, cfg.critic.num_warmup_steps) == (7, 2)  # the specific key of the file wins
    assert cfg.actor.offload is True and cfg.critic.offload is True
    cfg = parse_args(["--config", str(path), "--num_warmup_steps", "1"])  # a flag alias beats the file's keys
    assert (cfg.actor.num_warmup_steps, cfg.critic.num_warmup_steps) == (1, 1)
    path.write_text(yaml.safe_dump({"actor_model_name_or_path": "a", "num_warmup_step": 7}))
    with pytest.raises(ConfigError, match='did you mean "num_warmup_steps"'):
        parse_args(["--config", str(path)])


def test_aliases_only_where_they_do_not_shadow_a_field():
    from rlhf_engine.config import SFTConfig

    cfg = parse_args(["--model_name_or_path", "m", "--data_path", "d.jsonl", "--offload", "--num_warmup_steps", "3"],
                     config_cls=SFTConfig)
    assert cfg.model.offload is True and cfg.model.num_warmup_steps == 3  # SFT's own flat fields
    from rlhf_engine.cli import aliases_of

    assert aliases_of(SFTConfig()) == {"data_output_path": ("data_cache_dir",)}  # the only one SFT has no field for


def test_data_output_path_alias_sets_the_data_cache_dir(tmp_path):
    cfg = parse_args(["--actor_model_name_or_path", "a", "--data_output_path", str(tmp_path)])
    assert cfg.data.data_cache_dir == str(tmp_path)


def test_launch_processes_freeze_their_start_up_and_still_collect_new_cycles():
    """freeze_startup (each training launch script's `__main__`): the imports move to the permanent generation, out
    of later scans; garbage made after it is still collected. Run in a child: frozen objects are never collected."""
    import os
    import subprocess
    import sys

    from tests._support import ROOT

    code = ("import gc, weakref\n"
            "import torch\n"
            "from rlhf_engine.cli import freeze_startup\n"
            "freeze_startup()\n"
            "frozen = gc.get_freeze_count()\n"
            "class Node: pass\n"
            "a, b = Node(), Node(); a.b, b.a = b, a; ref = weakref.ref(a); del a, b\n"
            "gc.collect()\n"
            "print(frozen, ref() is None)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    frozen, collected = out.split()
    assert int(frozen) > 100_000 and collected == "True"  # torch's import alone leaves a few hundred thousand
    for script in ("train_ppo.py", "train_sft.py", "train_reward.py"):
        with open(os.path.join(ROOT, "launch", script)) as f:
            main_block = f.read().split('if __name__ == "__main__":')[1]
        assert main_block.lstrip().startswith("freeze_startup()"), script
