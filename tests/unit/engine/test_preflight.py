"""Start-up checks: every model-side problem in one ConfigError, before any weights are loaded or engines built."""
import json
import os

import pytest

from rlhf_engine.config import TrainConfig
from rlhf_engine.engine.preflight import plan_engine, resolve_paths, resolve_stage
from rlhf_engine.errors import ConfigError


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory):
    """Config-only model folders next to the tiny setup: a critic with another vocabulary, a short-context model."""
    from transformers import GPT2Config

    root = tmp_path_factory.mktemp("preflight")
    other_vocab = str(root / "critic_vocab600")
    GPT2Config(vocab_size=600, n_layer=1, n_embd=16, n_head=2, num_labels=1).save_pretrained(other_vocab)
    short = str(root / "reward_short")
    GPT2Config(vocab_size=512, n_positions=32, n_layer=1, n_embd=16, n_head=2, num_labels=1).save_pretrained(short)
    for folder in (other_vocab, short):  # preflight checks that weights exist (it never reads them)
        open(os.path.join(folder, "model.safetensors"), "wb").close()
    ds_typo = str(root / "reward_ds.json")
    with open(ds_typo, "w") as f:
        json.dump({"gradient_clippping": 1.0, "zero_optimization": {"stage3_max_live_parameterz": 10}}, f)
    return {"tiny": tiny, "other_vocab": other_vocab, "short": short, "ds_typo": ds_typo, "root": str(root)}


def good_cfg(tiny) -> TrainConfig:
    cfg = TrainConfig()
    cfg.actor.model_name_or_path = tiny.actor
    cfg.reward.model_name_or_path = tiny.reward
    cfg.generation.max_prompt_seq_len = 64
    cfg.generation.max_answer_seq_len = 64
    return cfg


def problems(cfg) -> dict:
    with pytest.raises(ConfigError) as ei:
        plan_engine(cfg).roles
    return {p.field: p for p in ei.value.problems}, str(ei.value)


def test_good_setup_plans_every_role(folders):
    tiny = folders["tiny"]
    cfg = good_cfg(tiny)
    cfg.actor.zero_stage = 3
    plans = plan_engine(cfg).roles
    assert {r: (p.path, p.stage, p.train) for r, p in plans.items()} == {
        "actor": (tiny.actor, 3, True), "critic": (tiny.reward, 0, True),
        "reference": (tiny.actor, 3, False), "reward": (tiny.reward, 0, False)}
    assert all(p.dtype == "fp32" for p in plans.values())


def test_every_problem_in_one_error(folders):
    """Missing model path, unknown DeepSpeed keys, eval-only ZeRO 2, another vocabulary, too long: one error."""
    cfg = good_cfg(folders["tiny"])
    cfg.reward.model_name_or_path = os.path.join(folders["root"], "no_such_reward")
    cfg.critic.model_name_or_path = folders["other_vocab"]
    cfg.reference.zero_stage = 2
    cfg.reward.ds_config = folders["ds_typo"]
    cfg.generation.max_prompt_seq_len = 200
    cfg.generation.max_answer_seq_len = 100  # 300 > the tiny models' 256 positions
    found, msg = problems(cfg)
    assert msg.startswith("cannot start: model setup (6 problems)"), msg
    assert "no such folder" in found["reward_model_name_or_path"].fix
    assert "600 differs from the actor's 512" in found["critic_model_name_or_path"].fix
    assert "stage 0 or 3" in found["reference_zero_stage"].fix
    assert "maximum positions (256)" in found["max_prompt_seq_len + max_answer_seq_len"].fix
    assert found["max_prompt_seq_len + max_answer_seq_len"].value == 300
    typo = [p for f, p in found.items() if f.startswith("reward_ds_config") and "gradient_clippping" in f]
    nested = [p for f, p in found.items() if f.startswith("reward_ds_config") and "stage3_max_live_parameterz" in f]
    assert len(typo) == 1 and 'did you mean "gradient_clipping"' in typo[0].fix
    assert len(nested) == 1 and 'did you mean "stage3_max_live_parameters"' in nested[0].fix
    assert len(found) == 6, msg  # the actor/reference folder is too short once, not once per role


@pytest.mark.parametrize("case", ["missing_actor_folder", "empty_actor", "hub_id_offline", "missing_critic_and_reward"])
def test_missing_model_paths(folders, case):
    cfg = good_cfg(folders["tiny"])
    if case == "missing_actor_folder":
        cfg.actor.model_name_or_path = "/no/such/actor"
        field = "actor_model_name_or_path"
    elif case == "empty_actor":
        cfg.actor.model_name_or_path = ""
        field = "actor_model_name_or_path"
    elif case == "hub_id_offline":  # a name that is not a folder: tried on the hub, which is offline here
        cfg.reward.model_name_or_path = "nobody/no-such-reward-model"
        field = "reward_model_name_or_path"
    else:
        cfg.reward.model_name_or_path = ""
        field = "critic_model_name_or_path"
    found, msg = problems(cfg)
    assert field in found, msg
    # a path shared by two roles (the reference defaults to the actor) is reported once, under the role it was set on
    assert len(found) == 1, msg


