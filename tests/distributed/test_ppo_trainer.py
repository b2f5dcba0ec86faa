"""The PPO trainer end to end on real DeepSpeed engines (CPU, gloo), tiny GPT-2 models, 1 and 2 ranks.

Two harness launches (tests/distributed/scripts/ppo_checks.py, shared with test_environments.py and
test_packed_training.py: tests/_support.py, SharedHarness) run every trainer configuration these tests need, each
built with `build_trainer` exactly as launch/train_ppo.py builds it, and write what happened to a JSON file:

* 2 forked ranks (tests/_forked.py): lr = 0; lr = 0 with a re-padded training forward, with and without position ids
  (negative control); lr > 0 (positive control); the batch-invariance runs and the per-rank-token-mean negative
  control;
* 1 rank (plain python): the batch-invariance references and the toy learning task.

Further launches run launch/train_ppo.py itself under `deepspeed --num_gpus 2`, `torchrun --nproc_per_node 2` and plain
`python`, and check a batch-arithmetic error exits with code 2 before anything is built.

The tiny actor is GPT-2 (absolute position embeddings) with dropout 0.1 in its config, the tokenizer has pad == EOS and
the prompts are 2-12 words long (different lengths, so left padding differs between batches).
"""
import json
import os

import pytest

from _support import VOLATILE, ROOT, check, compare_runs as _compare, launch, ppo_args

# A pseudo-random ~2/7 of the vocabulary ends a response (besides EOS). The tiny random model almost never samples
# EOS itself, and its greedy output repeats the last prompt token, so this is what makes response lengths uneven
# (1 to 8 tokens) in both sampled and greedy runs; each test that relies on it also checks it happened.
MAX_LOG_RATIO_LR0 = 1e-6  # fp32
INVARIANCE_ATOL = 1e-5


args_for = ppo_args


# lr = 0 runs: 2 generation batches of 4 per rank (their prompt widths differ), re-padded into one buffer of 8 by
# Experience.cat; experience micro-batch 3, training micro-batch 2 x accumulation 2 -> 2 mini-batches per epoch;
# 2 PPO epochs; sampling.
LR0 = dict(per_device_generation_batch_size=4, generation_batches=2, experience_micro_batch_size=3,
           per_device_training_batch_size=2, gradient_accumulation_steps=2, ppo_epochs=2, max_steps=2, seed=1,
           actor_learning_rate=0.0, critic_learning_rate=0.0)
# batch-invariance runs: greedy, lr > 0, 3 iterations x 2 epochs, ONE mini-batch per epoch on every setup, so the
# global mini-batch holds the same 4 samples whether 1 rank has all 4 or each of 2 ranks has 2 (the sampler gives
# rank r the slice r*B:(r+1)*B of each global batch of prompts).
# critic-free runs: 2 prompts x 2 samples x 2 generation batches = 8 rollouts per rank, 2 mini-batches, 2 epochs
CRITIC_FREE = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
CF = dict(per_device_generation_batch_size=2, n_samples_per_prompt=2, generation_batches=2,
          per_device_training_batch_size=2, gradient_accumulation_steps=2, ppo_epochs=2, max_steps=1, seed=1,
          actor_learning_rate=0.0)
SEQ_AGG = dict(loss_agg_mode="seq_mean_token_mean", kl_loss_coef=0.5)  # per-response means, and a KL loss term
INV = dict(do_sample="false", max_steps=3, ppo_epochs=2, seed=3, actor_learning_rate=2e-4, critic_learning_rate=2e-4)
# one update at lr > 0 for every estimator and policy loss: 8 global rollouts (4 prompts x 2 greedy samples made to
# differ by the `group_spread` hook), ONE mini-batch, one epoch, one iteration; 1 rank vs 2 ranks
ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
LOSSES = ("gspo", "cispo")  # with grpo (ppo_clip is every estimator's run)
ONE = dict(do_sample="false", max_steps=1, ppo_epochs=1, seed=3, actor_learning_rate=2e-4, n_samples_per_prompt=2,
           per_device_training_batch_size=2)
