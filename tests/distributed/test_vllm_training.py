"""PPO with `--generation_backend vllm` on 2 ranks under the deepspeed launcher, the two ranks sharing one vLLM
engine per run (`--vllm_tensor_parallel_size 2`: each rank holds half of it, every generate call gathers both ranks'
prompts and hands each its own answers; one engine per rank, tensor parallel 1, runs in test_vllm_generation.py and
as the colocated runs of test_rollout_servers.py), tiny Llama models with the head size vLLM's CPU attention takes:
lr 0 (every ratio exactly 1, the engine's log-probs those the trainer computes), several iterations at lr > 0 under
ZeRO-3 (the engine follows the policy), a rerun with the same seed, a resume, GRPO groups with a LoRA actor, a 2-turn
environment (the ranks' turns differ in rows), the evaluation, and a Qwen2 actor (biases, one key-value head
replicated on both ranks). One launch (scripts/ppo_checks.py) serves every test here (vLLM keeps one tensor-parallel
size per process); skipped, with the reason, where vLLM is not installed (bash scripts/install.sh --vllm)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from _support import VOLATILE, make_tiny_setup, ppo_args, run_harness

pytestmark = [pytest.mark.distributed, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here (bash scripts/install.sh --vllm, then "
                                        ".venv-vllm/bin/python -m pytest -m vllm)")]

FLOOR = 1e-4  # largest |engine - trainer| log-prob over any iteration (fp32 both sides: measured about 1e-6)
BASE = dict(generation_backend="vllm", per_device_generation_batch_size=4, per_device_training_batch_size=2,
            seed=1, vllm_tensor_parallel_size=2)
LR0 = dict(actor_learning_rate=0.0, critic_learning_rate=0.0, rollout_correction="none", max_steps=2, ppo_epochs=2,
           gradient_accumulation_steps=2, min_answer_seq_len=2, eval_split=0.25, eval_interval=1)
LEARN = dict(actor_zero_stage=3, reference_zero_stage=3, actor_learning_rate=2e-3, critic_learning_rate=1e-3,
             max_steps=5, ppo_epochs=2)
GRPO = dict(advantage_estimator="grpo", n_samples_per_prompt=4, per_device_generation_batch_size=2, max_steps=2,
            actor_learning_rate=1e-3, actor_lora_dim=4, actor_lora_alpha=8.0)
ENV = dict(environment="_envs:counting", max_turns=2, max_steps=2, actor_learning_rate=1e-3)


@pytest.fixture(scope="module")
def runs(tiny_vllm, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm_training"))
    qwen2 = make_tiny_setup(os.path.join(tmp, "qwen2"), arch="qwen2", pad_is_eos=False, n_head=2, dropout=0.0)

    def run(name, **flags):
        return {"name": name, "args": ppo_args(tiny_vllm, os.path.join(tmp, name), **{**BASE, **flags})}

    # "part" stops after 2 of learn_z3's 5 iterations (its end checkpoint; until then a rerun of learn_z3 with the same
    # seed); "resumed" is the requeued command
    part = os.path.join(tmp, "part")
    spec = [run("lr0", **LR0), run("learn_z3", **LEARN), run("grpo", **GRPO),
            run("env", **ENV), run("part", **{**LEARN, "max_steps": 2}),
            {"name": "qwen2", "args": ppo_args(qwen2, os.path.join(tmp, "qwen2_run"), **{**BASE, **LEARN,
                                                                                        "max_steps": 2})},
            {"name": "resumed", "args": ppo_args(tiny_vllm, part, **{**BASE, **LEARN, "resume": "auto"})}]
    # under the deepspeed launcher, as users start it: the one vllm-backend trainer in CI whose ranks start fresh
    return run_harness(tmp, "vllm_training", spec, 2, "deepspeed")


def _train(run):
    return [r for r in run["records"] if "rollout/logprob_diff_max" in r]  # not the final evaluation's record


def _diffs(run):
    return [r["rollout/logprob_diff_max"] for r in _train(run)]


def test_lr0_every_ratio_is_exactly_one_and_the_engine_samples_what_ppo_scores(runs):
    run = runs["lr0"]
    assert run["ratio_trace"] and max(run["ratio_trace"]) == 0.0  # the trainer recomputes the old log-probs itself
    assert max(_diffs(run)) < FLOOR, _diffs(run)  # with min_answer_seq_len: stop tokens masked alike on both sides
    assert run["max_param_change"]["actor"] == 0.0
    assert len(_train(run)) == 2 and all("eval/score" in r for r in run["records"])  # evaluated by the engine too
    assert all(r["time/weight_sync"] >= 0.0 for r in _train(run))


def test_the_engine_follows_the_policy_as_it_moves(runs):
    """At lr > 0 under ZeRO-3 the actor-reference KL grows well past the engine's mismatch, which stays at its
    first-iteration floor: every iteration's rollouts come from the weights of the step before."""
    run = runs["learn_z3"]
    diffs, kls = _diffs(run), [abs(r["objective/kl"]) for r in _train(run)]
    assert run["max_param_change"]["actor"] > 1e-3
    assert max(diffs) < FLOOR, diffs
    assert kls[-1] > 100 * max(diffs), (kls, diffs)
    # the default correction with vllm (no flag given): truncated importance sampling, cap 2; explicit flags win
    with open(os.path.join(run["output_dir"], "config.json")) as f:
        resolved = json.load(f)
    assert (resolved["rollout_correction"], resolved["rollout_correction_cap"]) == ("token_truncate", 2.0)
    with open(os.path.join(runs["lr0"]["output_dir"], "config.json")) as f:
        assert json.load(f)["rollout_correction"] == "none"
    assert all(r["rollout/correction_capped_frac"] is not None for r in _train(run))


