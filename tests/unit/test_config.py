"""TrainConfig validation: every problem of a config in ONE ConfigError, each with its field, its value and a fix."""
import dataclasses
import pickle

import pytest

from rlhf_engine.config import BatchConfig, GenerationConfig, PPOConfig, RoleConfig, TrainConfig
from rlhf_engine.errors import ConfigError, Problem


def valid(**kw) -> TrainConfig:
    cfg = TrainConfig(**kw)
    cfg.actor.model_name_or_path = "some/actor"
    return cfg


def problems(cfg: TrainConfig) -> dict:
    """field -> Problem of the one ConfigError that validate() raises."""
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    err = info.value
    assert isinstance(err, ValueError)
    assert len(err.problems) == len({p.field for p in err.problems}), "one problem per field"
    for p in err.problems:  # every problem is listed in the message with its value and a fix
        assert p.fix.strip()
        assert f"{p.field} = {p.value!r}: {p.fix}" in str(err)
    return {p.field: p for p in err.problems}


def test_default_fails_only_on_the_actor_path():
    found = problems(TrainConfig())
    assert list(found) == ["actor_model_name_or_path"]
    assert found["actor_model_name_or_path"].value == ""
    assert "1 problem)" in str(ConfigError(found.values()))
    assert valid().validate().actor.model_name_or_path == "some/actor"  # validate returns the config


def test_ppo_section_lists_every_bad_field():
    cfg = valid(ppo=PPOConfig(ppo_epochs=0, kl_coef=-0.1, kl_estimator="k4", gamma=1.5, lam=float("nan"),
                              dual_clip=0.5, clip_eps=-1.0, kl_horizon=0))
    found = problems(cfg)
    assert set(found) == {"ppo_epochs", "kl_coef", "kl_estimator", "gamma", "lam", "dual_clip", "clip_eps",
                          "kl_horizon"}
    assert found["ppo_epochs"].value == 0 and "> 0" in found["ppo_epochs"].fix
    assert found["kl_coef"].value == -0.1 and ">= 0" in found["kl_coef"].fix
    assert "k1, k2, k3" in found["kl_estimator"].fix
    assert "[0, 1]" in found["gamma"].fix and "[0, 1]" in found["lam"].fix
    assert "> 1" in found["dual_clip"].fix


def test_adaptive_kl_needs_a_positive_target():
    # the adaptive controller divides by kl_target: 0 must fail at validation, not after the engines are built
    assert "kl_target" in problems(valid(ppo=PPOConfig(adaptive_kl=True, kl_target=0.0)))
    valid(ppo=PPOConfig(adaptive_kl=False, kl_target=0.0)).validate()
    valid(ppo=PPOConfig(adaptive_kl=True, kl_target=3.0, dual_clip=3.0)).validate()


def test_generation_section_lists_every_bad_field():
    cfg = valid(generation=GenerationConfig(temperature=0.0, top_p=0.0, top_k=-1, max_answer_seq_len=8,
                                            min_answer_seq_len=9, max_prompt_seq_len=0, stop_token_ids=[2, -1]))
    found = problems(cfg)
    assert set(found) == {"temperature", "top_p", "top_k", "min_answer_seq_len", "max_prompt_seq_len",
                          "stop_token_ids"}
    assert "max_answer_seq_len (8)" in found["min_answer_seq_len"].fix
    assert "(0, 1]" in found["top_p"].fix


def test_wrong_types_are_problems_not_type_errors():
    """A config built from a file can hold strings where numbers belong: listed, never a TypeError mid-validate."""
    cfg = valid(generation=GenerationConfig(top_p="0.9", min_answer_seq_len="3"),
                ppo=PPOConfig(dual_clip="2", gamma=None))
    cfg.actor.adam_beta1 = "x"
    found = problems(cfg)
    assert {"top_p", "min_answer_seq_len", "dual_clip", "gamma", "actor_adam_beta1"} <= set(found)
    assert found["top_p"].value == "0.9"


