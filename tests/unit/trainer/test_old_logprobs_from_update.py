"""--old_logprobs_from_update on one in-process rank: where nothing reads the old log-probs before training (no
reference, no rollout correction that masks tokens) and one epoch reads them, the first mini-batch's come from its own
training forward (detached) and the experience forward runs only on the later mini-batches' rows; a truncate
correction's weights for those rows come from the same forward. The lr-0 invariants hold exactly; the experience left
behind (old log-probs and correction weights of every row) and every metric equal the run that computes them all in
the experience forward (false, the switch kept for this test) within fp32 noise."""
import dataclasses

import pytest
import torch
from _trainer_args import train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.plan import forwards_summary

from _support import SPLIT, VOLATILE

# 8 rows per iteration (4 prompts x 2 samples), mini-batches of 4 rows (one micro-batch of 2 + one of 2), GRPO
FLAGS = dict(advantage_estimator="grpo", per_device_generation_batch_size=4, n_samples_per_prompt=2,
             per_device_training_batch_size=2, gradient_accumulation_steps=2, ppo_epochs=1, seed=7,
             export_final="false", kl_coef=0.0, kl_loss_coef=0.0, actor_trainable_layers=1)


@pytest.mark.parametrize("flags, defers", [
    ({}, True),
    ({"old_logprobs_from_update": "false"}, False),
    ({"ppo_epochs": 2}, False),  # a second epoch would recompute the rows' frozen prefix
    ({"monitor_reference_kl": "true"}, False),  # objective/kl reads the old log-probs with the reference's
    ({"kl_coef": 0.05}, False),  # the reward's KL penalty reads them
    ({"kl_loss_coef": 0.01}, False),
    ({"rollout_correction": "token_truncate"}, True),  # its weights scale the loss only: the forward computes them
    ({"rollout_correction": "sequence_truncate"}, True),
    ({"rollout_correction": "token_mask"}, False),  # a mask changes the mini-batch's token counts before its forward
    ({"rollout_correction": "sequence_mask"}, False),
])
def test_deferred_only_where_nothing_reads_them_before_training(tiny, tmp_path, flags, defers):
    cfg = parse_args(train_args(tiny, str(tmp_path), **{**FLAGS, **flags}))
    assert cfg.ppo.defers_old_logprobs == defers
    line = forwards_summary(cfg, dict.fromkeys(cfg.active_roles), "lean")
    assert ("actor experience forward on the rows after the first mini-batch" in line) == defers, line


def _run(tiny, out, steps=2, shift=0.0, **flags):
    """`shift`: the generation log-probs of every other row lowered by that much (as a backend that does not sample
    exactly what PPO scores would give them), so that a rollout correction has weights other than 1."""
    trainer = build_trainer(parse_args(train_args(tiny, str(out), max_steps=steps, **{**FLAGS, **flags})))
    rows, real = [], trainer.engine.actor_logprobs
    if shift:
        sample = trainer.engine.sample

        def shifted(ids, mask):
            g = sample(ids, mask)
            odd = (torch.arange(g.logprobs.shape[0]) % 2)[:, None].to(g.logprobs)
            return dataclasses.replace(g, logprobs=g.logprobs - shift * odd * g.rollout.action_mask)

        trainer.engine.sample = shifted

    def spy(rollout, **kw):  # the rows each experience forward of the actor is given
        rows.append(rollout.batch_size)
        return real(rollout, **kw)

    trainer.engine.actor_logprobs = spy
    try:
        recs, exps = [], []
        for _ in range(steps):
            recs.append(trainer.step())
            exps.append(trainer.last_experience)
        return trainer, recs, exps, rows, {k: v.clone() for k, v in trainer.engine.actor.module.state_dict().items()}
    finally:
        trainer.metrics.close()


def test_at_lr0_every_ratio_is_exactly_one_and_the_experience_forward_skips_the_first_mini_batch(
        tiny, dist_single, tmp_path):
    trainer, recs, exps, rows, _ = _run(tiny, tmp_path / "lr0", actor_learning_rate=0.0)
    assert rows == [4, 4]  # 8 rows an iteration; the first mini-batch's 4 never reach the experience forward
    assert trainer.ratio_trace == [0.0] * 4  # 2 iterations x 2 mini-batches: |log ratio| exactly 0 everywhere
    for rec, exp in zip(recs, exps):
        assert rec["policy/ratio_max"] == 1.0 and rec["policy/ratio_min"] == 1.0, rec
        assert rec["policy/clipfrac"] == 0.0 and rec["policy/approx_kl"] == 0.0, rec
        # the first mini-batch's old log-probs were written back: real tokens carry log-probs, padding 0
        mask = exp.rollout.action_mask[:4].bool()
        assert (exp.old_logprobs[:4][mask] < 0).all() and (exp.old_logprobs[:4][~mask] == 0).all()


