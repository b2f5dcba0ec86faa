"""The seams: the advantage-estimator registry, a run without a critic, the step guard's own skip counter across a
resume, the generation backend's explicit sampling parameters."""
import os

import pytest
import torch
from _trainer_args import train_args

from rlhf_engine import estimators
from rlhf_engine.cli import parse_args
from rlhf_engine.errors import ConfigError
from rlhf_engine.hooks import TestHooks
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.plan import plan_ppo

FLAGS = dict(per_device_generation_batch_size=4, per_device_training_batch_size=2, gradient_accumulation_steps=2,
             ppo_epochs=1, seed=3)


# ---- the registry -------------------------------------------------------------------------------------------------
def test_gae_is_registered_and_computes_by_hand():
    est = estimators.get("gae")
    assert est.needs_critic
    # gamma = lam = 1: advantage = (sum of the rewards from t on) - V_t; padding (t = 2 of row 1) is 0
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.0, 0.0]])
    values = torch.tensor([[0.5, 0.25, 0.0], [0.0, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = est.fn(rewards=rewards, action_mask=mask, values=values, scores=torch.zeros(2), gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.75, 1.0], [-0.5, -1.5, 0.0]]), atol=1e-6), adv
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [-0.5, -1.0, 0.0]]), atol=1e-6), ret
    with pytest.raises(ValueError, match="registered twice"):
        estimators.register("gae", needs_critic=True)(lambda **k: None)


def test_unknown_estimator_is_a_config_error(tiny, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_args(train_args(tiny, str(tmp_path), advantage_estimator="nope"))
    assert [p.field for p in e.value.problems] == ["advantage_estimator"] and "gae" in e.value.problems[0].fix


@pytest.fixture
def score_estimator():
    """A stand-in critic-free estimator: every real token of a response gets its sequence's shaped score."""
    @estimators.register("test_sequence_score", needs_critic=False)
    def fn(*, scores, action_mask, **_):
        return scores[:, None] * action_mask.float(), None

    yield "test_sequence_score"
    del estimators.ESTIMATORS["test_sequence_score"]


# ---- no critic ----------------------------------------------------------------------------------------------------
def test_a_run_without_a_critic_builds_none_and_trains_the_actor(tiny, dist_single, tmp_path, score_estimator):
    out = tmp_path / "run"
    cfg = parse_args(train_args(tiny, str(out), advantage_estimator=score_estimator,
                                actor_learning_rate=0.0, max_steps=1, **FLAGS))
    assert cfg.active_roles == ("actor", "reference", "reward") and cfg.trained_roles == ("actor",)
    trainer = build_trainer(cfg)
    assert set(trainer.engine.engines) == {"actor", "reference", "reward"} and not trainer.engine.has_critic
    assert "critic" not in trainer.plan.engine.roles and not os.path.exists(out / "ds_config_critic.json")
    assert not [k for k in trainer.plan.fingerprint if k.startswith("critic_")]
    records = trainer.train()
    rec, exp = records[0], trainer.last_experience
    assert exp.values is None and exp.returns is None
    mask = exp.rollout.action_mask.float()
    assert torch.equal(exp.advantages, exp.scores[:, None] * mask)  # the stand-in estimator's numbers, unwhitened
    assert not [k for k in rec if k.startswith("value/")] and rec["policy/loss"] is not None
    assert rec["policy/ratio_max"] == rec["policy/ratio_min"] == 1.0  # lr 0: every ratio exactly 1
    assert sorted(os.listdir(out / "final")) == ["actor"]  # no critic exported
    ckpt = sorted(os.listdir(out / "checkpoints"))[-1]
    assert not os.path.exists(out / "checkpoints" / ckpt / "critic")


def test_critic_flags_of_a_critic_free_run_are_refused(tiny, tmp_path, score_estimator):
    with pytest.raises(ConfigError) as e:
        parse_args(train_args(tiny, str(tmp_path), advantage_estimator=score_estimator, critic_warmup_iterations=2))
    assert [p.field for p in e.value.problems] == ["critic_warmup_iterations"]


# ---- the guard's skip counter -------------------------------------------------------------------------------------
def test_skipped_steps_survive_a_resume(tiny, dist_single, tmp_path):
    """A skipped update at iteration 1, a checkpoint at 2: the resumed run's iteration 2 reports the count the straight
    run reports (the guard's own counter, a state provider); negative control: without it restored, 0."""
    flags = dict(FLAGS, max_steps=3, save_interval=2, keep_last=0, export_final="false")
    inject = {"what": "grad", "role": "critic", "iteration": 1}

    def run(out, resume=None, skip=()):
        extra = {"resume": resume} if resume else {}
        hooks = TestHooks(nonfinite=inject, skip_on_resume=skip)
        trainer = build_trainer(parse_args(train_args(tiny, str(out), **flags, **extra)), hooks=hooks)
        return trainer.train()

    straight = run(tmp_path / "a")
    assert [r["system/skipped_steps"] for r in straight] == [0, 1, 1]
    ckpt = str(tmp_path / "a" / "checkpoints" / "iter_000002")
    resumed = run(tmp_path / "b", resume=ckpt)
    assert [r["system/skipped_steps"] for r in resumed] == [1]
    assert run(tmp_path / "c", resume=ckpt, skip=("step_guard",))[0]["system/skipped_steps"] == 0


# ---- generation ---------------------------------------------------------------------------------------------------
def test_evaluation_passes_its_own_sampling_and_leaves_the_config_alone(tiny, dist_single, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path / "run"), eval_interval=1, eval_split=0.25, max_steps=1,
                                export_final="false", **FLAGS))
    trainer = build_trainer(cfg)
    engine, seen = trainer.engine, []
    generate = engine.generator.generate

    def spy(ids, mask, params):
        seen.append(params)
        return generate(ids, mask, params)

    engine.generator.generate = spy
    trainer.train()
    greedy, sampled = [p for p in seen if not p.do_sample], [p for p in seen if p.do_sample]
    assert greedy and sampled and all(p == engine.sampling.greedy() for p in greedy)
    assert all(p == engine.sampling for p in sampled) and cfg.generation.do_sample is True
    assert engine.sampling.max_new_tokens == cfg.generation.max_answer_seq_len
    assert engine.sampling.stop_token_ids == tuple(engine.stop_token_ids)


def test_an_unknown_backend_is_refused_before_any_weight(tiny, dist_single, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path), generation_backend="sglang"))
    with pytest.raises(ConfigError) as e:
        plan_ppo(cfg)
    (p,) = e.value.problems
    assert p.field == "generation_backend" and all(name in p.fix for name in ("lean", "hf", "hybrid", "vllm"))