def test_role_sections_are_prefixed_with_the_role():
    cfg = valid(dtype="fp64", max_steps=0)
    cfg.critic.zero_stage = 5
    cfg.critic.dtype = "fp8"
    cfg.critic.adam_beta2 = 1.0
    cfg.critic.lr_scheduler_type = "step"
    cfg.actor.learning_rate = -1e-6
    cfg.critic.init_from = "sft"
    found = problems(cfg)
    assert set(found) == {"critic_zero_stage", "critic_dtype", "critic_adam_beta2", "critic_lr_scheduler_type",
                          "actor_learning_rate", "critic_init_from", "dtype", "max_steps"}
    assert found["critic_zero_stage"].value == 5 and "0, 1, 2 or 3" in found["critic_zero_stage"].fix
    assert "cosine" in found["critic_lr_scheduler_type"].fix
    assert "fp32, bf16, fp16" in found["dtype"].fix


def test_offload_params_needs_stage_3():
    cfg = valid()
    cfg.actor.offload_params = True  # zero_stage None: a trained role defaults to stage 0
    cfg.critic.offload_params, cfg.critic.zero_stage = True, 2
    found = problems(cfg)
    assert set(found) == {"actor_offload_params", "critic_offload_params"}
    assert "actor_zero_stage 3" in found["actor_offload_params"].fix
    cfg.actor.zero_stage = cfg.critic.zero_stage = 3
    cfg.validate()


def test_batch_arithmetic_names_all_four_fields_and_numbers():
    cfg = valid(batch=BatchConfig(per_device_generation_batch_size=3, generation_batches=1,
                                  per_device_training_batch_size=2, gradient_accumulation_steps=1))
    found = problems(cfg)
    assert list(found) == ["per_device_training_batch_size"]
    fix = found["per_device_training_batch_size"].fix
    for text in ("per_device_generation_batch_size (3)", "generation_batches (1)", "= 3 rollouts",
                 "per_device_training_batch_size (2)", "gradient_accumulation_steps (1)", "= 2",
                 "generation_batches to a multiple of 2"):
        assert text in fix, (text, fix)


@pytest.mark.parametrize("gen,batches,train,accum", [(4, 1, 4, 1), (4, 1, 2, 2), (3, 2, 2, 3), (2, 3, 3, 1),
                                                      (1, 1, 1, 1), (6, 4, 4, 3)])
def test_valid_batch_combos_pass(gen, batches, train, accum):
    b = BatchConfig(per_device_generation_batch_size=gen, generation_batches=batches,
                    per_device_training_batch_size=train, gradient_accumulation_steps=accum)
    valid(batch=b).validate()
    assert b.rollout_size % b.mini_batch_size == 0
    assert f"{b.rollout_size // b.mini_batch_size} optimizer steps" in b.describe(world_size=2)


def test_batch_fields_must_be_positive_whole_numbers():
    found = problems(valid(batch=BatchConfig(per_device_generation_batch_size=0, gradient_accumulation_steps=-1,
                                             per_device_training_batch_size=2.5, experience_micro_batch_size=-2)))
    assert set(found) == {"per_device_generation_batch_size", "gradient_accumulation_steps",
                          "per_device_training_batch_size", "experience_micro_batch_size"}
    assert "whole number" in found["per_device_training_batch_size"].fix


@pytest.mark.parametrize("role", ["reference", "reward"])
@pytest.mark.parametrize("stage", [1, 2])
def test_eval_only_roles_reject_zero_1_and_2(role, stage):
    cfg = valid()
    getattr(cfg, role).zero_stage = stage
    found = problems(cfg)
    assert list(found) == [f"{role}_zero_stage"] and found[f"{role}_zero_stage"].value == stage
    assert "0 or 3" in found[f"{role}_zero_stage"].fix


def test_eval_only_roles_accept_0_and_3_trained_roles_any_stage():
    for stage in (0, 3):
        cfg = valid()
        cfg.reference.zero_stage = cfg.reward.zero_stage = stage
        cfg.validate()
    for stage in (0, 1, 2, 3):
        cfg = valid()
        cfg.actor.zero_stage = cfg.critic.zero_stage = stage
        cfg.validate()