ONE_WORLD = {2: dict(per_device_generation_batch_size=2, gradient_accumulation_steps=2),
             1: dict(per_device_generation_batch_size=4, gradient_accumulation_steps=4)}


def one_update_runs(d, tiny, world: int) -> list:
    runs = []
    for name, flags in [*[(est, dict(advantage_estimator=est)) for est in ESTIMATORS],
                        *[(loss, dict(advantage_estimator="grpo", policy_loss=loss)) for loss in LOSSES]]:
        if flags["advantage_estimator"] == "gae":
            flags["critic_learning_rate"] = 2e-4
        runs.append({"name": f"one_{name}_{world}r", "args": args_for(tiny, d(f"one_{name}_{world}r"), **ONE,
                                                                     **ONE_WORLD[world], **flags),
                     "hooks": {"group_spread": True}})
    return runs


def two_rank_runs(tiny, tmp):
    d = lambda name: os.path.join(tmp, name)  # noqa: E731
    runs = [
        {"name": "lr0", "args": args_for(tiny, d("lr0"), **LR0)},
        # the trlx control runs on padded rows (packing drops the padding the control adds, and always passes
        # position ids)
        {"name": "lr0_left_pad", "args": args_for(tiny, d("lr0lp"), packing="off", **LR0),
         "hooks": {"left_pad_training": 5}},
        {"name": "lr0_left_pad_no_position_ids", "args": args_for(tiny, d("lr0lpnp"), packing="off", **LR0),
         "hooks": {"left_pad_training": 5, "use_position_ids": False}},
        {"name": "lr0_left_pad_no_position_ids_trimmed", "args": args_for(tiny, d("lr0lpnpt"), trim_padding="true",
                                                                           packing="off",
                                                                           **LR0),
         "hooks": {"left_pad_training": 5, "use_position_ids": False}},
        {"name": "lr_positive", "args": args_for(tiny, d("lrpos"), **{**LR0, "actor_learning_rate": 1e-3,
                                                                       "critic_learning_rate": 1e-3})},
        {"name": "inv_2x2r", "args": args_for(tiny, d("inv_2x2r"), per_device_generation_batch_size=2,
                                               per_device_training_batch_size=2, **INV)},
        {"name": "inv_1x2acc_2r", "args": args_for(tiny, d("inv_1x2acc_2r"), per_device_generation_batch_size=2,
                                                    per_device_training_batch_size=1, gradient_accumulation_steps=2,
                                                    **INV)},
        {"name": "local_token_mean_2r", "args": args_for(tiny, d("local_2r"), per_device_generation_batch_size=2,
                                                          per_device_training_batch_size=2, **INV),
         "hooks": {"loss_token_mean": "local"}},
        {"name": "eval", "args": args_for(tiny, d("eval"), eval_interval=1, eval_split=0.25, max_steps=2,
                                           per_device_generation_batch_size=4, seed=2)},
        {"name": "inv_seq_1x2acc_2r", "args": args_for(tiny, d("inv_seq_1x2acc_2r"), per_device_generation_batch_size=2,
                                                        per_device_training_batch_size=1, gradient_accumulation_steps=2,
                                                        **INV, **SEQ_AGG)},
        *[{"name": f"cf_{est}", "args": args_for(tiny, d(f"cf_{est}"), advantage_estimator=est, **CF)}
          for est in CRITIC_FREE],
        {"name": "cf_grpo_lr", "args": args_for(tiny, d("cf_grpo_lr"), advantage_estimator="grpo",
                                                 **{**CF, "actor_learning_rate": 1e-3})},
        *[{"name": f"lr0_{loss}", "args": args_for(tiny, d(f"lr0_{loss}"), policy_loss=loss, **LR0)} for loss in LOSSES],
        *one_update_runs(d, tiny, 2),
    ]
    return runs


# Toy task: the score is the share of response tokens with ids in [3, 131) (a quarter of the vocabulary, about 0.25
# for the untrained tiny model), given by the trainer's `reward_fn` hook instead of the reward model.
LEARN = dict(per_device_generation_batch_size=8, per_device_training_batch_size=8, ppo_epochs=4, max_steps=30,
             kl_coef=0.0, actor_learning_rate=3e-3, critic_learning_rate=1e-3, stop_token_ids=[])
