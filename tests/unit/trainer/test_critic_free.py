"""A critic-free run end to end on one rank: n samples per prompt in contiguous groups, the estimator's numbers, no
critic anywhere; the flags that make no sense without a critic or a group are refused by name."""
import os

import pytest
import torch
from _trainer_args import train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.errors import ConfigError
from rlhf_engine.estimators import group_advantages
from rlhf_engine.trainer import build_trainer

FLAGS = dict(per_device_generation_batch_size=4, n_samples_per_prompt=2, per_device_training_batch_size=4,
             gradient_accumulation_steps=1, ppo_epochs=1, seed=3, max_steps=1, export_final="false")


def test_grpo_run_groups_advantages_and_no_critic(tiny, dist_single, tmp_path):
    out = tmp_path / "run"
    cfg = parse_args(train_args(tiny, str(out), advantage_estimator="grpo", actor_learning_rate=0.0,
                                filter_uniform_groups="true", overlong_buffer_len=2, kl_loss_coef=0.1, **FLAGS))
    assert cfg.batch.rollout_size == 8 and cfg.trained_roles == ("actor",)
    trainer = build_trainer(cfg)
    assert not trainer.engine.has_critic and not os.path.exists(out / "ds_config_critic.json")
    rec = trainer.step()
    exp = trainer.last_experience
    r = exp.rollout
    assert r.batch_size == 8 and torch.equal(r.prompts[0::2], r.prompts[1::2])  # each prompt twice, in a row
    groups = torch.arange(8) // 2
    returns = (exp.rewards * r.action_mask).sum(-1)
    assert torch.allclose(exp.advantages, group_advantages(returns, groups, r.action_mask, "grpo"), atol=1e-6)
    uniform = (exp.scores[0::2] == exp.scores[1::2]).repeat_interleave(2)
    assert torch.equal(exp.policy_mask.sum(-1) == 0, uniform | (r.response_lengths == 0))
    assert rec["rollout/uniform_group_rate"] == pytest.approx(uniform.float().mean().item())
    assert rec["policy/ratio_max"] in (1.0, None) and "policy/kl_loss" in rec and rec["policy/kl_loss"] == 0.0
    assert not [k for k in rec if k.startswith("value/")]
    assert trainer.plan.fingerprint["advantage_estimator"] == "grpo"
    assert trainer.plan.fingerprint["n_samples_per_prompt"] == 2
    trainer.metrics.close()


def _constant(prompts, responses):
    return [1.0] * len(responses)


def test_uniform_groups_are_judged_by_their_scores_not_the_kl_in_the_returns(tiny, dist_single, tmp_path,
                                                                             other_reference, monkeypatch):
    """Every response scores 1 (every group uniform) while a reference with other weights makes each response's KL,
    and so its return, differ: the filter still takes every group out of the policy loss."""
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    args = train_args(tiny, str(tmp_path / "run"), advantage_estimator="dr_grpo", filter_uniform_groups="true",
                      reference_model_name_or_path=other_reference, kl_coef=0.1, reward_fn="test_critic_free:_constant",
                      **FLAGS)
    args = [a for a in args if a not in ("--reward_model_name_or_path", tiny.reward)]
    trainer = build_trainer(parse_args(args))
    rec = trainer.step()
    exp = trainer.last_experience
    returns = (exp.rewards * exp.rollout.action_mask).sum(-1)
    assert not torch.equal(returns[0::2], returns[1::2])  # the KL makes the returns differ
    assert rec["rollout/uniform_group_rate"] == 1.0 and int(exp.policy_mask.sum()) == 0
    assert rec["policy/loss"] == 0.0
    trainer.metrics.close()


@pytest.mark.parametrize("flags, fields", [
    (dict(advantage_estimator="grpo"), {"n_samples_per_prompt"}),
    (dict(advantage_estimator="rloo", n_samples_per_prompt=2, critic_learning_rate=1e-3, value_clip=0.5,
          critic_zero_stage=2), {"critic_learning_rate", "value_clip", "critic_zero_stage"}),
    (dict(advantage_estimator="reinforce_pp", whiten_advantages="true"), {"whiten_advantages"}),
    (dict(advantage_estimator="reinforce_pp", filter_uniform_groups="true"), {"filter_uniform_groups"}),
    (dict(loss_agg_mode="seq_mean"), {"loss_agg_mode"}),
    (dict(overlong_buffer_len=9), {"overlong_buffer_len"}),
    (dict(kl_loss_estimator="k4", clip_eps_high=-1), {"kl_loss_estimator", "clip_eps_high"}),
])
def test_flags_that_make_no_sense_are_refused_by_name(tiny, tmp_path, flags, fields):
    with pytest.raises(ConfigError) as e:
        parse_args(train_args(tiny, str(tmp_path), **flags))
    assert {p.field for p in e.value.problems} == fields, str(e.value)


def test_a_gae_checkpoint_is_not_resumed_as_grpo(tiny, dist_single, tmp_path):
    out = str(tmp_path / "run")
    flags = dict(FLAGS, n_samples_per_prompt=1, save_interval=1)
    build_trainer(parse_args(train_args(tiny, out, **flags))).train()
    with pytest.raises(ConfigError) as e:
        build_trainer(parse_args(train_args(tiny, out, resume="auto", advantage_estimator="rloo",
                                            **{**flags, "n_samples_per_prompt": 2, "max_steps": 2})))
    assert {"advantage_estimator", "n_samples_per_prompt"} <= {p.field for p in e.value.problems}, str(e.value)