def test_every_field_has_help_text():
    for cls in (TrainConfig, RoleConfig, PPOConfig, GenerationConfig, BatchConfig):
        for f in dataclasses.fields(cls):
            assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), f"{cls.__name__}.{f.name}"


def test_sections_are_independent_instances_and_to_dict():
    a, b = TrainConfig(), TrainConfig()
    a.generation.stop_token_ids.append(5)
    a.actor.learning_rate = 1.0
    assert b.generation.stop_token_ids == [] and b.actor.learning_rate == 1e-6 and a.critic.learning_rate == 1e-6
    d = a.to_dict()
    assert d["actor"]["learning_rate"] == 1.0 and d["generation"]["stop_token_ids"] == [5]


def test_config_error_pickles_with_its_problems():
    err = ConfigError([Problem("kl_coef", -1, "must be >= 0")], "invalid command line")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, ConfigError) and back.problems == err.problems and str(back) == str(err)


@pytest.mark.parametrize("est, want", [
    ("gae", dict(kl_coef=0.1, kl_loss_coef=0.0, kl_loss_estimator="k2", loss_agg_mode="token_mean")),
    ("reinforce_pp", dict(kl_coef=0.1, kl_loss_coef=0.0)),
    ("grpo", dict(kl_coef=0.0, kl_loss_coef=0.001, kl_loss_estimator="k3", loss_agg_mode="token_mean")),
    ("rloo", dict(kl_coef=0.0, kl_loss_coef=0.001, kl_loss_estimator="k3")),
    ("dr_grpo", dict(kl_coef=0.0, kl_loss_coef=0.001, loss_agg_mode="seq_mean_token_sum_norm")),
])
def test_estimator_family_defaults(est, want):
    """A group estimator puts the KL in the loss unless the run says otherwise (config.ESTIMATOR_DEFAULTS)."""
    from rlhf_engine.cli import parse_args

    base = ["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl", "--advantage_estimator", est]
    if est != "gae" and est != "reinforce_pp":
        base += ["--n_samples_per_prompt", "2"]
    ppo = parse_args(base).ppo
    assert {k: getattr(ppo, k) for k in want} == want


@pytest.mark.parametrize("est, flags, want", [
    ("gae", [], "seq_mean_token_mean"),
    ("grpo", ["--n_samples_per_prompt", "2"], "seq_mean_token_mean"),
    ("dr_grpo", ["--n_samples_per_prompt", "2"], "seq_mean_token_mean"),
    ("grpo", ["--n_samples_per_prompt", "2", "--loss_agg_mode", "token_mean"], "token_mean"),
])
def test_gspo_aggregates_by_sequence_unless_told(est, flags, want):
    """GSPO's default aggregation is verl's seq-mean-token-mean; the ppo_clip control keeps the family's."""
    from rlhf_engine.cli import parse_args

    base = ["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl", "--advantage_estimator", est, *flags]
    assert parse_args(base + ["--policy_loss", "gspo"]).ppo.loss_agg_mode == want
    control = parse_args(base).ppo.loss_agg_mode
    assert control == ("token_mean" if "--loss_agg_mode" in flags else
                       {"dr_grpo": "seq_mean_token_sum_norm"}.get(est, "token_mean"))


def test_explicit_flags_and_config_file_keys_win_over_the_family_defaults(tmp_path):
    from rlhf_engine.cli import parse_args

    base = ["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl", "--advantage_estimator", "grpo",
            "--n_samples_per_prompt", "2"]
    ppo = parse_args(base + ["--kl_coef", "0.05", "--loss_agg_mode", "seq_mean_token_mean"]).ppo
    assert (ppo.kl_coef, ppo.kl_loss_coef, ppo.loss_agg_mode) == (0.05, 0.001, "seq_mean_token_mean")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("kl_loss_coef: 0.0\n")
    ppo = parse_args(base + ["--config", str(cfg_file)]).ppo
    assert (ppo.kl_coef, ppo.kl_loss_coef) == (0.0, 0.0)