def test_a_rerun_with_the_same_seed_draws_the_same_samples(runs):
    """"part" is learn_z3 again, stopped after 2 of its 5 iterations: the same samples and scores until then (and the
    resumed run below takes iterations 2-4 on from its checkpoint)."""
    a, b = runs["learn_z3"], runs["part"]
    for ra, rb in zip(a["ranks"], b["ranks"]):
        got = [it["sequences"] for it in rb["rollouts"]]
        assert len(got) == 2 and [it["sequences"] for it in ra["rollouts"]][:2] == got
    assert len(_train(b)) == 2
    for x, y in zip(_train(a), _train(b)):
        assert x["objective/kl"] == y["objective/kl"] and x["objective/score"] == y["objective/score"]


def test_a_resumed_run_continues_exactly(runs):
    """The requeued command (--resume auto) after 2 of 5 iterations: iterations 2-4 equal the straight run's, every
    metric but time, throughput and memory (the rows' seeds come from the restored random generators)."""
    straight, resumed = _train(runs["learn_z3"]), _train(runs["resumed"])
    assert [r["iteration"] for r in resumed] == [2, 3, 4]
    for a, b in zip(straight[2:], resumed):
        differ = {k: (a[k], b[k]) for k in a if not k.startswith(VOLATILE) and a[k] != b.get(k)}
        assert not differ, differ


def test_grpo_groups_on_two_ranks(runs):
    run = runs["grpo"]
    assert run["engines"] == ["actor", "reference", "reward"] and max(_diffs(run)) < FLOOR
    for rank in run["ranks"]:
        rows = rank["rollouts"][0]["sequences"]
        prompts = [tuple(row[:rank["rollouts"][0]["prompt_lengths"][0]]) for row in rows]
        assert prompts[0::4] == prompts[1::4] == prompts[2::4] == prompts[3::4]  # 4 samples of each prompt in a row
        assert len({tuple(r) for r in rows[:4]}) > 1  # sampled, not copies


def test_a_two_turn_environment(runs):
    run = runs["env"]
    assert max(_diffs(run)) < FLOOR
    for rank in run["ranks"]:
        assert set(rank["experience"]["turns"]) == {2}  # every episode: a model turn, the observation, a second turn


def test_a_qwen2_actor_through_the_shared_engine(runs):
    """Qwen2's q, k and v biases split over the two ranks and its one key-value head replicated on both: the engine
    follows the policy as the Llama's does."""
    run = runs["qwen2"]
    assert run["max_param_change"]["actor"] > 1e-3
    assert len(_train(run)) == 2 and max(_diffs(run)) < FLOOR, _diffs(run)


def test_each_rank_gets_the_answers_to_its_own_prompts(runs):
    """The group's engine answers both ranks' prompts in one call; a rank scoring another rank's answers (a slice
    taken wrong) would score them after its own prompts and differ by far more than FLOOR. The ranks' prompts
    differ, so the check can tell."""
    for name in ("lr0", "env"):
        ranks = runs[name]["ranks"]
        assert ranks[0]["rollouts"][0]["sequences"] != ranks[1]["rollouts"][0]["sequences"]
        assert max(_diffs(runs[name])) < FLOOR