def test_ds_config_file_problems_are_preflight_problems(folders, tmp_path):
    cfg = good_cfg(folders["tiny"])
    cfg.actor.ds_config = str(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    cfg.critic.ds_config = str(tmp_path / "bad.json")
    cfg.reward.ds_config = folders["ds_typo"]
    found, msg = problems(cfg)
    assert "no such file" in found["actor_ds_config"].fix
    assert "JSON" in found["critic_ds_config"].fix
    assert sum(f.startswith("reward_ds_config") for f in found) == 2, msg


def test_offload_at_a_stage_that_cannot_offload(folders):
    cfg = good_cfg(folders["tiny"])
    cfg.actor.offload = True  # actor at the default stage 0: DeepSpeed would silently not offload
    cfg.critic.zero_stage = 2
    cfg.critic.offload = True  # fine
    cfg.reward.offload = True  # eval-only at stage 0 (follows the critic's 2 -> 0)
    cfg.reference.zero_stage = 0
    cfg.reference.offload_params = True
    found, msg = problems(cfg)
    assert set(found) == {"actor_offload", "reward_offload", "reference_offload_params"}, msg
    assert "reward_zero_stage 3" in found["reward_offload"].fix


def test_short_context_model_and_long_sequences(folders):
    cfg = good_cfg(folders["tiny"])
    cfg.reward.model_name_or_path = folders["short"]  # critic and reward share it: reported once
    cfg.generation.max_prompt_seq_len, cfg.generation.max_answer_seq_len = 24, 16
    found, msg = problems(cfg)
    assert list(found) == ["max_prompt_seq_len + max_answer_seq_len"], msg
    assert "critic model's maximum positions (32)" in found["max_prompt_seq_len + max_answer_seq_len"].fix


def test_engine_raises_before_any_engine_is_built(folders, monkeypatch):
    import deepspeed

    from rlhf_engine.engine import DistInfo, RLHFEngine
    from rlhf_engine.engine import models

    def boom(*a, **k):
        raise AssertionError("an engine or a model was built before the config was checked")

    monkeypatch.setattr(deepspeed, "initialize", boom)
    monkeypatch.setattr(models, "load_causal_lm", boom)
    monkeypatch.setattr(models, "load_scalar_model", boom)
    cfg = good_cfg(folders["tiny"])
    cfg.reward.ds_config = folders["ds_typo"]  # the LAST role built: must still fail before the first
    cfg.reference.zero_stage = 1
    import torch

    with pytest.raises(ConfigError) as ei:
        RLHFEngine(cfg, DistInfo(0, 1, 0, torch.device("cpu")), plan_engine(cfg, 1))
    assert len(ei.value.problems) == 3, str(ei.value)


def test_train_config_validate_lists_every_problem():
    cfg = TrainConfig()
    cfg.actor.model_name_or_path = ""
    cfg.reference.zero_stage = 1
    cfg.reward.zero_stage = 2
    cfg.critic.zero_stage = 7
    cfg.dtype = "fp8"
    with pytest.raises(ConfigError) as ei:
        cfg.validate()
    fields = {p.field for p in ei.value.problems}
    assert {"actor_model_name_or_path", "reference_zero_stage", "reward_zero_stage", "critic_zero_stage",
            "dtype"} <= fields, str(ei.value)


def test_resolution_defaults():
    cfg = TrainConfig()
    cfg.actor.model_name_or_path, cfg.reward.model_name_or_path = "A", "R"
    assert resolve_paths(cfg) == {"actor": "A", "reference": "A", "critic": "R", "reward": "R"}
    cfg.critic.init_from = "actor"
    assert resolve_paths(cfg)["critic"] == "A"
    cfg.reward.model_name_or_path, cfg.critic.model_name_or_path = "", "C"
    assert resolve_paths(cfg)["reward"] == "C"  # the reward defaults to the critic's folder
    assert [resolve_stage(cfg, r) for r in ("actor", "critic", "reference", "reward")] == [0, 0, 0, 0]
    cfg.actor.zero_stage, cfg.critic.zero_stage = 3, 2
    assert [resolve_stage(cfg, r) for r in ("actor", "critic", "reference", "reward")] == [3, 2, 3, 0]
    cfg.critic.zero_stage = 3
    cfg.reference.zero_stage = 0
    assert [resolve_stage(cfg, r) for r in ("reference", "reward")] == [0, 3]