LEARN_REWARD = {"reward_fn": "fraction:3:131"}
LEARN_LR0_STEPS = 10  # the control: an actor that does not change scores alike in its first 5 and last 5 iterations
LEARN_MARGIN = 0.2  # mean score of the last 5 iterations minus the first 5 (learners sample from the full softmax)


def one_rank_runs(tiny, tmp):
    d = lambda name: os.path.join(tmp, name)  # noqa: E731
    runs = [
        {"name": "inv_4x1", "args": args_for(tiny, d("inv_4x1"), per_device_generation_batch_size=4,
                                              per_device_training_batch_size=4, **INV)},
        {"name": "inv_1x4acc", "args": args_for(tiny, d("inv_1x4acc"), per_device_generation_batch_size=4,
                                                 per_device_training_batch_size=1, gradient_accumulation_steps=4,
                                                 **INV)},
    ]
    runs.append({"name": "inv_seq_4x1", "args": args_for(tiny, d("inv_seq_4x1"), per_device_generation_batch_size=4,
                                                          per_device_training_batch_size=4, **INV, **SEQ_AGG)})
    for seed in (1, 2):
        runs.append({"name": f"learn_seed{seed}", "args": args_for(tiny, d(f"learn{seed}"), seed=seed, **LEARN),
                     "hooks": LEARN_REWARD})
    runs.append({"name": "learn_lr0", "args": args_for(tiny, d("learn_lr0"), seed=1,
                                                       **{**LEARN, "actor_learning_rate": 0.0,
                                                          "max_steps": LEARN_LR0_STEPS}),
                 "hooks": LEARN_REWARD})
    runs += one_update_runs(d, tiny, 1)
    return runs


def harness_runs(tiny, tmp):
    """This module's runs of the shared ppo_checks.py launches (tests/_support.py: SharedHarness)."""
    return {"two_rank": two_rank_runs(tiny, os.path.join(tmp, "2r")),
            "one_rank": one_rank_runs(tiny, os.path.join(tmp, "1r"))}



def _ratio_trace_by_iteration(run, per_iteration):
    t = run["ratio_trace"]
    assert len(t) == len(run["records"]) * per_iteration, (len(t), per_iteration)
    return [t[i: i + per_iteration] for i in range(0, len(t), per_iteration)]


# ---- lr = 0: every ratio is 1 -------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_lr0_every_ratio_is_one_and_nothing_moves(two_rank):
    run = two_rank["lr0"]
    assert run["world_size"] == 2
    # the setup exercises what breaks ratios: uneven response lengths, and two generation batches of different prompt
    # widths per rank (re-padded into one buffer); experience micro-batch 3 != training micro-batch 2 != generation
    # batch 4
    lengths = [n for rank in run["ranks"] for it in rank["rollouts"] for batch in it["response_lengths"] for n in batch]
    assert min(lengths) < max(lengths) == 8, lengths
    assert any(len(set(it["prompt_lengths"])) > 1 for rank in run["ranks"] for it in rank["rollouts"])
    # 2 iterations x 2 epochs x 2 mini-batches; the trace is the max over both ranks of every micro-batch
    assert len(run["ratio_trace"]) == 8
    assert max(run["ratio_trace"]) <= MAX_LOG_RATIO_LR0, run["ratio_trace"]  # (it is exactly 0 on CPU)
    for rec in run["records"]:
        assert rec["policy/approx_kl"] <= 1e-12 and rec["policy/clipfrac"] == 0.0, rec
        assert rec["policy/ratio_max"] - 1 <= 2e-6 and 1 - rec["policy/ratio_min"] <= 2e-6, rec
        assert rec["objective/kl"] == 0.0, rec  # the reference is the actor, and the actor never moves
    # lr 0: every parameter is bit-identical while the optimizers did step (2 per epoch x 2 epochs x 2 iterations)
    assert run["max_param_change"] == {"actor": 0.0, "critic": 0.0}
    assert run["optimizer_steps"] == {"actor": [0, 8], "critic": [0, 8]}
    assert run["records"][-1]["system/optimizer_steps"] == 8


