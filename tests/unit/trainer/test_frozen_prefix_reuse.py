"""--reuse_frozen_prefix through the trainer on one in-process rank (the tiny GPT-2, its top block trained, block 0 the
frozen prefix): every later forward of an iteration (the reference's, each training forward) starts from the
experience forward's kept output; the lr-0 invariants hold exactly with it; and a run with it equals the same run
computing every block (--reuse_frozen_prefix false, today's path) within fp32 noise."""
import pytest
import torch
from _trainer_args import train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.trainer import build_trainer

from _support import SPLIT, VOLATILE

FLAGS = dict(per_device_generation_batch_size=4, per_device_training_batch_size=2, gradient_accumulation_steps=1,
             ppo_epochs=2, seed=5, export_final="false", actor_trainable_layers=1, kl_coef=0.1)


def _run(tiny, out, steps=2, **flags):
    trainer = build_trainer(parse_args(train_args(tiny, str(out), max_steps=steps, **{**FLAGS, **flags})))
    try:
        recs = [trainer.step() for _ in range(steps)]
        return trainer, recs, {k: v.clone() for k, v in trainer.engine.actor.module.state_dict().items()}
    finally:
        trainer.metrics.close()


def test_at_lr0_every_later_forward_reuses_the_prefix_and_every_ratio_is_one(tiny, dist_single, tmp_path):
    trainer, recs, _ = _run(tiny, tmp_path / "lr0", actor_learning_rate=0.0, critic_learning_rate=0.0)
    assert trainer.engine.frozen_prefix is not None and trainer.engine._reference_blocks is not None
    for rec in recs:
        # 2 reference chunks + 2 epochs x 2 training micro-batches, each on the experience chunk's rows
        assert rec["batch/frozen_prefix_reused"] == 1.0, rec
        assert rec["memory/frozen_prefix_mib"] > 0
        assert rec["policy/ratio_max"] == 1.0 and rec["policy/ratio_min"] == 1.0, rec
        assert rec["objective/kl"] == 0.0 and rec["policy/clipfrac"] == 0.0, rec


def test_the_run_equals_the_one_computing_every_block(tiny, dist_single, tmp_path):
    on, on_recs, on_w = _run(tiny, tmp_path / "on", actor_learning_rate=1e-3)
    off, off_recs, off_w = _run(tiny, tmp_path / "off", actor_learning_rate=1e-3, reuse_frozen_prefix="false")
    assert off.engine.frozen_prefix is None and "batch/frozen_prefix_reused" not in off_recs[0]
    assert all(r["batch/frozen_prefix_reused"] == 1.0 for r in on_recs)
    for a, b in zip(on_recs, off_recs):
        keys = [k for k in b if not k.startswith(VOLATILE + SPLIT) and isinstance(b[k], float)]
        assert keys and {k: a[k] for k in keys} == pytest.approx({k: b[k] for k in keys}, rel=1e-5, abs=1e-6)
    assert on_recs[1]["policy/ratio_max"] > 1.0  # lr > 0: the comparison covers updated weights (not a no-op)
    for k in on_w:
        torch.testing.assert_close(on_w[k], off_w[k], rtol=1e-5, atol=1e-6)


def test_off_under_zero3(tiny, dist_single, tmp_path):
    trainer = build_trainer(parse_args(train_args(tiny, str(tmp_path), max_steps=1, actor_zero_stage=3, **FLAGS)))
    trainer.metrics.close()
    assert trainer.engine.frozen_prefix is None