@pytest.mark.parametrize("flag", ["rollout_workers", "rollout_address", "rollout_group_backend"])
def test_the_rollout_workers_flags_name_the_servers(flag, tmp_path, capsys):
    """The rollout workers' flags are gone: on the command line (argparse's error) and in a config file (the config's
    error), each names the rollout servers instead of a bare "unrecognized"."""
    from rlhf_engine.cli import parse_args

    base = ["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl"]
    with pytest.raises(SystemExit):
        parse_args(base + [f"--{flag}", "1"])
    err = capsys.readouterr().err
    assert f"--{flag}: " in err and "docs/rollout-servers.md" in err, err
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"{flag}: 1\n")
    with pytest.raises(ConfigError) as e:
        parse_args(base + ["--config", str(cfg_file)])
    assert flag in str(e.value) and "docs/rollout-servers.md" in str(e.value) and "unknown key" not in str(e.value)
    with pytest.raises(SystemExit):  # the control: an unknown flag still gets argparse's own words
        parse_args(base + ["--rollout_workerz", "1"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_rollout_servers_are_urls_or_a_file_of_them(tmp_path):
    from rlhf_engine.config.rollout import server_urls

    assert server_urls("http://a:8000/, b:8001") == ["http://a:8000", "http://b:8001"]
    listed = tmp_path / "servers.txt"
    listed.write_text("# rollout nodes\nhttp://n1:8000\n\nhttps://n2:9000/v  # second\n")
    assert server_urls(f"@{listed}") == ["http://n1:8000", "https://n2:9000/v"]
    for bad, says in (("a:8000,a:8000", "listed twice"), ("http://a", "port"), ("ftp://a:1", "not a server URL"),
                      (f"@{tmp_path}/none.txt", "cannot read"), (" , ", "no server URL")):
        with pytest.raises(ValueError, match=says):
            server_urls(bad)


@pytest.mark.parametrize("change, field, says", [
    (dict(generation_backend="lean"), "generation_backend", "add --generation_backend vllm"),
    (dict(rollout_servers="http://a"), "rollout_servers", "port"),
])
def test_rollout_servers_settings_are_checked(change, field, says):
    cfg = valid()
    cfg.rollout.rollout_servers = "http://127.0.0.1:8000"
    cfg.engine.generation_backend = "vllm"
    cfg.validate()  # the control: servers with the vllm backend
    for k, v in change.items():
        setattr(cfg.engine if k == "generation_backend" else cfg.rollout, k, v)
    p = problems(cfg)[field]
    assert says in p.fix


@pytest.mark.parametrize("value, ok", [(0, True), (0.0, True), (0.35, True), (1.0, True), (-0.1, False),
                                       (1.01, False), (float("nan"), False), ("0.5", False), (True, False)])
def test_vllm_gpu_memory_utilization_is_0_or_a_share_of_the_gpu(value, ok):
    cfg = valid()
    cfg.engine.vllm_gpu_memory_utilization = value
    if ok:
        cfg.validate()
    else:
        assert "(0, 1]" in problems(cfg)["vllm_gpu_memory_utilization"].fix


def test_staleness_and_partial_rollouts_need_somewhere_to_generate_ahead():
    cfg = valid()
    cfg.rollout.max_staleness, cfg.rollout.partial_rollouts = 2, True
    p = problems(cfg)
    assert "rollout_servers" in p["max_staleness"].fix and "rollout_servers" in p["partial_rollouts"].fix
    cfg.rollout.rollout_servers, cfg.engine.generation_backend = "http://127.0.0.1:8000", "vllm"
    cfg.validate()  # servers generate ahead, and pause in keep mode
    assert cfg.rollout.ahead and not valid().rollout.ahead


def test_episodes_go_through_the_servers_at_any_staleness():
    cfg = valid()
    cfg.rollout.rollout_servers, cfg.engine.generation_backend = "http://127.0.0.1:8000", "vllm"
    cfg.env.environment = "mymodule:make_env"
    cfg.validate()  # each turn's requests to the servers, with the current weights
    cfg.rollout.max_staleness = 2
    cfg.rollout.partial_rollouts = True
    cfg.validate()  # played ahead in a thread of each rank's (trainer/episodes_ahead.py)