@pytest.mark.distributed
def test_lr0_negative_control_without_position_ids(two_rank):
    """Design of the negative control. The trainer computes the old log-probs on exactly the tensors it trains on (the
    generation batches are concatenated, i.e. re-padded to one width, BEFORE the experience forwards; micro-batch
    splits keep that width). So withholding position ids alone (the hook `TestHooks(use_position_ids=False)`) shifts
    the experience forward and the training forward identically and the ratio stays 1: the hook by itself cannot
    show anything. The control therefore also gives the training forward another LEFT PADDING than the experience
    forward, which is what happens in trlx when its chunk size differs from the rollout count (the seed bug): the
    harness hook `left_pad_training: 5` puts 5 more pad columns in front of every actor training micro-batch (real
    tokens, masks and mask-derived position ids unchanged).

    * with position ids (the default): the same tokens at the same positions; only fp32 kernel noise of the longer
      rows remains, at most a few ulps of |log p| ~ 6 (1 ulp = 4.8e-7), so max |log-ratio| <= 2e-6;
    * without them (`TestHooks(use_position_ids=False)`): GPT-2 numbers positions 0..L-1 including the padding, every token
      moves 5 positions, and max |log-ratio| > 1e-3 although no weight moved (lr = 0).
    The run without the extra padding (test above) is exactly 0. With --trim_padding (off in both runs) the extra
    columns are removed again (every row pads them), and then even the run without position ids is exactly 0 (the
    third run)."""
    good, bad = two_rank["lr0_left_pad"], two_rank["lr0_left_pad_no_position_ids"]
    assert max(two_rank["lr0_left_pad_no_position_ids_trimmed"]["ratio_trace"]) == 0.0
    assert max(good["ratio_trace"]) <= 2e-6, good["ratio_trace"]
    assert max(bad["ratio_trace"]) > 1e-3, bad["ratio_trace"]
    assert min(bad["ratio_trace"]) > 1e-3  # every mini-batch is hit, not a stray row
    for run in (good, bad):
        assert run["max_param_change"] == {"actor": 0.0, "critic": 0.0}  # still lr 0: only the positions differ
    assert max(rec["policy/approx_kl"] for rec in bad["records"]) > 1e-6
    assert max(rec["policy/approx_kl"] for rec in good["records"]) <= 1e-12


@pytest.mark.distributed
def test_lr_positive_control_ratios_move_in_the_second_epoch(two_rank):
    run = two_rank["lr_positive"]
    for it, (e1m1, e1m2, e2m1, e2m2) in enumerate(_ratio_trace_by_iteration(run, 4)):
        # the first mini-batch of each iteration comes before any update on this experience: ratio 1
        assert e1m1 <= MAX_LOG_RATIO_LR0, (it, run["ratio_trace"])
        assert e2m1 > 1e-3 and e2m2 > 1e-3, (it, run["ratio_trace"])
    assert run["max_param_change"]["actor"] > 1e-3 and run["max_param_change"]["critic"] > 1e-3
    # reference initialised from the actor: the KL is exactly 0 before the first update, not after
    kls = [rec["objective/kl"] for rec in run["records"]]
    assert kls[0] == 0.0 and kls[1] != 0.0, kls


@pytest.mark.distributed
def test_reference_from_actor_kl_exactly_zero_at_first_iteration(two_rank, one_rank):
    """Every run with a reference; the toy learning runs (LEARN: kl_coef 0, gae's kl_loss_coef 0) build none and log
    no objective/kl (tests/unit/trainer/test_reference_need.py)."""
    runs = {**two_rank, **one_rank}
    without = sorted(name for name, run in runs.items() if "objective/kl" not in run["records"][0])
    assert without == sorted(name for name in runs if name.startswith("learn"))
    for name, run in runs.items():
        if name not in without:
            assert run["records"][0]["objective/kl"] == 0.0, name