def test_the_run_equals_the_one_computing_every_old_logprob_first(tiny, dist_single, tmp_path):
    on, on_recs, on_exps, on_rows, on_w = _run(tiny, tmp_path / "on", actor_learning_rate=1e-3)
    off, off_recs, off_exps, off_rows, off_w = _run(tiny, tmp_path / "off", actor_learning_rate=1e-3,
                                                    old_logprobs_from_update="false")
    assert on_rows == [4, 4] and off_rows == [8, 8]
    # iteration 0 sampled the same rollouts (same seed, same weights): the old log-probs of every row agree, the first
    # mini-batch's from its training forward (negative control: left at 0 they would differ by whole nats)
    a, b = on_exps[0], off_exps[0]
    assert torch.equal(a.rollout.sequences, b.rollout.sequences)
    torch.testing.assert_close(a.old_logprobs, b.old_logprobs, rtol=0, atol=1e-5)
    assert b.old_logprobs[:4].abs().sum() > 1.0
    for x, y in zip(on_recs, off_recs):
        keys = [k for k in y if not k.startswith(VOLATILE + SPLIT) and isinstance(y[k], float)]
        assert "objective/entropy" in keys and "rollout/logprob_diff_max" in keys
        assert keys and {k: x[k] for k in keys} == pytest.approx({k: y[k] for k in keys}, rel=1e-5, abs=1e-6)
    assert on_recs[1]["policy/ratio_max"] > 1.0  # lr > 0: the second mini-batch trained on moved weights
    for k in on_w:
        torch.testing.assert_close(on_w[k], off_w[k], rtol=1e-5, atol=1e-6)


def test_a_whole_batch_in_one_mini_batch_runs_no_experience_forward(tiny, dist_single, tmp_path):
    trainer, recs, exps, rows, _ = _run(tiny, tmp_path / "one", steps=1, actor_learning_rate=0.0,
                                        gradient_accumulation_steps=4)
    assert rows == [0] and trainer.ratio_trace == [0.0]
    assert recs[0]["objective/entropy"] > 0 and recs[0]["policy/ratio_max"] == 1.0
    mask = exps[0].rollout.action_mask.bool()
    assert (exps[0].old_logprobs[mask] < 0).all()


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_a_truncate_correction_of_the_first_mini_batch_equals_the_one_computed_first(tiny, dist_single, tmp_path,
                                                                                     mode):
    """Every other row's generation log-probs 0.1 nats low: its tokens' ratio is exp(0.1) = 1.105 (a response's,
    exp(0.1 n)), over the cap of 1.05 (a weight of 1.05, counted as capped). The deferred run (the first
    mini-batch's weights from its own forward) and the run computing every old log-prob first have equal weights in
    the experience, equal metrics (the correction's capped share and largest |w - 1| among them) and equal final
    weights."""
    flags = dict(actor_learning_rate=1e-3, rollout_correction=mode, rollout_correction_cap=1.05, shift=0.1)
    on, on_recs, on_exps, on_rows, on_w = _run(tiny, tmp_path / "on", **flags)
    off, off_recs, off_exps, off_rows, off_w = _run(tiny, tmp_path / "off", old_logprobs_from_update="false", **flags)
    assert on_rows == [4, 4] and off_rows == [8, 8]
    a, b = on_exps[0], off_exps[0]
    torch.testing.assert_close(a.advantage_weights, b.advantage_weights, rtol=0, atol=1e-5)
    mask = b.rollout.action_mask.bool()
    odd = (torch.arange(mask.shape[0]) % 2 == 1)[:, None] & mask
    assert torch.allclose(b.advantage_weights[odd], torch.tensor(1.05)), b.advantage_weights  # capped
    assert (b.advantage_weights[mask & ~odd] - 1).abs().max() < 1e-4  # sampled as scored: weight 1
    for x, y in zip(on_recs, off_recs):
        assert y["rollout/correction_capped_frac"] > 0.3 and y["rollout/correction_weight_dev_max"] > 0.04
        keys = [k for k in y if not k.startswith(VOLATILE + SPLIT) and isinstance(y[k], float)]
        assert {k: x[k] for k in keys} == pytest.approx({k: y[k] for k in keys}, rel=1e-5, abs=1e-6)
    for k in on_w:
        torch.testing.assert_close(on_w[k], off_w[k], rtol=1e-5, atol=1e-6)
