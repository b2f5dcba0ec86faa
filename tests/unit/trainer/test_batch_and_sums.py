"""Batch arithmetic errors, the optimizer-steps count, and the trainer's metric accumulator `MetricSums` (one rank)."""
import pytest
import torch

from rlhf_engine.cli import parse_args
from rlhf_engine.errors import ConfigError
from rlhf_engine.trainer import updates_per_iteration
from rlhf_engine.trainer.metric_sums import MetricSums


def _args(**flags):
    base = dict(actor_model_name_or_path="/nonexistent/actor", data_path="/nonexistent/p.jsonl")
    base.update(flags)
    return [x for k, v in base.items() for x in (f"--{k}", str(v))]


def test_batch_that_does_not_divide_names_every_field_and_value():
    # 3 x 2 = 6 rollouts per rank, mini-batch 4 x 1 = 4: 6 % 4 != 0
    with pytest.raises(ConfigError) as e:
        parse_args(_args(per_device_generation_batch_size=3, generation_batches=2, per_device_training_batch_size=4,
                         gradient_accumulation_steps=1))
    msg = str(e.value)
    for text in ("per_device_generation_batch_size (3)", "generation_batches (2)", "= 6",
                 "per_device_training_batch_size (4)", "gradient_accumulation_steps (1)", "= 4"):
        assert text in msg, (text, msg)


def test_every_batch_problem_at_once():
    with pytest.raises(ConfigError) as e:
        parse_args(_args(per_device_generation_batch_size=0, gradient_accumulation_steps=-1))
    fields = {p.field for p in e.value.problems}
    assert {"per_device_generation_batch_size", "gradient_accumulation_steps"} <= fields, fields


@pytest.mark.parametrize("gen,batches,micro,acc,epochs,expected", [
    (4, 1, 4, 1, 1, 1),  # one mini-batch per epoch
    (4, 2, 2, 2, 2, 4),  # 8 rollouts / mini 4 = 2 per epoch, 2 epochs
    (6, 1, 1, 3, 3, 6),  # 6 / 3 = 2 per epoch, 3 epochs
])
def test_updates_per_iteration(gen, batches, micro, acc, epochs, expected):
    cfg = parse_args(_args(per_device_generation_batch_size=gen, generation_batches=batches,
                           per_device_training_batch_size=micro, gradient_accumulation_steps=acc, ppo_epochs=epochs))
    assert updates_per_iteration(cfg) == expected


def test_sums_accumulate_in_float64_and_reduce_once():
    s = MetricSums()
    s.add("a", torch.tensor(1.0, dtype=torch.float32))
    s.add("a", torch.tensor(2.5))
    s.add("b", 3)
    s.max("hi", torch.tensor(-1.0))
    s.max("hi", torch.tensor(4.0))
    s.max("hi", torch.tensor(2.0))
    s.min("lo", torch.tensor(5.0))
    s.min("lo", torch.tensor(-3.0))
    for _ in range(10):  # 1e-8 increments vanish in fp32 next to 1.0, not in fp64
        s.add("tiny", torch.tensor(1e-8))
    s.add("tiny", torch.tensor(1.0))
    assert all(v.dtype == torch.float64 for v in s.sums.values())
    out = s.reduce()
    assert out == {"a": 3.5, "b": 3.0, "hi": 4.0, "lo": -3.0, "tiny": pytest.approx(1.0 + 1e-7, abs=1e-12)}
    assert MetricSums().reduce() == {}