@pytest.mark.distributed
@pytest.mark.parametrize("loss", LOSSES)
def test_lr0_every_ratio_is_one_for_each_policy_loss(two_rank, loss):
    run = two_rank[f"lr0_{loss}"]
    assert len(run["ratio_trace"]) == 8 and max(run["ratio_trace"]) <= MAX_LOG_RATIO_LR0, run["ratio_trace"]
    for rec in run["records"]:
        assert rec["policy/ratio_max"] - 1 <= 2e-6 and 1 - rec["policy/ratio_min"] <= 2e-6, rec
        assert rec["policy/clipfrac"] == 0.0 and rec["objective/kl"] == 0.0
    assert run["max_param_change"] == {"actor": 0.0, "critic": 0.0}


@pytest.mark.distributed
@pytest.mark.parametrize("name", [*ESTIMATORS, *LOSSES])
def test_one_update_at_lr_positive_is_the_same_on_one_and_two_ranks(two_rank, one_rank, name):
    """Every estimator (ppo_clip) and policy loss (grpo): the same 8 rollouts (checked), one mini-batch, one
    update. The update moved the actor (an estimator or loss computed per rank, or normalised by a local count,
    would move it differently on 2 ranks), and both world sizes agree within 1e-5."""
    one, two = one_rank[f"one_{name}_1r"], two_rank[f"one_{name}_2r"]
    rows_one = _real_rows(one["ranks"][0]["rollouts"][0])
    rows_two = _real_rows(two["ranks"][0]["rollouts"][0]) + _real_rows(two["ranks"][1]["rollouts"][0])
    assert rows_one == rows_two and len(set(map(tuple, rows_one))) > len(rows_one) // 2  # groups differ inside
    assert one["optimizer_steps"]["actor"] == two["optimizer_steps"]["actor"] == [0, 1]
    assert one["max_param_change"]["actor"] > 1e-4, one["max_param_change"]
    metric, params = _compare(two, one)
    assert max(params.values()) <= INVARIANCE_ATOL, params
    for k in ("policy/loss", "policy/approx_kl", "objective/score"):
        assert metric[k] <= INVARIANCE_ATOL, (k, metric[k])


# ---- 1 rank vs 2 ranks, micro-batch x accumulation ----------------------------------------------------------------
def _real_rows(rollout_record):
    return [[t for t, m in zip(seq, mask) if m] for seq, mask in
            zip(rollout_record["sequences"], rollout_record["attention_mask"])]


@pytest.mark.distributed
def test_same_global_prompts_on_one_and_two_ranks(two_rank, one_rank):
    one, two = one_rank["inv_4x1"], two_rank["inv_2x2r"]
    for it in range(3):
        rows_one = _real_rows(one["ranks"][0]["rollouts"][it])
        rows_two = _real_rows(two["ranks"][0]["rollouts"][it]) + _real_rows(two["ranks"][1]["rollouts"][it])
        assert rows_one == rows_two, f"iteration {it}: the global batch differs between 1 and 2 ranks"


@pytest.mark.distributed
def test_one_vs_two_ranks_and_micro_batch_vs_accumulation_are_identical(two_rank, one_rank):
    ref = one_rank["inv_4x1"]  # 1 rank, micro-batch 4 x accumulation 1
    lengths = [n for it in ref["ranks"][0]["rollouts"] for n in it["response_lengths"][0]]
    assert min(lengths) < max(lengths), f"response lengths must be uneven: {lengths}"
    assert ref["max_param_change"]["actor"] > 50 * INVARIANCE_ATOL  # it did learn: equality is not trivial
    assert ref["optimizer_steps"]["actor"] == [0, 6]
    others = {"1 rank, micro-batch 1 x accumulation 4": one_rank["inv_1x4acc"],
              "2 ranks, micro-batch 2 x accumulation 1": two_rank["inv_2x2r"],
              "2 ranks, micro-batch 1 x accumulation 2": two_rank["inv_1x2acc_2r"]}
    for what, run in others.items():
        assert len(run["records"]) == 3 and run["optimizer_steps"]["actor"] == [0, 6], what
        metric, params = _compare(run, ref)
        assert max(metric.values()) <= INVARIANCE_ATOL, (what, metric)
        assert max(params.values()) <= INVARIANCE_ATOL, (what, params)


