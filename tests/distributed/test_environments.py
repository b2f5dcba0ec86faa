"""Multi-turn episodes on real DeepSpeed engines (CPU, gloo), tiny GPT-2 models: lr 0 across turns on 2 ranks at
ZeRO 0, 2 and 3 with the lean and hf backends, and one update on 1 rank vs 2 ranks.

The environment (`tests/_envs.py:varying`) plays 1 to 3 turns by the prompt's length, so the ranks play different
numbers of turns in one generation batch: under per-layer ZeRO-3 (`generation_gather_once off`) every turn's
generation is collective, and a rank whose episodes are over must keep its peer company. The runs share their
launches with test_ppo_trainer.py's (tests/_support.py, SharedHarness)."""
import os

import pytest

from _support import compare_runs, ppo_args

MAX_LOG_RATIO_LR0 = 1e-6
INVARIANCE_ATOL = 1e-5
ENV = dict(environment="_envs:varying", max_turns=3)
LR0 = dict(per_device_generation_batch_size=4, generation_batches=2, experience_micro_batch_size=3,
           per_device_training_batch_size=2, gradient_accumulation_steps=2, ppo_epochs=2, max_steps=2, seed=1,
           actor_learning_rate=0.0, critic_learning_rate=0.0, **ENV)
Z3 = dict(actor_zero_stage=3, reference_zero_stage=3, critic_zero_stage=3, generation_gather_once="off")
BY_RANK = dict(environment="_envs:rank_varying")  # rank 0 plays 1-2 turns, rank 1 plays 3
GRPO = dict(advantage_estimator="grpo", n_samples_per_prompt=2, per_device_generation_batch_size=2,
            actor_zero_stage=2)
INV = dict(do_sample="false", max_steps=2, ppo_epochs=2, seed=3, actor_learning_rate=2e-4, critic_learning_rate=2e-4,
           **ENV)


def room_flags(tiny) -> dict:
    """Greedy 2-turn episodes of `_envs:room_hungry` whose long-observation rows have 3 tokens of room for turn 2."""
    from _envs import RoomHungry
    from transformers import AutoTokenizer

    from rlhf_engine.envs.turns import TurnFormat

    long_obs = len(TurnFormat(AutoTokenizer.from_pretrained(tiny.tokenizer), False).context(
        " x" * RoomHungry.LONG_OBSERVATION, None))
    return dict(environment="_envs:room_hungry", max_turns=2, max_answer_seq_len=8, max_episode_tokens=8 + long_obs + 3,
                do_sample="false", stop_token_ids=[], max_steps=1, actor_learning_rate=0.0,
                critic_learning_rate=0.0, seed=2)


def budget_setup(tiny, tmp: str) -> tuple[dict, int]:
    """`_envs:rank_split` on prompts of one token length L and an actor with exactly L + max_episode_tokens positions:
    rank 0's episodes end at their budget while rank 1 plays a third turn. Returns (flags, rank 1's turn-3 room)."""
    import json

    from _envs import RankSplit
    from transformers import AutoTokenizer

    from rlhf_engine.assets import build_tiny_model
    from rlhf_engine.envs.turns import TurnFormat

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    fmt = TurnFormat(tok, False)
    fill, ok, turn = len(fmt.context(" x" * RankSplit.FILL, None)), len(fmt.context(" ok", None)), 4
    budget = 2 * turn + fill
    with open(tiny.prompts) as f:
        texts = [json.loads(line)["prompt"] for line in f]
    L = 8  # the prompts of at least L tokens, cut to their last L (long_prompt_policy truncate_left)
    data = os.path.join(tmp, "long_prompts.jsonl")
    with open(data, "w") as f:
        for p in texts:
            if len(tok(p, add_special_tokens=False)["input_ids"]) >= L:
                f.write(json.dumps({"prompt": p}) + "\n")
    actor = build_tiny_model(os.path.join(tmp, "short_actor"), tiny.tokenizer, max_positions=L + budget)
    flags = dict(environment="_envs:rank_split", max_turns=3, max_answer_seq_len=turn, max_episode_tokens=budget,
                 max_prompt_seq_len=L, long_prompt_policy="truncate_left", data_path=data,
                 actor_model_name_or_path=actor, do_sample="false",
                 stop_token_ids=[], max_steps=1, per_device_generation_batch_size=2, actor_learning_rate=0.0,
                 critic_learning_rate=0.0, per_device_training_batch_size=2, **Z3)
    return flags, budget - 2 * turn - 2 * ok


