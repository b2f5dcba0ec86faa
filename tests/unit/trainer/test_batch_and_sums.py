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


def test_explained_variance_from_the_reduced_sums_by_hand():
    """Real tokens: returns [1, 2, 4] (two rows, padding masked), values [1, 1, 1] -> residuals [0, 1, 3].
    Unbiased variances: returns 7/3, residuals 7/3 too (the same spread) -> 0; values = returns -> 1."""
    from rlhf_engine.rollout import Experience, Rollout, pad_prompts
    from rlhf_engine.trainer.ppo_metrics import add_value_moments, explained_var

    ids, mask = pad_prompts([[5, 6], [7]], 0)
    rollout = Rollout.from_responses(ids, mask, [[11, 12], [13]], 0)
    returns = torch.tensor([[1.0, 2.0], [4.0, 99.0]])  # 99 sits on padding: must not count
    zeros = torch.zeros(2, 2)

    def ev(values):
        exp = Experience(rollout=rollout, old_logprobs=zeros, ref_logprobs=zeros, values=values,
                         scores=torch.zeros(2), rewards=zeros, kl=zeros, advantages=zeros, returns=returns)
        s = MetricSums()
        add_value_moments(s, exp)
        return explained_var(s.reduce())

    assert ev(torch.ones(2, 2)) == pytest.approx(0.0, abs=1e-6)
    assert ev(returns.clone()) == pytest.approx(1.0, abs=1e-12)
    half = torch.tensor([[0.5, 1.0], [2.0, 0.0]])  # residuals [0.5, 1, 2]: var 7/12 -> 1 - (7/12) / (7/3) = 0.75
    assert ev(half) == pytest.approx(0.75, abs=1e-6)
    assert explained_var({}) is None  # no critic


def test_moments_are_float64_from_the_first_product():
    """Values far from 0 with a small spread: 10000 + [0, 1, 2, 3] (exact in fp32), unbiased variance 5/3. Summed in
    float64 from the first product the variance is exact to 1e-9. Negative control: the same sums taken in fp32 and
    cast to float64 afterwards (x*x ~ 1e8 has an fp32 ulp of 8) lose it."""
    from rlhf_engine.trainer.experience import global_moments, moments_from_sums

    x = torch.tensor([[10000.0, 10001.0, 7.0], [10002.0, 10003.0, -5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    n, mean, var = global_moments(x, mask)
    assert float(n) == 4 and float(mean) == 10001.5
    assert var.dtype == torch.float32 and abs(float(var) - 5 / 3) < 1e-6
    m = mask.float()
    xf = x * m
    fp32_sums = torch.stack([m.sum(), xf.sum(), (xf * xf).sum()]).double()
    assert abs(float(moments_from_sums(*fp32_sums)[1]) - 5 / 3) > 0.1  # the fault this guards against