@pytest.mark.distributed
def test_negative_control_per_rank_token_mean_differs(two_rank, one_rank):
    """The hook `TestHooks(loss_token_mean="local")` divides each rank's loss by its OWN token count (times the world
    size): the naive mean of per-rank means. It equals the global token mean only when both ranks hold as many tokens,
    so with uneven response lengths it must differ from the 1-rank run that the correct 2-rank run matches."""
    run, ref = two_rank["local_token_mean_2r"], one_rank["inv_4x1"]
    tokens = [rank["minibatch_tokens"] for rank in run["ranks"]]
    assert tokens[0] != tokens[1], f"the control needs uneven tokens per rank: {tokens}"
    metric, params = _compare(run, ref)
    assert metric["policy/loss"] > 1e-3, metric
    assert params["actor"] > 10 * INVARIANCE_ATOL, params


# ---- a toy task learns --------------------------------------------------------------------------------------------
def test_toy_reward_is_learned_for_two_seeds_and_not_at_lr0(one_rank):
    def gain(run, n=30):
        s = [rec["objective/score"] for rec in run["records"]]
        assert len(s) == n
        return sum(s[-5:]) / 5 - sum(s[:5]) / 5

    for seed in (1, 2):
        g = gain(one_rank[f"learn_seed{seed}"])
        assert g > LEARN_MARGIN, f"seed {seed}: mean score gained only {g:.3f} (need > {LEARN_MARGIN})"
    g0 = gain(one_rank["learn_lr0"], LEARN_LR0_STEPS)
    assert g0 < LEARN_MARGIN, f"actor lr 0 gained {g0:.3f}: the score moves without learning"
    assert one_rank["learn_lr0"]["max_param_change"]["actor"] == 0.0


# ---- launch/train_ppo.py under each launcher ----------------------------------------------------------------------
TRAIN_PPO = os.path.join(ROOT, "launch", "train_ppo.py")


def _metrics(path):
    from rlhf_engine.outputs.metrics import read_metrics

    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in read_metrics(path)]


@pytest.mark.slow  # a release check of the two launchers (50 s on 2 cores); each runs in other default tests
@pytest.mark.distributed
def test_train_ppo_under_deepspeed_and_torchrun_same_seed_same_metrics(tiny, tmp_path):
    flags = dict(max_steps=2, per_device_generation_batch_size=2, per_device_training_batch_size=2, seed=5,
                 actor_learning_rate=1e-3, critic_learning_rate=1e-3)
    runs = {}
    for launcher in ("deepspeed", "torchrun"):
        out = str(tmp_path / launcher)
        check(launch(TRAIN_PPO, args_for(tiny, out, **flags), 2, launcher))
        runs[launcher] = _metrics(out)
    assert len(runs["deepspeed"]) == 2
    assert runs["deepspeed"] == runs["torchrun"]  # same seed: the same run, whatever the launcher
    assert runs["deepspeed"][-1]["system/optimizer_steps"] == 2


def test_train_ppo_under_plain_python(tiny, tmp_path):
    out = str(tmp_path / "python")
    check(launch(TRAIN_PPO, args_for(tiny, out, max_steps=2), 1, "python"))
    recs = _metrics(out)
    assert [r["iteration"] for r in recs] == [0, 1]
    assert os.path.isfile(os.path.join(out, "config.json"))


def test_batch_arithmetic_error_exits_2_before_anything_is_built(tiny, tmp_path):
    out = tmp_path / "never"
    proc = launch(TRAIN_PPO, args_for(tiny, str(out), per_device_generation_batch_size=3, generation_batches=2,
                                      per_device_training_batch_size=4, gradient_accumulation_steps=1), 1, "python")
    assert proc.returncode == 2, proc.stderr[-3000:]
    for text in ("per_device_generation_batch_size (3)", "generation_batches (2)", "per_device_training_batch_size (4)",
                 "gradient_accumulation_steps (1)"):
        assert text in proc.stderr, (text, proc.stderr[-3000:])
    assert not out.exists()  # nothing was written: the error came before the output dir, tokenizer or models
    assert "Loading weights" not in proc.stdout + proc.stderr