def two_rank_runs(tiny, tmp):
    d = lambda name: os.path.join(tmp, name)  # noqa: E731
    budget, _ = budget_setup(tiny, tmp)
    runs = [
        {"name": "room_z3", "args": ppo_args(tiny, d("room_z3"), per_device_generation_batch_size=2,
                                              per_device_training_batch_size=2, **room_flags(tiny), **Z3)},
        {"name": "budget_z3", "args": ppo_args(tiny, d("budget_z3"), **budget)},
        {"name": "lr0", "args": ppo_args(tiny, d("lr0"), **LR0)},
        {"name": "lr0_z3_lean", "args": ppo_args(tiny, d("lr0_z3_lean"), **{**LR0, **BY_RANK}, **Z3)},
        {"name": "lr0_z3_hf", "args": ppo_args(tiny, d("lr0_z3_hf"), generation_backend="hf", **{**LR0, **BY_RANK},
                                                **Z3)},
        # the default ZeRO-3 mode (a replica refreshed collectively at every generate call)
        {"name": "lr0_z3_replica", "args": ppo_args(tiny, d("lr0_z3_replica"), **{**LR0, **BY_RANK},
                                                     **{**Z3, "generation_gather_once": "auto"})},
        {"name": "lr0_grpo_z2", "args": ppo_args(tiny, d("lr0_grpo_z2"), **{**{k: v for k, v in LR0.items()
                                                                                if k != "critic_learning_rate"}, **GRPO})},
        {"name": "inv_2x2r", "args": ppo_args(tiny, d("inv_2x2r"), per_device_generation_batch_size=2,
                                               per_device_training_batch_size=2, **INV)},
    ]
    return runs


def one_rank_runs(tiny, tmp):
    runs = [{"name": "inv_4x1", "args": ppo_args(tiny, os.path.join(tmp, "inv_4x1"),
                                                  per_device_generation_batch_size=4,
                                                  per_device_training_batch_size=4, **INV)},
            {"name": "room_1r", "args": ppo_args(tiny, os.path.join(tmp, "room_1r"), per_device_generation_batch_size=4,
                                                  per_device_training_batch_size=4, **room_flags(tiny))}]
    return runs


def harness_runs(tiny, tmp):
    """This module's runs of the shared ppo_checks.py launches (tests/_support.py: SharedHarness)."""
    os.makedirs(os.path.join(tmp, "2r"))
    return {"two_rank": two_rank_runs(tiny, os.path.join(tmp, "2r")),
            "one_rank": one_rank_runs(tiny, os.path.join(tmp, "1r"))}



@pytest.mark.distributed
@pytest.mark.parametrize("name", ["lr0", "lr0_z3_lean", "lr0_z3_hf", "lr0_z3_replica", "lr0_grpo_z2"])
def test_lr0_ratio_one_and_kl_zero_across_turns(two_rank, name):
    run = two_rank[name]
    assert run["world_size"] == 2
    turns = [rank["experience"]["turns"] for rank in run["ranks"]]
    # episodes of different lengths, and the two ranks' batches differ in their longest episode at least once
    assert len({t for rank in turns for t in rank}) > 1, turns
    assert max(run["ratio_trace"]) <= MAX_LOG_RATIO_LR0, run["ratio_trace"]
    for rec in run["records"]:
        assert rec["objective/kl"] == 0.0, rec
        assert rec["env/errors"] == 0.0 and 1.0 <= rec["env/turns_mean"] <= 3.0, rec
        assert rec["env/observation_tokens_mean"] > 0, rec
    assert set(run["max_param_change"].values()) == {0.0}


