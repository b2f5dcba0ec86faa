"""Update guards on one in-process rank (trainer/guards.py): an injected non-finite gradient in ONE engine skips the
update of BOTH, leaving weights, Adam moments and LR schedules untouched and counting the skip; K skips in a row stop
the run with exit code 3; a non-finite loss / advantage and a failing reward function stop the run naming rank,
iteration and tensor (or function). The cross-rank versions run in tests/distributed/test_trainer_extensions.py."""
import logging
import math
import sys
import types

import pytest
import torch

from _trainer_args import train_args
from rlhf_engine.cli import parse_args
from rlhf_engine.rewards import RewardFunctionError, load_reward_fn
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.experience import text_reward
from rlhf_engine.hooks import Injection
from rlhf_engine.trainer.guards import (EXIT_NON_FINITE, EXIT_SKIPPED_STEPS, NonFiniteError,
                                        TooManySkippedSteps, base_optimizer)
from rlhf_engine.trainer.reward_sources import RewardFnSource

# one rank, 4 rollouts per iteration, micro-batch 2 x accumulation 2 = one optimizer step per engine per iteration;
# a linear schedule with warm-up so that an advanced schedule would show in the learning rate
FLAGS = dict(per_device_generation_batch_size=4, per_device_training_batch_size=2, gradient_accumulation_steps=2,
             ppo_epochs=1, seed=3, actor_learning_rate=1e-3, critic_learning_rate=1e-3,
             actor_lr_scheduler_type="linear", actor_num_warmup_steps=2, critic_lr_scheduler_type="linear",
             critic_num_warmup_steps=2, export_final="false")


def _build(tiny, out, **flags):
    trainer = build_trainer(parse_args(train_args(tiny, str(out), **{**FLAGS, **flags})))
    return trainer


def _snapshot(trainer):
    """Weights, Adam moments (and step counts) and learning rate of both trained engines (CPU copies)."""
    out = {}
    for role in ("actor", "critic"):
        ds = trainer.engine.engines[role]
        opt = base_optimizer(ds.optimizer)
        state = {}
        for i, (p, st) in enumerate(opt.state.items()):
            state[i] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        out[role] = {"params": trainer.engine.full_state_dict(role),  # ZeRO-3 consolidated
                     "moments": state, "lr": [g["lr"] for g in opt.param_groups],
                     "steps": trainer.engine.optimizer_steps(role)}
    return out


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("stages,dtype", [((0, 0), "fp32"), ((3, 3), "fp32"), ((2, 2), "bf16")],
                         ids=["zero0", "zero3", "zero2_bf16"])
