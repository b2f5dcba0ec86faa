"""A bf16 PPO run whose Linear layers take the fp32 kernel (cpu_bf16_matmul fp32, engine/cpu_matmul.py), on one
in-process rank: every engine's layers are swapped, and the lr-0 invariants hold exactly (every ratio 1, the
actor-reference KL 0), the experience, reference and training forwards taking the same kernels."""
import pytest
import torch
from _trainer_args import train_args
from torch import nn
from transformers.pytorch_utils import Conv1D

from rlhf_engine.cli import parse_args
from rlhf_engine.engine.cpu_matmul import has_fp32_kernel_layers
from rlhf_engine.trainer import build_trainer

FLAGS = dict(per_device_generation_batch_size=4, per_device_training_batch_size=2, gradient_accumulation_steps=1,
             ppo_epochs=2, seed=5, export_final="false", kl_coef=0.1, dtype="bf16", actor_zero_stage=2,
             critic_zero_stage=2, actor_learning_rate=0.0, critic_learning_rate=0.0)


@pytest.mark.parametrize("stage", [2, 3])
def test_at_lr0_every_ratio_is_one_with_the_fp32_kernel(tiny, dist_single, tmp_path, stage):
    """ZeRO-3 too: its partitioned weights are gathered for the layers' backward as for PyTorch's own Linear (the
    replica it generates on takes the same kernels: test_generation_replica)."""
    args = {**FLAGS, "actor_zero_stage": stage, "critic_zero_stage": stage,
            **{f"{r}_cpu_bf16_matmul": "fp32" for r in ("actor", "reference", "critic", "reward")}}
    trainer = build_trainer(parse_args(train_args(tiny, str(tmp_path), max_steps=2, **args)))
    try:
        engine = trainer.engine
        assert {r: p.matmul for r, p in engine.plans.items()} == dict.fromkeys(engine.plans, "fp32")
        for role, e in engine.engines.items():
            layers = list(e.module.modules())
            assert not any(type(m) in (nn.Linear, Conv1D) for m in layers), role  # every one swapped
            assert has_fp32_kernel_layers(e.module), role
            assert next(e.module.parameters()).dtype == torch.bfloat16
        recs = [trainer.step() for _ in range(2)]
    finally:
        trainer.metrics.close()
    for rec in recs:
        assert rec["policy/ratio_max"] == 1.0 and rec["policy/ratio_min"] == 1.0, rec
        assert rec["objective/kl"] == 0.0 and rec["policy/clipfrac"] == 0.0, rec


def test_negative_control_a_reference_on_the_other_kernel_is_not_at_kl_0(tiny, dist_single, tmp_path):
    """The invariant above needs the same kernels: a reference left on the bf16 kernels sees other roundings."""
    args = {**FLAGS, "actor_cpu_bf16_matmul": "fp32", "reference_cpu_bf16_matmul": "native"}
    trainer = build_trainer(parse_args(train_args(tiny, str(tmp_path), max_steps=1, **args)))
    try:
        rec = trainer.step()
    finally:
        trainer.metrics.close()
    assert rec["objective/kl"] != 0.0 and rec["policy/ratio_max"] == 1.0, rec