@pytest.mark.distributed
def test_ranks_play_different_numbers_of_turns_in_lockstep(two_rank):
    """Under ZeRO-3 every generate call is collective (per-layer fetching, or the replica's refresh). What the
    episode runner did, call by call on each rank: both ranks made the same number of generate calls, and a rank
    whose episodes were over kept its peer company with throw-away calls (one row, one token) while the other still
    played (rank 0 plays 1-2 turns, rank 1 three)."""
    for name in ("lr0_z3_lean", "lr0_z3_hf", "lr0_z3_replica"):
        calls = [rank["generate_calls"] for rank in two_rank[name]["ranks"]]
        assert len(calls[0]) == len(calls[1]) > 0, (name, calls)
        company = [(a, b) for a, b in zip(*calls) if a[0] == 1 and a[2] == [1] and b[2] != [1]]
        assert company, (name, calls)  # rank 0 waited on rank 1 in some turn
        assert not any(b[0] == 1 and b[2] == [1] for _, b in zip(*calls)), (name, calls)  # rank 1 always played


@pytest.mark.distributed
def test_a_rows_episode_does_not_depend_on_its_batch_mates_or_the_world_size(two_rank, one_rank):
    """The same prompts, greedy: 2 ranks under per-layer ZeRO-3 (collective generation, batch-mates on the rank of
    2 rows) against 1 rank with batches of 4. Each prompt's episode is the same, and rows with little room beside
    rows with a whole turn left played their own (tests/unit/envs/test_episodes.py has alone vs beside others)."""
    two = {tuple(p): (resp, act) for rank in two_rank["room_z3"]["ranks"] for p, resp, act in
           rank["experience"]["episodes"]}
    one = {tuple(p): (resp, act) for p, resp, act in one_rank["room_1r"]["ranks"][0]["experience"]["episodes"]}
    assert two.keys() == one.keys() and len(one) == 4
    assert two == one
    second_turns = sorted(len(act) - act.index(0) - act[act.index(0):].index(1) for _, act in one.values()
                          if 0 in act)
    assert second_turns[0] == 3 and second_turns[-1] == 8, second_turns  # cut rows beside whole turns


@pytest.mark.distributed
def test_a_rank_at_its_budget_keeps_its_peer_company_from_a_bare_prompt(two_rank, tiny, tmp_path):
    """Rank 0's contexts end exactly at the actor's last position while rank 1 plays a third turn: rank 0's
    throw-away turn starts from a bare prompt (before the fix it continued a full context past the checked
    positions: an index error on rank 0 while rank 1 waited in a collective)."""
    flags, _ = budget_setup(tiny, str(tmp_path))
    run = two_rank["budget_z3"]
    turns = [rank["experience"]["turns"] for rank in run["ranks"]]
    assert set(turns[0]) == {2} and set(turns[1]) == {3}, turns
    assert run["records"][0]["env/truncated_rate"] > 0
    # the runner's calls: in turn 3 rank 1 writes its room (at least 2 tokens) while rank 0's one call is one row,
    # one token, from a prompt no wider than a bare prompt (never a context at its budget)
    calls = [rank["generate_calls"] for rank in run["ranks"]]
    assert len(calls[0]) == len(calls[1]) == 3, calls
    (rows, width, limits), theirs = calls[0][2], calls[1][2]
    assert rows == 1 and limits == [1] and width <= flags["max_prompt_seq_len"], calls
    assert min(theirs[2]) >= 2, calls


@pytest.mark.distributed
def test_one_update_is_the_same_on_one_and_two_ranks(two_rank, one_rank):
    one, two = one_rank["inv_4x1"], two_rank["inv_2x2r"]
    assert one["max_param_change"]["actor"] > 50 * INVARIANCE_ATOL  # it learned: equality is not trivial
    assert len(one["records"]) == len(two["records"]) == 2
    metric, params = compare_runs(two, one)
    assert max(metric.values()) <= INVARIANCE_ATOL, metric
    assert max(params.values()) <= INVARIANCE_ATOL, params
    assert one["records"][0]["env/turns_mean"] not in (1.0, 2.0, 3.0)
