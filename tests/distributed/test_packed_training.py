"""Packed rows and token-budget micro-batches on real DeepSpeed engines (CPU, gloo), tiny GPT-2: 1 rank vs 2 ranks
with ragged micro-batch counts, against padded row-count micro-batches, and lr 0.

With --max_tokens_per_micro_batch the ranks cut their mini-batches into different numbers of micro-batches (their
responses differ in length); they agree on the largest count and a rank with fewer runs empty ones (weight 0), so
DeepSpeed's accumulation boundary comes at the same micro-batch on every rank. The losses are normalised by the
global token and sequence counts, so the update does not depend on the split.

ZeRO-3 (actor and critic at 3, so reference and reward too): packed equals padded on 2 ranks, with two micro-batches
accumulated per optimizer step; the packed causal-LM forward must run inside DeepSpeed's forward, where ZeRO-3 counts
micro-batches (calling the model's parts directly, the second micro-batch's gradient replaced the first's: actor
parameters 8e-4 apart after an update of 4e-4, ratios 0.06 apart). The lr-0 run is at ZeRO-3 too, with a token budget
(empty micro-batches under ZeRO-3's collectives). The runs share their launches with test_ppo_trainer.py's
(tests/_support.py, SharedHarness)."""
import os

import pytest

from _support import compare_runs, ppo_args

ATOL = 1e-5
MAX_LOG_RATIO_LR0 = 1e-6
BUDGET = 40  # tokens: prompts of 3-20 tokens + responses of 1-8, so 2 to 4 rows per micro-batch
RUN = dict(do_sample="false", max_steps=2, ppo_epochs=2, seed=3, actor_learning_rate=2e-4, critic_learning_rate=2e-4)
ZERO3 = dict(actor_zero_stage=3, critic_zero_stage=3)  # reference and reward follow at 3


def harness_runs(tiny, tmp):
    """This module's runs of the shared ppo_checks.py launches (tests/_support.py: SharedHarness)."""
    d = lambda name: os.path.join(tmp, name)  # noqa: E731
    two = [
        {"name": "tokens_2r", "args": ppo_args(tiny, d("tokens_2r"), per_device_generation_batch_size=4,
                                                per_device_training_batch_size=2, gradient_accumulation_steps=2,
                                                max_tokens_per_micro_batch=BUDGET, packing="on", **RUN)},
        {"name": "lr0_tokens_z3_2r", "args": ppo_args(tiny, d("lr0_tokens_z3_2r"), per_device_generation_batch_size=4,
                                                       generation_batches=2, per_device_training_batch_size=2,
                                                       gradient_accumulation_steps=2,
                                                       max_tokens_per_micro_batch=BUDGET, packing="on", max_steps=2,
                                                       ppo_epochs=2, seed=1, actor_learning_rate=0.0,
                                                       critic_learning_rate=0.0, **ZERO3)},
        *[{"name": f"z3_{packing}_2r", "args": ppo_args(tiny, d(f"z3_{packing}_2r"), per_device_generation_batch_size=4,
                                                        per_device_training_batch_size=2,
                                                        gradient_accumulation_steps=2, packing=packing,
                                                        **{**RUN, "max_steps": 1}, **ZERO3)}
          for packing in ("on", "off")],
    ]
    one = [
        {"name": "tokens_1r", "args": ppo_args(tiny, d("tokens_1r"), per_device_generation_batch_size=8,
                                                per_device_training_batch_size=4, gradient_accumulation_steps=2,
                                                max_tokens_per_micro_batch=BUDGET, packing="on", **RUN)},
        {"name": "rows_padded_1r", "args": ppo_args(tiny, d("rows_padded_1r"), per_device_generation_batch_size=8,
                                                     per_device_training_batch_size=4, gradient_accumulation_steps=2,
                                                     packing="off", **RUN)},
    ]
    return {"two_rank": two, "one_rank": one}


@pytest.fixture(scope="module")
def runs(ppo_harness):
    return {**ppo_harness.runs(__name__, "two_rank"), **ppo_harness.runs(__name__, "one_rank")}


@pytest.mark.distributed
def test_token_budget_on_two_ranks_equals_one_rank_and_padded_rows(runs):
    ref = runs["rows_padded_1r"]
    assert ref["max_param_change"]["actor"] > 50 * ATOL  # it learned: equality is not trivial
    for name in ("tokens_1r", "tokens_2r"):
        metric, params = compare_runs(runs[name], ref)
        metric = {k: v for k, v in metric.items() if not k.startswith("batch/")}  # the split itself differs
        assert max(metric.values()) <= ATOL, (name, metric)
        assert max(params.values()) <= ATOL, (name, params)
        assert runs[name]["optimizer_steps"] == ref["optimizer_steps"], name
    # the split did differ: more micro-batches than rows / 4, and a rank ran an empty one
    recs = runs["tokens_2r"]["records"]
    assert any(r["batch/micro_batches"] > 2 * 2 for r in recs), recs  # 2 epochs x 2 row micro-batches per rank
    assert any(r["batch/empty_micro_batches"] > 0 for r in recs), [r["batch/empty_micro_batches"] for r in recs]
    assert all(r["batch/packed_padding_fraction"] <= r["batch/padding_fraction"] for r in recs)
    assert any(r["batch/packed_padding_fraction"] < r["batch/padding_fraction"] for r in recs)


@pytest.mark.distributed
def test_lr0_ratio_one_with_packing_and_token_budget_at_zero3(runs):
    run = runs["lr0_tokens_z3_2r"]
    assert max(run["ratio_trace"]) <= MAX_LOG_RATIO_LR0, run["ratio_trace"]
    assert all(r["objective/kl"] == 0.0 for r in run["records"])
    assert set(run["max_param_change"].values()) == {0.0}
    assert any(r["batch/empty_micro_batches"] > 0 for r in run["records"])  # ZeRO-3 collectives on an empty one
    # ZeRO-0 (tokens_2r, lr > 0): each step's first epoch comes before any update, so its ratios are exactly 1 too
    assert max(runs["tokens_2r"]["ratio_trace"][0::2]) <= MAX_LOG_RATIO_LR0, runs["tokens_2r"]["ratio_trace"]


@pytest.mark.distributed
def test_packed_equals_padded_at_zero3(runs):
    packed, padded = runs["z3_on_2r"], runs["z3_off_2r"]
    assert padded["max_param_change"]["actor"] > 20 * ATOL  # it learned: equality is not trivial
    metric, params = compare_runs(packed, padded)
    assert max(metric.values()) <= ATOL, metric
    assert max(params.values()) <= ATOL, params
    assert packed["optimizer_steps"] == padded["optimizer_steps"] == {"actor": [0, 2], "critic": [0, 2]}  # 2 epochs
    assert all(r["batch/packed_padding_fraction"] < r["batch/padding_fraction"] for r in packed["records"])
