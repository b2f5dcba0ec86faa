"""experience_from_update on one in-process rank: where a rank's rows are one micro-batch of one mini-batch and one
epoch, the actor's and critic's experience forwards are the update's own training forwards (a reference and a KL
penalty too): no actor or critic forward in the experience phase, the rewards and advantages computed between those
forwards and their losses. At lr 0 every ratio is exactly 1 and the actor-reference KL exactly 0; the experience and
every metric equal the run that computes them in the experience forwards (old_logprobs_from_update false, the switch
kept for this test) within fp32 noise, and so do the weights after two updates at lr > 0."""
import pytest
import torch
from _trainer_args import train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.config.ppo import experience_from_update
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.plan import forwards_summary

from _support import SPLIT, VOLATILE

# GAE with a critic and the reward's KL penalty; 4 rows a rank, one micro-batch of 4
FLAGS = dict(per_device_generation_batch_size=4, per_device_training_batch_size=4, gradient_accumulation_steps=1,
             ppo_epochs=1, seed=11, export_final="false", kl_coef=0.1)


@pytest.mark.parametrize("flags, fused", [
    ({}, True),
    ({"old_logprobs_from_update": "false"}, False),
    ({"ppo_epochs": 2}, False),
    ({"per_device_training_batch_size": 2, "gradient_accumulation_steps": 2}, False),  # two micro-batches
    ({"per_device_training_batch_size": 2}, False),  # two mini-batches
    ({"max_tokens_per_micro_batch": 64}, False),
    # the reference's forward in two chunks of 4 would not run on the training forward's tensors
    ({"generation_batches": 2, "per_device_training_batch_size": 8}, False),
    ({"generation_batches": 2, "per_device_training_batch_size": 8, "experience_micro_batch_size": 8}, True),
    ({"actor_trainable_layers": 1}, False),  # the reference replays the actor's frozen prefix
    ({"actor_trainable_layers": 1, "reuse_frozen_prefix": "false"}, True),
    ({"actor_trainable_layers": 1, "kl_coef": 0.0}, True),  # no reference: nothing replays it
])
def test_only_where_the_update_sees_the_experience_forwards_rows(tiny, tmp_path, flags, fused):
    cfg = parse_args(train_args(tiny, str(tmp_path), **{**FLAGS, **flags}))
    assert experience_from_update(cfg) == fused
    line = forwards_summary(cfg, dict.fromkeys(cfg.active_roles), "lean")
    assert ("no actor experience forward" in line) == fused, line
    assert ("no critic experience forward" in line) == fused, line


def _run(tiny, out, steps=2, **flags):
    """(trainer, records, experiences, {forward: the rows of each call}: the actor's and critic's experience and
    training forwards, actor weights)."""
    trainer = build_trainer(parse_args(train_args(tiny, str(out), max_steps=steps, **{**FLAGS, **flags})))
    engine, rows = trainer.engine, {}

    def spy(name: str, method: str) -> None:  # the rows each call of an engine forward is given
        real, rows[name] = getattr(engine, method), []

        def counted(rollout, **kw):
            rows[name].append(rollout.batch_size)
            return real(rollout, **kw)

        setattr(engine, method, counted)

    for name, method in (("actor", "actor_logprobs"), ("critic", "critic_values"), ("actor_train", "actor_forward"),
                         ("critic_train", "critic_forward")):
        spy(name, method)
    try:
        recs, exps = [], []
        for _ in range(steps):
            recs.append(trainer.step())
            exps.append(trainer.last_experience)
        return trainer, recs, exps, rows, {k: v.clone() for k, v in engine.actor.module.state_dict().items()}
    finally:
        trainer.metrics.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_at_lr0_every_ratio_is_one_and_the_kl_zero_without_experience_forwards(tiny, dist_single, tmp_path, stage):
    """ZeRO-3 too: the actor's training forward on gathered weights against the reference's own ZeRO-3 engine."""
    trainer, recs, exps, rows, _ = _run(tiny, tmp_path / "lr0", actor_learning_rate=0.0, critic_learning_rate=0.0,
                                        actor_zero_stage=stage, critic_zero_stage=stage)
    # the actor's experience forward is asked for no row (it clears the last rollout's); one training forward each
    assert rows == {"actor": [0, 0], "critic": [], "actor_train": [4, 4], "critic_train": [4, 4]}
    assert trainer.ratio_trace == [0.0, 0.0]
    for rec, exp in zip(recs, exps):
        assert rec["policy/ratio_max"] == 1.0 and rec["policy/ratio_min"] == 1.0, rec
        assert rec["objective/kl"] == 0.0 and rec["policy/clipfrac"] == 0.0, rec
        mask = exp.rollout.action_mask.bool()
        # the training forward's log-probs are the reference's, bit for bit (the same weights on the same tensors)
        assert torch.equal(exp.old_logprobs, exp.ref_logprobs) and (exp.old_logprobs[mask] < 0).all()
        assert exp.values[mask].abs().sum() > 0 and (exp.values[~mask] == 0).all()
        assert not exp.old_logprobs.requires_grad and not exp.values.requires_grad


@pytest.mark.parametrize("kl_coef", [0.1, 0.0])
def test_the_run_equals_the_one_with_experience_forwards(tiny, dist_single, tmp_path, kl_coef):
    """kl_coef 0: no reference, where the first mini-batch's deferral (defers_old_logprobs) would apply too; the
    experience's metrics (entropy, rollout check) are counted once."""
    lr = dict(actor_learning_rate=1e-3, critic_learning_rate=1e-3, kl_coef=kl_coef)
    _, on_recs, on_exps, on_rows, on_w = _run(tiny, tmp_path / "on", **lr)
    _, off_recs, off_exps, off_rows, off_w = _run(tiny, tmp_path / "off", old_logprobs_from_update="false", **lr)
    assert on_rows == {"actor": [0, 0], "critic": [], "actor_train": [4, 4], "critic_train": [4, 4]}
    assert off_rows == {"actor": [4, 4], "critic": [4, 4], "actor_train": [4, 4], "critic_train": [4, 4]}
    a, b = on_exps[0], off_exps[0]  # iteration 0 sampled the same rollouts (same seed, same weights)
    assert torch.equal(a.rollout.sequences, b.rollout.sequences)
    for name in ("old_logprobs", "values", "rewards", "advantages", "returns"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=2e-5, msg=name)
    # negative control: the experience forwards' numbers are far from 0, what rows left without them would hold
    assert b.old_logprobs.abs().sum() > 1.0 and b.values.abs().sum() > 0.1
    for x, y in zip(on_recs, off_recs):
        keys = [k for k in y if not k.startswith(VOLATILE + SPLIT) and isinstance(y[k], float)]
        assert {"objective/entropy", "value/loss", "value/explained_var", "policy/loss"} <= set(keys)
        assert ("objective/kl" in keys) == bool(kl_coef)
        assert {k: x[k] for k in keys} == pytest.approx({k: y[k] for k in keys}, rel=1e-4, abs=1e-6)
    if kl_coef:
        assert on_recs[1]["objective/kl"] != 0.0  # lr > 0: iteration 1's actor has moved from the reference
    for k in on_w:
        torch.testing.assert_close(on_w[k], off_w[k], rtol=1e-5, atol=1e-6)
