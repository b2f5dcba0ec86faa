"""The actor's loss metrics on one real iteration: `policy/loss` is the policy term alone and `actor/loss` the whole
loss the actor's backward saw (policy term + kl_loss_coef x KL loss - entropy_coef x entropy), each recomputed here
by hand from the experience and a fresh forward; `reward/worker_*` counts reach the iteration's record."""
import os

import pytest
import torch
from _trainer_args import train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.trainer import build_trainer

KL_COEF, ENT_COEF, CLIP = 0.1, 0.05, 0.2
FLAGS = dict(per_device_generation_batch_size=4, n_samples_per_prompt=2, per_device_training_batch_size=4,
             gradient_accumulation_steps=1, ppo_epochs=1, seed=3, max_steps=1, export_final="false")


def test_actor_loss_is_the_policy_term_plus_the_kl_loss_minus_the_entropy_term(tiny, dist_single, tmp_path,
                                                                                other_reference):
    # Actor lr 0: the weights after the step are the ones every mini-batch trained with, so a forward here sees what
    # the training forwards saw (ratio 1). GAE without whitening: advantages of non-zero mean, so the policy term is
    # not 0 (whitened or group-normalised ones average to 0 at ratio 1, which a broken metric could also report). A
    # reference with other weights makes the KL loss live.
    args = train_args(tiny, str(tmp_path / "run"), whiten_advantages="false", actor_learning_rate=0.0,
                      reference_model_name_or_path=other_reference, kl_loss_coef=KL_COEF, kl_loss_estimator="k2",
                      entropy_coef=ENT_COEF, clip_eps=CLIP, **FLAGS)
    trainer = build_trainer(parse_args(args))
    rec = trainer.step()
    trainer.metrics.close()
    exp = trainer.last_experience
    minis = exp.split(trainer.cfg.batch.mini_batch_size)
    assert len(minis) == 2  # the per-mini-batch means are averaged: two of them tell a sum from a mean
    pg, kl, ent = [], [], []
    with torch.no_grad():
        for mini in minis:
            r = mini.rollout
            logprobs, entropy = trainer.engine.actor_forward(r, with_entropy=True)
            m = (r.action_mask if mini.policy_mask is None else mini.policy_mask).double()
            ratio = torch.exp(logprobs.double() - mini.old_logprobs.double())
            a = mini.advantages.double()
            per_token = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP))  # the clipped surrogate
            pg.append(float((per_token * m).sum() / m.sum()))  # token_mean over the mini-batch
            d = logprobs.double() - mini.ref_logprobs.double()
            kl.append(float((d * d / 2 * m).sum() / m.sum()))  # k2
            am = r.action_mask.double()
            ent.append(float((entropy.double() * am).sum() / am.sum()))
    policy, kl_loss, entropy = (sum(x) / len(x) for x in (pg, kl, ent))
    total = policy + KL_COEF * kl_loss - ENT_COEF * entropy
    assert rec["policy/loss"] == pytest.approx(policy, abs=1e-5)
    assert rec["policy/kl_loss"] == pytest.approx(kl_loss, abs=1e-5)
    assert rec["actor/loss"] == pytest.approx(total, abs=1e-5)
    assert rec["actor/loss"] == pytest.approx(
        rec["policy/loss"] + KL_COEF * rec["policy/kl_loss"] - ENT_COEF * entropy, abs=1e-5)
    # the two terms besides the policy term are live: logging the total as policy/loss (the code before) fails above
    assert abs(KL_COEF * kl_loss - ENT_COEF * entropy) > 100 * 1e-5, (kl_loss, entropy)
    assert abs(policy) > 100 * 1e-5 and KL_COEF * kl_loss > 100 * 1e-5, (policy, kl_loss)  # each checked term is live
    assert "reward/worker_timeouts" not in rec  # a reward model scored: no workers


def test_reward_worker_timeouts_and_restarts_are_in_the_iterations_record(tiny, dist_single, tmp_path,
                                                                         monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(__file__))  # the workers import _hang_reward from here
    monkeypatch.setenv("HANG_MARKER_DIR", str(tmp_path))
    args = train_args(tiny, str(tmp_path / "run"), advantage_estimator="grpo", reward_fn="_hang_reward:hang_first",
                      reward_workers=1, reward_timeout_s=2, reward_on_error=-1, **{**FLAGS, "max_steps": 2})
    args = [a for a in args if a not in ("--reward_model_name_or_path", tiny.reward)]
    trainer = build_trainer(parse_args(args))
    try:
        rec = trainer.step()
        scores = trainer.last_experience.scores.tolist()
        assert rec["reward/worker_timeouts"] == 1 and rec["reward/worker_restarts"] == 1, rec
        assert scores == [-1.0] + [1.0] * 7  # the first row's call hung; its successor scored the others
        rec = trainer.step()  # per iteration: nothing new happened
        assert rec["reward/worker_timeouts"] == 0 and rec["reward/worker_restarts"] == 0
    finally:
        trainer.metrics.close()
        trainer.reward_source.close()


def test_the_run_ends_its_reward_worker_processes(tiny, dist_single, tmp_path, monkeypatch):
    """`train()` closes its reward source: the --reward_workers processes are gone when it returns (negative
    control: they were alive during the run)."""
    monkeypatch.syspath_prepend(os.path.dirname(__file__))  # the workers import _hang_reward from here
    args = train_args(tiny, str(tmp_path / "run"), advantage_estimator="grpo", reward_fn="_hang_reward:ones",
                      reward_workers=2, reward_timeout_s=30, **{**FLAGS, "max_steps": 2})
    args = [a for a in args if a not in ("--reward_model_name_or_path", tiny.reward)]
    trainer = build_trainer(parse_args(args))
    trainer.step()  # the pool starts with the first scoring
    processes = [w.process for w in trainer.reward_source.loaded._pool]
    assert len(processes) == 2 and all(p.is_alive() for p in processes)
    trainer.train()  # the second iteration, then the end of the run
    assert not any(p.is_alive() for p in processes)