def test_nonfinite_gradient_in_one_engine_skips_both_and_counts(tiny, dist_single, tmp_path, caplog, stages, dtype):
    """bf16: DeepSpeed's own overflow check is off for the trained roles (the guard's is the one that skips)."""
    trainer = _build(tiny, tmp_path, max_steps=3, max_consecutive_skips=2, actor_zero_stage=stages[0],
                     critic_zero_stage=stages[1], dtype=dtype)
    for role in ("actor", "critic"):
        assert trainer.engine.ds_configs[role].get("bf16", {}).get("check_grad_overflow", True) is (dtype != "bf16")
    rec0 = trainer.step()
    before = _snapshot(trainer)
    assert before["actor"]["steps"] == before["critic"]["steps"] == 1 and before["actor"]["moments"]
    # iteration 1: only the CRITIC's gradients become NaN (its loss stays finite)
    trainer.hooks.nonfinite = {"what": "grad", "role": "critic", "iteration": 1}
    with caplog.at_level(logging.WARNING, logger="rlhf_engine.trainer.guards"):
        rec1 = trainer.step()
    after = _snapshot(trainer)
    for role in ("actor", "critic"):
        assert _same(after[role]["params"], before[role]["params"]), role
        assert _same(after[role]["moments"], before[role]["moments"]), role  # exp_avg, exp_avg_sq, step
        assert after[role]["lr"] == before[role]["lr"], role  # the schedule did not advance either
        assert after[role]["steps"] == before[role]["steps"] == 1, role
    assert math.isfinite(rec1["value/loss"]) and math.isfinite(rec1["policy/loss"])  # the losses were finite
    assert (rec0["system/skipped_steps"], rec1["system/skipped_steps"]) == (0, 1)
    assert rec1["system/optimizer_steps"] == 1
    assert any("non-finite critic gradient on rank 0" in r.getMessage() and "skipped the update of actor and critic"
               in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    # positive control: iteration 2 updates both again (weights, moments, schedule), the count stays
    rec2 = trainer.step()
    moved = _snapshot(trainer)
    for role in ("actor", "critic"):
        assert not _same(moved[role]["params"], after[role]["params"]), role
        assert not _same(moved[role]["moments"], after[role]["moments"]), role
        assert moved[role]["lr"] != after[role]["lr"] and moved[role]["steps"] == 2, role
    assert rec2["system/skipped_steps"] == 1 and trainer.guard.consecutive == 0
    trainer.metrics.close()


def test_k_consecutive_skips_stop_with_exit_code_3(tiny, dist_single, tmp_path):
    trainer = _build(tiny, tmp_path, max_steps=5, max_consecutive_skips=2)
    trainer.hooks.nonfinite = {"what": "grad", "role": "actor", "iteration": 1, "iterations": 0}  # from 1 on
    with pytest.raises(TooManySkippedSteps, match=r"rank 0, iteration 2: 2 updates in a row were skipped \(last: "
                                                  r"non-finite actor gradient on rank 0\).*max_consecutive_skips 2"):
        trainer.train()
    assert TooManySkippedSteps.exit_code == EXIT_SKIPPED_STEPS == 3
    assert trainer.engine.optimizer_steps("actor") == trainer.engine.optimizer_steps("critic") == 1
    assert trainer.guard.skipped_steps() == 2


def test_nonfinite_advantage_reward_errors_and_loss_stop_naming_rank_iteration_and_tensor(tiny, dist_single, tmp_path,
                                                                                           monkeypatch):
    trainer = _build(tiny, tmp_path, max_steps=3)
    trainer.step()
    steps = trainer.engine.optimizer_steps("actor")
    # an advantage (stopped before any training of the iteration)
    trainer.hooks.nonfinite = {"what": "advantage", "iteration": 1}
    with pytest.raises(NonFiniteError, match=r"^rank 0, iteration 1: non-finite advantage on rank 0 \(at 1 "
                                             r"position\(s\), first \[0, 0\] on this rank\); every rank stops$"):
        trainer.step()
    assert NonFiniteError.exit_code == EXIT_NON_FINITE == 4
    trainer.hooks.nonfinite = None
    # reward functions that raise, miss a value or return NaN: the error names the function, rank and iteration
    mod = types.ModuleType("bad_rewards")
    mod.raises = lambda prompts, responses: 1 / 0
    mod.short = lambda prompts, responses: [1.0]
    mod.nan = lambda prompts, responses: [math.nan for _ in responses]
    monkeypatch.setitem(sys.modules, "bad_rewards", mod)
    model_source = trainer.reward_source
    for name, words in (("raises", "reward function bad_rewards:raises raised ZeroDivisionError"),
                        ("short", "reward function bad_rewards:short returned 1 values for 4 samples"),
                        ("nan", "reward function bad_rewards:nan returned non-finite values for samples [0, 1, 2, 3]")):
        fn = text_reward(load_reward_fn(f"bad_rewards:{name}"), trainer.engine.tokenizer)
        trainer.reward_source = RewardFnSource(fn)
        with pytest.raises(RewardFunctionError) as e:
            trainer.step()
        assert str(e.value).startswith("rank 0, iteration 1: ") and words in str(e.value), str(e.value)
    trainer.reward_source = model_source
    assert trainer.engine.optimizer_steps("actor") == steps  # nothing trained in the failed iterations
    # a loss: the boundary check raises before either engine steps
    trainer.hooks.nonfinite = {"what": "loss", "role": "critic", "iteration": 1}
    with pytest.raises(NonFiniteError, match=r"^rank 0, iteration 1: non-finite value loss on rank 0 \(PPO epoch 0, "
                                             r"mini-batch 0\); every rank stops before the update$"):
        trainer.step()
    assert trainer.engine.optimizer_steps("actor") == trainer.engine.optimizer_steps("critic") == steps
    trainer.metrics.close()


def test_injection_spec_and_nan_gradient_term():
    inj = Injection({"what": "grad", "role": "critic", "rank": 1, "iteration": 2, "iterations": 2})
    assert [inj.active("grad", 1, it, "critic") for it in range(5)] == [False, False, True, True, False]
    assert not inj.active("grad", 0, 2, "critic") and not inj.active("grad", 1, 2, "actor")
    assert Injection({"what": "loss", "iterations": 0}).active("loss", 3, 99, "actor")
    with pytest.raises(ValueError, match="'what' must be one of"):
        Injection({"what": "weights"})
    x = torch.randn(3, requires_grad=True)
    term = Injection.nan_gradient_term(x)
    assert term.item() == 0.0
    term.backward()
    assert torch.isnan(x.grad).all()


def test_host_syncs_one_per_guard_collective_and_none_from_ppo_math_in_the_training_loop(tiny, dist_single, tmp_path,
                                                                                          monkeypatch):
    """Per iteration with FLAGS: 4 rollouts = one mini-batch of 2 micro-batches (one boundary), 1 PPO epoch."""
    from _host_syncs import HostSyncs
    from rlhf_engine import ppo_math
    from rlhf_engine.trainer import objectives
    from rlhf_engine.trainer.metric_sums import MetricSums

    # padded rows: packing syncs once per forward to place its rows (packing.py), and runs the experience forwards
    # in training micro-batches (two calls where this counts one)
    trainer = _build(tiny, tmp_path, max_steps=2, packing="off")
    trainer.step()  # warm-up: first-call paths (DeepSpeed, caches) are not what this test counts

    def iteration():
        stats = MetricSums(trainer.engine.device)
        rollouts = trainer.rollout_phase()
        with HostSyncs() as exp_syncs:
            exp = trainer.experience_phase(rollouts, stats)
        with HostSyncs() as train_syncs:
            trainer.train_phase(exp, stats)
        return exp_syncs, train_syncs

    exp_syncs, train_syncs = iteration()
    # experience: the checks stay on, one sync per call: actor and reference log-probs (one experience micro-batch
    # each), compute_rewards, compute_gae, masked_whiten = 5; the two guard agreements (scores, advantages) one each
    assert exp_syncs.at("ppo_math/") == 5, exp_syncs.sites
    assert exp_syncs.at("trainer/guards.py") == exp_syncs.sites["trainer/guards.py:agree [tolist]"] == 2, \
        exp_syncs.sites
    # training: none from ppo_math (check=False); the boundary's guard table read once; none from the trainer (the
    # ratio trace is reduced with the iteration's metrics)
    assert train_syncs.at("ppo_math/") == 0, train_syncs.sites
    assert train_syncs.at("trainer/guards.py") == train_syncs.sites["trainer/guards.py:step [tolist]"] == 1, \
        train_syncs.sites
    assert train_syncs.at("trainer/ppo_trainer.py") == train_syncs.at("trainer/objectives.py") == 0, train_syncs.sites
    assert train_syncs.at("trainer/update.py") == 0, train_syncs.sites

    # negative control: with the checks forced back on, the counter sees them in the training loop too:
    # 2 micro-batches x (actor log-probs, policy loss, value loss) = 6
    monkeypatch.setattr(trainer.actor_step.objective, "policy_loss",
                        lambda *a, check=True, **k: ppo_math.policy_loss(*a, **k))
    monkeypatch.setattr(objectives, "value_loss", lambda *a, check=True, **k: ppo_math.value_loss(*a, **k))
    forward = trainer.engine.actor_forward
    monkeypatch.setattr(trainer.engine, "actor_forward", lambda r, check=True, **k: forward(r, **k))
    _, train_syncs = iteration()
    assert train_syncs.at("ppo_math/") == train_syncs.sites["ppo_math/checks.py:_raise_first [tolist]"] == 6, \
        train_syncs.sites
    trainer.metrics.close()


# ---- the rollouts' policy: max_rollout_logprob_diff ------------------------------------------------------------------
def test_the_logprob_diff_guard_warns_once_stops_after_n_in_a_row_and_restarts_on_a_good_iteration(caplog):
    """Hand-made rollout/logprob_diff_max values against a limit of 1.0 and 3 in a row: two over, a good one (the
    count restarts), two over (no second warning), a non-finite one (counts), then one without log-probs (None:
    changes nothing) and the third in a row stops, naming the backend and the likely causes."""
    from rlhf_engine.trainer.guards import LogprobDiffGuard, RolloutPolicyMismatch

    guard = LogprobDiffGuard(1.0, "vllm", patience=3)
    with caplog.at_level(logging.WARNING, logger="rlhf_engine.trainer.guards"):
        for it, value in enumerate([2e-6, 1.5, 12.0, 1.0, 3.0, 4.0]):  # 1.0 is within the limit
            guard.observe(it, value)
        assert guard.streak == 2
        guard.observe(6, None)
        with pytest.raises(RolloutPolicyMismatch) as e:
            guard.observe(7, math.nan)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("iteration 1: rollout/logprob_diff_max 1.5 > "
                                                         "max_rollout_logprob_diff 1")
    msg = str(e.value)
    assert msg.startswith("iteration 7: rollout/logprob_diff_max nan > max_rollout_logprob_diff 1 for 3 iterations "
                          "in a row: the vllm generation backend"), msg
    assert all(cause in msg for cause in ("weight push that missed", "other kernels", "dtype"))
    fresh = LogprobDiffGuard(1.0, "lean", patience=3)
    for it in range(10):  # alternating: never 3 in a row, never stops
        fresh.observe(it, 5.0 if it % 3 else 0.0)


def test_the_limit_is_a_validated_field_off_by_default_for_rollouts_ahead_and_its_help_names_the_patience():
    from rlhf_engine.config.ppo import AHEAD_DEFAULTS, MAX_ROLLOUT_LOGPROB_DIFF, PPOConfig
    from rlhf_engine.errors import Problems
    from rlhf_engine.trainer.guards import LOGPROB_DIFF_PATIENCE

    import dataclasses

    field = {f.name: f for f in dataclasses.fields(PPOConfig)}["max_rollout_logprob_diff"]
    assert field.default == MAX_ROLLOUT_LOGPROB_DIFF and f"{LOGPROB_DIFF_PATIENCE} iterations in a row" in \
        field.metadata["help"]
    for value, ok in ((0.0, True), (MAX_ROLLOUT_LOGPROB_DIFF, True), (-1.0, False), (math.nan, False)):
        p = Problems()
        PPOConfig(max_rollout_logprob_diff=value).validate(p)
        assert (not p) is ok, (value, p)
    assert AHEAD_DEFAULTS["max_rollout_logprob_diff"] == 0.0
    # rollouts ahead of training: off unless the run sets it (their difference is the policy's own change)
    base = ["--actor_model_name_or_path", "a", "--reward_model_name_or_path", "r", "--data_path", "d",
            "--output_dir", "unused"]
    ahead = ["--rollout_servers", "http://127.0.0.1:8000", "--generation_backend", "vllm", "--max_staleness", "1"]
    assert parse_args(base).ppo.max_rollout_logprob_diff == MAX_ROLLOUT_LOGPROB_DIFF
    assert parse_args(base + ahead).ppo.max_rollout_logprob_diff == 0.0
    assert parse_args(base + ahead + ["--max_rollout_logprob_diff", "4"]).ppo.max_rollout_logprob_diff == 4.0


def test_a_backend_whose_log_probs_stay_off_stops_the_run_at_the_third_iteration(tiny, dist_single, tmp_path):
    """The lean backend's log-probs shifted by 2 nats on every token (a stand-in for an engine that holds other
    weights), limit 1: iterations 0 and 1 are written to metrics.jsonl, the run stops at iteration 2 (its record
    written too); unshifted, the run passes (the negative control: lean in fp32 is within 1e-4)."""
    import json
    import os

    from rlhf_engine.trainer.guards import RolloutPolicyMismatch

    trainer = _build(tiny, tmp_path / "off", max_steps=3, max_rollout_logprob_diff=1.0)
    sample = trainer.engine.sample

    def off(ids, mask, params=None):
        g = sample(ids, mask, params)
        g.logprobs = g.logprobs - 2.0 * g.rollout.action_mask
        return g

    trainer.engine.sample = off
    with pytest.raises(RolloutPolicyMismatch, match=r"iteration 2: rollout/logprob_diff_max 2 > "
                                                    r"max_rollout_logprob_diff 1 for 3 iterations in a row"):
        trainer.train()
    with open(os.path.join(trainer.cfg.run.output_dir, "metrics.jsonl")) as f:
        diffs = [json.loads(line)["rollout/logprob_diff_max"] for line in f]
    assert diffs == pytest.approx([2.0, 2.0, 2.0], abs=1e-4)
    good = _build(tiny, tmp_path / "good", max_steps=1, max_rollout_logprob_diff=1.0)
    assert good.train()[0]["rollout/logprob_diff_max"] < 1e-4 and good.logprob_guard.streak == 0
