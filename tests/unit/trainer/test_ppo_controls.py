"""PPO controls through the trainer on one in-process rank: the adaptive KL controller fed with objective/kl (and its
state through the checkpoint providers), critic warm-up, and the run length from num_train_epochs."""
import pytest
import torch

from _trainer_args import train_args
from rlhf_engine.cli import parse_args
from rlhf_engine.config import TrainConfig
from rlhf_engine.errors import ConfigError
from rlhf_engine.ppo_math import AdaptiveKLController
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.plan import total_iterations
from rlhf_engine.trainer.state import providers_of

BASE = dict(per_device_generation_batch_size=4, per_device_training_batch_size=4, ppo_epochs=1, seed=4,
            actor_learning_rate=1e-3, critic_learning_rate=1e-3, export_final="false")


def _expected(value, kl, n, target, horizon):
    return value * (1 + min(max(kl / target - 1, -0.2), 0.2) * n / horizon)


def test_adaptive_kl_follows_objective_kl_in_the_documented_direction(tiny, other_reference, dist_single, tmp_path):
    # a reference with other weights: objective/kl starts far above a small target, so the coefficient grows; below
    # a huge target it shrinks. (Seed 5: the k1 estimate of 4 responses can come out negative, as seed 4's draw did.)
    for target, grows in ((0.01, True), (1e6, False)):
        cfg = parse_args(train_args(tiny, str(tmp_path / str(target)), max_steps=3, adaptive_kl="true",
                                    kl_coef=0.1, kl_target=target, kl_horizon=100,
                                    reference_model_name_or_path=other_reference, **{**BASE, "seed": 5}))
        trainer = build_trainer(cfg)
        recs = [trainer.step() for _ in range(3)]
        trainer.metrics.close()
        coefs = [r["system/kl_coef"] for r in recs] + [trainer.kl_ctl.value]
        assert recs[0]["objective/kl"] > 0.05
        for i, rec in enumerate(recs):  # each iteration's objective/kl and sequence count move it, exactly
            assert coefs[i + 1] == pytest.approx(_expected(coefs[i], rec["objective/kl"], 4, target, 100), rel=1e-12)
            # up when the measured KL is above the target, down below (the k1 estimate may come out negative)
            assert (coefs[i + 1] > coefs[i]) == (rec["objective/kl"] > target), (coefs, rec["objective/kl"])
        assert (coefs[1] > coefs[0]) == grows, coefs
        # the controller's state is a checkpoint provider and survives a state_dict round trip
        providers = providers_of(trainer)
        assert providers["kl_controller"] is trainer.kl_ctl
        fresh = AdaptiveKLController(0.1, target, 100)
        fresh.load_state_dict(providers["kl_controller"].state_dict())
        assert fresh.value == trainer.kl_ctl.value
        fresh.update(recs[-1]["objective/kl"], 4)
        trainer.kl_ctl.update(recs[-1]["objective/kl"], 4)
        assert fresh.value == trainer.kl_ctl.value


def test_critic_warmup_trains_only_the_critic_first(tiny, dist_single, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path), max_steps=3, critic_warmup_iterations=2, **BASE))
    trainer = build_trainer(cfg)
    actor0 = {k: v.clone() for k, v in trainer.engine.actor.module.state_dict().items()}
    critic0 = {k: v.clone() for k, v in trainer.engine.critic.module.state_dict().items()}
    recs = []
    for _ in range(3):
        recs.append(trainer.step())
        if trainer.iteration == 2:  # end of the warm-up
            assert all(torch.equal(v, actor0[k]) for k, v in trainer.engine.actor.module.state_dict().items())
            assert not all(torch.equal(v, critic0[k]) for k, v in trainer.engine.critic.module.state_dict().items())
    trainer.metrics.close()
    assert [r["system/optimizer_steps"] for r in recs] == [0, 0, 1]  # the actor's
    assert trainer.engine.optimizer_steps("critic") == 3
    assert ["policy/loss" in r for r in recs] == [False, False, True]  # no policy keys while the actor rests
    assert all("value/loss" in r for r in recs)
    assert len(trainer.ratio_trace) == 1  # one mini-batch of actor training


def test_total_iterations_from_epochs():
    cfg = TrainConfig()
    cfg.max_steps, cfg.batch.generation_batches = 100, 2
    assert total_iterations(cfg, 8) == 100  # num_train_epochs 0: max_steps
    cfg.num_train_epochs = 1
    assert total_iterations(cfg, 8) == 4  # 8 generation batches per epoch, 2 per iteration
    cfg.num_train_epochs = 3
    assert total_iterations(cfg, 5) == 7  # floor(3 * 5 / 2): an iteration may straddle two epochs
    cfg.max_steps = 6
    assert total_iterations(cfg, 5) == 6  # max_steps still caps
    cfg.num_train_epochs, cfg.batch.generation_batches = 1, 9
    with pytest.raises(ConfigError, match="num_train_epochs = 1: 1 epoch"):
        total_iterations(cfg, 8)


def test_num_train_epochs_sets_the_run_length(tiny, dist_single, tmp_path):
    # 32 prompts, generation batch 8 on one rank: 4 batches per epoch; 2 per iteration -> 2 iterations per epoch
    cfg = parse_args(train_args(tiny, str(tmp_path), max_steps=50, num_train_epochs=1, generation_batches=2,
                                **{**BASE, "per_device_generation_batch_size": 8, "per_device_training_batch_size": 8}))
    trainer = build_trainer(cfg)
    assert trainer.total_iterations == 2
    records = trainer.train()
    assert [r["iteration"] for r in records] == [0, 1]
    assert trainer._batches.epoch == 1 and trainer._batches.batch == 0  # exactly one pass over the prompts