# ---- evaluation in the loop ---------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_evaluation_in_a_two_rank_run(two_rank):
    """eval_interval 1 over 2 iterations: greedy evaluation before iteration 0, at iteration 1 and after the last, on
    the 8 held-out prompts shared by both ranks; eval/* metrics and eval_samples.jsonl; and the live check of the
    rollouts' generation-time log-probs on 2 ranks."""
    run = two_rank["eval"]
    evals = [r for r in run["records"] if "eval/score" in r]
    assert [r["iteration"] for r in evals] == [0, 1, 2], run["records"]
    for r in evals:
        assert 1 <= r["eval/response_length"] <= 8 and 0.0 <= r["eval/eos_rate"] <= 1.0, r
        assert "eval/kl" not in r
    with open(os.path.join(run["output_dir"], "eval_samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert sorted({r["iteration"] for r in rows}) == [0, 1, 2] and all(r["response"] is not None for r in rows)
    # 8 held-out prompts (a quarter of 32), 4 per rank; rank 0 writes its own samples of each evaluation
    assert [sum(r["iteration"] == it for r in rows) for it in (0, 1, 2)] == [4, 4, 4]
    for rec in run["records"][:2]:  # sampled training rollouts on both ranks: the HF backend samples what PPO scores
        assert rec["rollout/logprob_diff_max"] <= 1e-5 and rec["rollout/seq_logratio_max"] <= 1e-5, rec


# ---- critic-free estimators -----------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("est", CRITIC_FREE)
def test_critic_free_estimators_at_lr0_every_ratio_is_one_and_no_critic(two_rank, est):
    run = two_rank[f"cf_{est}"]
    assert run["world_size"] == 2 and run["engines"] == ["actor", "reference", "reward"]  # no critic built
    assert len(run["ratio_trace"]) == 4 and max(run["ratio_trace"]) == 0.0, run["ratio_trace"]  # 2 epochs x 2
    rec = run["records"][0]
    assert rec["policy/ratio_max"] == rec["policy/ratio_min"] == 1.0 and rec["policy/clipfrac"] == 0.0, rec
    assert not [k for k in rec if k.startswith("value/")] and run["max_param_change"] == {"actor": 0.0}
    assert run["optimizer_steps"] == {"actor": [0, 4]}
    for rank in run["ranks"]:  # each prompt sampled twice in a row on the same rank
        seqs, p = rank["rollouts"][0]["sequences"], rank["rollouts"][0]["prompt_lengths"][0]
        assert len(seqs) == 4 and seqs[0][:p] == seqs[1][:p] and seqs[2][:p] == seqs[3][:p]


@pytest.mark.distributed
def test_critic_free_with_a_learning_rate_the_policy_moves(two_rank):
    run = two_rank["cf_grpo_lr"]
    assert run["max_param_change"]["actor"] > 0 and max(run["ratio_trace"]) > 1e-4, run["ratio_trace"]


@pytest.mark.distributed
def test_sequence_mean_aggregation_and_kl_loss_agree_on_one_and_two_ranks(two_rank, one_rank):
    """loss_agg_mode seq_mean_token_mean with a KL loss: its normalisation is over the whole mini-batch of every rank,
    so 2 ranks x (micro-batch 1 x accumulation 2) equal 1 rank x micro-batch 4."""
    ref, run = one_rank["inv_seq_4x1"], two_rank["inv_seq_1x2acc_2r"]
    assert ref["max_param_change"]["actor"] > 50 * INVARIANCE_ATOL and "policy/kl_loss" in ref["records"][-1]
    assert ref["records"][-1]["policy/kl_loss"] > 0  # the actor left the reference: the KL term is live
    metric, params = _compare(run, ref)
    assert max(metric.values()) <= INVARIANCE_ATOL, metric
    assert max(params.values()) <= INVARIANCE_ATOL, params
