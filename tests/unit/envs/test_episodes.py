"""Episodes through the real trainer on one in-process rank: lr 0 across turns, token in token out, failing
environments, and the configuration's refusals."""
import os
import sys

import pytest
import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer"))
from _support import fixed_model  # noqa: E402
from _trainer_args import train_args  # noqa: E402
from rlhf_engine.cli import parse_args  # noqa: E402
from rlhf_engine.errors import ConfigError  # noqa: E402
from rlhf_engine.trainer import build_trainer  # noqa: E402

EPISODE = dict(environment="_envs:counting", max_turns=3, per_device_generation_batch_size=4,
               per_device_training_batch_size=2)


def trainer_for(tiny, out, **flags):
    return build_trainer(parse_args(train_args(tiny, str(out), **{**EPISODE, **flags})))


def test_lr0_ratio_one_and_kl_zero_across_turns(tiny, dist_single, tmp_path):
    t = trainer_for(tiny, tmp_path, actor_learning_rate=0.0, critic_learning_rate=0.0, ppo_epochs=2, max_steps=1,
                    experience_micro_batch_size=3)
    rec = t.step()
    r = t.last_experience.rollout
    assert rec["env/turns_mean"] == 2.0 and rec["env/turn1_reward_mean"] == 0.25
    assert rec["env/observation_tokens_mean"] > 0
    # holes: a context token between two actions in every row
    holes = (r.action_mask[:, 1:] < r.response_attention[:, 1:]).any(-1)
    assert bool(holes.all())
    assert max(t.ratio_trace) == 0.0  # every ratio exactly 1, over both epochs
    assert rec["objective/kl"] == 0.0
    exp = t.last_experience
    off = ~r.action_mask.bool()
    for name in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns", "kl"):
        assert getattr(exp, name)[off].abs().sum() == 0, name  # nothing off the actions
    # each turn's reward on its turn's last action: turn 1's 0.25 just before the first hole
    first_hole = (r.action_mask[0] == 0).nonzero()[0].item()
    assert float(r.turn_rewards[0, first_hole - 1]) == 0.25


def test_sampled_ids_are_kept_where_decode_encode_gives_others(tiny, dist_single, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    # a token whose doubled text encodes as one other token (a BPE merge): "l" + "l" -> "ll"
    t_id = next(i for i in range(3, len(tok)) if tok(tok.decode([i, i]), add_special_tokens=False)["input_ids"]
                not in ([i, i],) and tok.decode([i]).isalpha())
    logits = torch.full((len(tok),), -10.0)
    logits[t_id] = 10.0
    actor = fixed_model(tiny, str(tmp_path / "fixed"), logits, {})
    t = trainer_for(tiny, tmp_path / "run", actor_model_name_or_path=actor, do_sample="false",
                    max_answer_seq_len=2, actor_learning_rate=0.0, critic_learning_rate=0.0, max_steps=1,
                    stop_token_ids=[])
    t.step()
    r = t.last_experience.rollout
    actions = r.responses[r.action_mask.bool()]
    assert bool((actions == t_id).all()) and actions.numel() == 4 * 2 * 2  # 4 rows x 2 turns x 2 tokens
    turn = r.responses[0, :2].tolist()
    assert tok(tok.decode(turn), add_special_tokens=False)["input_ids"] != turn  # the case is real
    assert max(t.ratio_trace) == 0.0


@pytest.mark.parametrize("env", ["raising", "hanging"])
def test_a_failing_environment_stops_the_run_naming_the_row(tiny, dist_single, tmp_path, env):
    t = trainer_for(tiny, tmp_path, environment=f"_envs:{env}", env_timeout_s=0.5, max_steps=1)
    with pytest.raises(Exception, match=r"environment step 1 for row 0 \(prompt .*(the tool is broken|timed out)"):
        t.step()


def test_a_failure_outside_the_environment_calls_stops_the_run(tiny, dist_single, tmp_path):
    """Not an environment call (a bad stop_strings attribute fails in the runner's own step): the run stops whatever
    env_errors says, naming the turn (the rank keeps the turn protocol with its peers until then)."""
    t = trainer_for(tiny, tmp_path, environment="_envs:bad_stop_strings", env_errors="score_zero", max_steps=1)
    with pytest.raises(Exception, match="turn 1: TypeError"):
        t.step()


def test_score_zero_keeps_going_and_counts(tiny, dist_single, tmp_path):
    t = trainer_for(tiny, tmp_path, environment="_envs:raising", env_errors="score_zero", max_steps=1)
    rec = t.step()
    assert rec["env/errors"] == 4 and rec["env/turns_mean"] == 1.0
    assert float(t.last_experience.scores.abs().sum()) == 0.0


def test_an_episode_whose_environment_fails_on_a_room_filling_turn_counts_as_an_error_only(tiny, dist_single,
                                                                                          tmp_path):
    """Turn 1 fills the episode's room (8 tokens, no stop tokens) and its environment step raises (score_zero): each
    episode is an error, not also truncated (before, all 4 counted in both)."""
    t = trainer_for(tiny, tmp_path, environment="_envs:raising", env_errors="score_zero", max_steps=1,
                    max_answer_seq_len=8, max_episode_tokens=8, stop_token_ids=[], do_sample="false")
    rec = t.step()
    assert rec["env/errors"] == 4 and rec["env/turns_mean"] == 1.0
    assert rec["env/truncated_rate"] == 0.0
    t = trainer_for(tiny, tmp_path / "control", max_steps=1, max_answer_seq_len=8, max_episode_tokens=8,
                    stop_token_ids=[], do_sample="false")  # the same turn with a working environment: truncated
    assert t.step()["env/truncated_rate"] == 1.0


@pytest.mark.parametrize("flags, field", [
    (dict(reward_fn="rlhf_engine.rewards.sentiment:vader_positive"), "reward_fn"),
    (dict(min_answer_seq_len=2), "min_answer_seq_len"),
    (dict(normalize_reward="true"), "normalize_reward"),
    (dict(env_errors="ignore"), "env_errors"),
    (dict(max_turns=0), "max_turns"),
    (dict(environment="no_colon"), "environment"),
    (dict(generation_backend="hybrid"), "generation_backend"),
    (dict(enable_hybrid_engine="true"), "enable_hybrid_engine"),
])
def test_configuration_refusals(tiny, tmp_path, flags, field):
    with pytest.raises(ConfigError, match=field):
        parse_args(train_args(tiny, str(tmp_path), **{**EPISODE, **flags})).validate()


def test_an_unimportable_environment_is_named_before_any_weight(tiny, dist_single, tmp_path):
    with pytest.raises(ConfigError, match="environment.*cannot import"):
        trainer_for(tiny, tmp_path, environment="no_such_module:make")


def test_resume_in_the_middle_of_a_run_is_bitwise(tiny, dist_single, tmp_path):
    """3 iterations straight (a checkpoint after each) vs the same run resumed from its iteration-1 checkpoint in a
    new trainer: sampling on, lr > 0, episodes of 1 to 3 turns."""
    from rlhf_engine.outputs.metrics import read_metrics

    flags = dict(environment="_envs:varying", max_steps=3, save_interval=1, keep_last=5, seed=5, do_sample="true",
                 actor_learning_rate=1e-3, critic_learning_rate=1e-3, export_final="false")
    straight = trainer_for(tiny, tmp_path / "a", **flags)
    straight.train()
    straight.metrics.close()
    resumed = trainer_for(tiny, tmp_path / "b", resume=str(tmp_path / "a" / "checkpoints" / "iter_000001"), **flags)
    assert resumed.iteration == 1
    resumed.train()
    resumed.metrics.close()
    a, b = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
    stable = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))}  # noqa: E731
    assert [stable(r) for r in a[1:]] == [stable(r) for r in b]
    assert any(r["env/turns_mean"] not in (1.0, 2.0, 3.0) for r in a)  # episodes of different lengths in a batch
    for k, v in straight.engine.full_state_dict("actor").items():
        assert torch.equal(v, resumed.engine.full_state_dict("actor")[k]), k


def test_no_episode_outgrows_its_budget(tiny, dist_single, tmp_path):
    """Each row's turn takes at most its own room: contexts never pass max_prompt + max_episode_tokens."""
    t = trainer_for(tiny, tmp_path, max_episode_tokens=11, max_answer_seq_len=8, max_steps=1, stop_token_ids=[])
    rec = t.step()
    r = t.last_experience.rollout
    # turn 1 writes 8, the observation takes 1-2, so turn 2 may write only what is left of 11
    assert int(r.response_lengths.max()) == 11 and r.response_width == 11
    assert rec["env/turns_mean"] == 2.0


def _play(t, prompts):
    """Play `prompts` as one batch with the trainer's episode runner: per row (response ids, action flags,
    generation log-probs of the actions, turn rewards on the actions), the rollout and the batch's stats."""
    import json  # noqa: F401  (kept local: the module's other tests do not need it)

    from rlhf_engine.rollout import PromptRow, pad_prompts

    tok = t.engine.tokenizer
    ids, mask = pad_prompts([tok(p, add_special_tokens=False)["input_ids"] for p in prompts], t.engine.pad_token_id)
    rollout, logprobs, stats, failure = t.episodes.run(ids, mask, [PromptRow(p, {}) for p in prompts])
    assert failure is None
    rows = []
    for i in range(len(prompts)):
        real, act = rollout.response_attention[i].bool(), rollout.action_mask[i].bool()
        rows.append((rollout.responses[i][real].tolist(), rollout.action_mask[i][real].tolist(),
                     logprobs[i][act], rollout.turn_rewards[i][real].tolist()))
    return rows, rollout, stats


def test_a_rows_episode_is_the_same_alone_as_beside_others(tiny, dist_single, tmp_path):
    """Rows with a long first observation have 3 tokens of room for turn 2; their batch-mates a whole turn. Each row
    plays to its own room: alone or beside the others, the same episode (greedy), and the cut turns are truncated.
    (Before the fix every row's turn 2 was cut to the smallest room.)"""
    import json

    from _envs import RoomHungry
    from rlhf_engine.envs.turns import TurnFormat

    turn = 8
    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    long_obs = len(TurnFormat(tok, False).context(" x" * RoomHungry.LONG_OBSERVATION, None))
    t = trainer_for(tiny, tmp_path, environment="_envs:room_hungry", max_turns=2, max_answer_seq_len=turn,
                    max_episode_tokens=turn + long_obs + 3, do_sample="false", stop_token_ids=[], max_steps=1)
    with open(tiny.prompts) as f:
        texts = [json.loads(line)["prompt"] for line in f]
    even, odd = [p for p in texts if len(p) % 2 == 0][:2], [p for p in texts if len(p) % 2 == 1][:2]
    batch = [even[0], odd[0], even[1], odd[1]]
    together, rollout, stats = _play(t, batch)
    obs_tokens = [len(r[1]) - sum(r[1]) for r in together]
    assert obs_tokens[0] == obs_tokens[2] == long_obs and obs_tokens[1] == obs_tokens[3] < long_obs, obs_tokens
    for i, (ids, actions, lps, rewards) in enumerate(together):
        alone = _play(t, [batch[i]])[0][0]
        assert alone[0] == ids and alone[1] == actions and alone[3] == rewards, batch[i]
        assert torch.allclose(alone[2], lps, atol=1e-5, rtol=0), batch[i]
        second = len(actions) - actions.index(0) - obs_tokens[i]  # turn 2's tokens, after the observation
        # every turn 2 is scored by the environment: a whole one beside rows with 3 tokens of room, and one cut
        # at its own room (truncated)
        assert second == (turn if i % 2 else 3)
        assert sum(rewards) == pytest.approx(0.25 + 0.1 * (len(tok_text(t, ids[-second:])) % 7))
    assert stats.truncated == 2 and rollout.ended_with_eos.tolist() == [False] * 4


def tok_text(t, ids):
    return t.engine.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_a_row_cut_by_its_budget_stops_at_its_limit_even_when_pad_is_a_stop_token(tiny, dist_single, tmp_path,
                                                                                   backend):
    """A backend with per-row limits: each row's response is the first `limit` tokens of its unlimited
    greedy response (or shorter where it stopped), the filler after a limit is not an action even where pad == EOS,
    and a row at its limit did not end at a stop token."""
    import dataclasses
    import json

    from rlhf_engine.rollout import pad_prompts

    t = trainer_for(tiny, tmp_path, max_turns=2, max_answer_seq_len=8, do_sample="false", max_steps=1,
                    generation_backend=backend)
    tok = t.engine.tokenizer
    with open(tiny.prompts) as f:
        texts = [json.loads(line)["prompt"] for line in f][:4]
    ids, mask = pad_prompts([tok(p, add_special_tokens=False)["input_ids"] for p in texts], t.engine.pad_token_id)
    params = dataclasses.replace(t.engine.sampling, do_sample=False, stop_token_ids=(tok.eos_token_id,))
    assert tok.pad_token_id == tok.eos_token_id
    free = t.engine.sample(ids, mask, params)
    limits = (1, 3, 8, 2)
    cut = t.engine.sample(ids, mask, dataclasses.replace(params, row_limits=limits))
    assert sum(int(n) > k for n, k in zip(free.rollout.response_lengths, limits)) >= 2  # the limits bite
    for i, k in enumerate(limits):
        n = int(free.rollout.response_lengths[i])
        want = min(n, k)
        assert int(cut.rollout.response_lengths[i]) == want
        assert torch.equal(cut.rollout.responses[i, :want], free.rollout.responses[i, :want])
        assert torch.allclose(cut.logprobs[i, :want], free.logprobs[i, :want], atol=1e-6, rtol=0)
        assert bool(cut.rollout.ended_with_eos[i]) == (bool(free.rollout.ended_with_eos[i]) and n <= k)


def test_the_hf_backend_needs_a_turn_of_positions_past_the_budget(tiny, dist_single, tmp_path):
    """The tiny actor has 256 positions: prompt 64 + budget 192 fits lean exactly; hf keeps feeding a row at its
    budget while its batch-mates write, so it needs max_answer_seq_len - 1 = 7 more and is refused by name."""
    flags = dict(max_prompt_seq_len=64, max_answer_seq_len=8, max_episode_tokens=192, max_steps=1)
    with pytest.raises(ConfigError, match=r"max_prompt_seq_len \+ max_episode_tokens = 263.*the hf backend feeds"):
        trainer_for(tiny, tmp_path / "hf", generation_backend="hf", **flags)
    assert trainer_for(tiny, tmp_path / "lean", **flags).iteration == 0  # the control: lean fits exactly


# ---- a turn at its cap: one rule, whichever cap (docs/environments.md, "How a batch is played") ----------------------
def _record(t, prompt, stop=()):
    """Play one prompt with the `recording` environment: (its turns' action ids, what the environment was sent, the
    rollout, the stats)."""
    from _envs import Recording
    from rlhf_engine.rollout import PromptRow, pad_prompts

    Recording.SENT.clear()
    torch.manual_seed(1234)  # the same draws in every call: a sampled turn is a prefix of the freer one's
    tok = t.engine.tokenizer
    ids, mask = pad_prompts([tok(prompt, add_special_tokens=False)["input_ids"]], t.engine.pad_token_id)
    rollout, _, stats, failure = t.episodes.run(ids, mask, [PromptRow(prompt, {"stop": list(stop)})])
    assert failure is None
    real, act = rollout.response_attention[0].bool(), rollout.action_mask[0].bool()
    resp, acts = rollout.responses[0][real].tolist(), rollout.action_mask[0][real].tolist()
    turns, cur = [], []
    for tok_id, a in zip(resp, acts):
        if a:
            cur.append(tok_id)
        elif cur:
            turns, cur = turns + [cur], []
    turns += [cur] if cur else []
    return turns, Recording.SENT.get(prompt, []), rollout, stats


def _prompt(tiny):
    import json

    with open(tiny.prompts) as f:
        return json.loads(f.readline())["prompt"]


def _observation_tokens(t):
    from rlhf_engine.envs.turns import TurnFormat

    return len(TurnFormat(t.engine.tokenizer, False).context(" ok", None))


def test_a_turn_at_either_cap_goes_to_the_environment_and_only_the_episodes_room_truncates(tiny, dist_single,
                                                                                            tmp_path):
    """Greedy, no stop tokens, 8 tokens per turn. With room to spare both turns end at the per-turn cap: sent, not
    truncated. With 3 tokens of room for turn 2: its 3 tokens are sent and scored, and the episode is truncated. With
    exactly 8 tokens of room (the room equals the per-turn cap): sent, scored, truncated (the room filled). Before,
    the 3-token turn was withheld from the environment and the 8-token one not marked truncated."""
    prompt, flags = _prompt(tiny), dict(environment="_envs:recording", max_turns=2, max_answer_seq_len=8,
                                        do_sample="false", stop_token_ids=[], max_steps=1)
    t = trainer_for(tiny, tmp_path / "ample", max_episode_tokens=64, **flags)
    obs = _observation_tokens(t)
    decode = lambda ids: t.engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    turns, sent, rollout, stats = _record(t, prompt)
    assert [len(x) for x in turns] == [8, 8] and sent == [decode(x) for x in turns]
    assert stats.truncated == 0 and not bool(rollout.ended_with_eos[0])
    free = turns
    for room in (3, 8):
        t = trainer_for(tiny, tmp_path / f"room{room}", max_episode_tokens=8 + obs + room, **flags)
        turns, sent, rollout, stats = _record(t, prompt)
        assert turns == [free[0], free[1][:room]] and sent == [decode(x) for x in turns], room
        reward = 1.0 + 0.1 * (len(sent[1]) % 7)  # the environment's score of turn 2, on its last action
        assert float(rollout.turn_rewards[0].sum()) == pytest.approx(0.25 + reward), room
        assert stats.truncated == 1, room


@pytest.mark.parametrize("how", ["stop token", "stop string"])
def test_a_turn_that_ends_itself_exactly_at_its_room_is_not_truncated(tiny, dist_single, tmp_path, how):
    """Turn 2 (sampled, the same draws every time) ends on a stop token, or a stop string, at its k-th token, and the
    episode's room is exactly k tokens: the model ended its turn, so it is sent, scored and not truncated (the environment ends the episode).
    Control: the same room without the stop, the turn is cut there and the episode truncated."""
    import json

    flags = dict(environment="_envs:recording", max_turns=2, max_answer_seq_len=8, do_sample="true", max_steps=1)
    t = trainer_for(tiny, tmp_path / "free", max_episode_tokens=64, stop_token_ids=[], **flags)
    obs, tok = _observation_tokens(t), t.engine.tokenizer
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731

    def stop_at(first, second):
        """(k, stop token ids, stop strings) ending turn 2 at its k-th token and nothing before it, or None."""
        for k in range(2, 8):
            if how == "stop token" and second[k - 1] not in first + second[:k - 1]:
                return k, [second[k - 1]], ()
            s = text(second[k - 1:k]).strip()
            if how == "stop string" and s and s not in text(first) and s not in text(second[:k - 1]):
                return k, [], (s,)
        return None

    with open(tiny.prompts) as f:  # the first prompt whose free turn 2 has such a token
        prompts = [json.loads(line)["prompt"] for line in f][:16]
    found = None
    for prompt in prompts:
        (first, second), _, _, _ = _record(t, prompt)
        if (found := stop_at(first, second)) is not None:
            break
    assert found is not None, ("no prompt of the tiny set has a fresh token in turn 2", first, second)
    k, stop_ids, stop = found
    budget = 8 + obs + k
    t = trainer_for(tiny, tmp_path / "stopped", max_episode_tokens=budget, stop_token_ids=stop_ids or [], **flags)
    turns, sent, rollout, stats = _record(t, prompt, stop)
    assert turns == [first, second[:k]] and sent == [text(first), text(second[:k])]
    assert stats.truncated == 0 and bool(rollout.ended_with_eos[0]) == (how == "stop token")
    assert float(rollout.turn_rewards[0].sum()) == pytest.approx(1.25 + 0.1 * (len(sent[1]) % 7))
    t = trainer_for(tiny, tmp_path / "control", max_episode_tokens=budget, stop_token_ids=[], **flags)
    turns, sent, _, stats = _record(t, prompt)
    assert turns == [first, second[:k]] and stats.truncated == 1


def test_play_stamps_each_turns_tokens_with_the_version_that_sampled_them(tiny, dist_single, tmp_path):
    """A generation that stamps its tokens (rollout servers' `token_versions`; here turn k's tokens say 10 + k):
    every action token of the played rollout keeps its turn's stamp, context and padding hold 0, and the other four
    results are `run`'s. Without stamps the fifth result is None."""
    import dataclasses
    import json

    from rlhf_engine.rollout import pad_prompts

    t = trainer_for(tiny, tmp_path, max_turns=2, max_answer_seq_len=6, do_sample="false", max_steps=1)
    tok, runner = t.engine.tokenizer, t.episodes
    with open(tiny.prompts) as f:
        rows = t.dataset.rows(list(range(4)))
        texts = [json.loads(line)["prompt"] for line in f][:4]
    ids, mask = pad_prompts([tok(p, add_special_tokens=False)["input_ids"] for p in texts], t.engine.pad_token_id)
    turns = []

    def stamped(i, m, p):
        gen = t.engine.sample(i, m, p)
        turns.append(gen.rollout.action_mask.clone())
        return dataclasses.replace(gen, token_versions=torch.full_like(gen.logprobs, 10 + len(turns),
                                                                       dtype=torch.long))

    rollout, logprobs, stats, failure, versions = runner.play(ids, mask, rows, sample=stamped)
    assert failure is None and len(turns) == 2 and versions.shape == rollout.action_mask.shape
    actions = rollout.action_mask.bool()
    assert set(versions[actions].tolist()) == {11, 12} and not bool(versions[~actions].any())
    for i in range(4):  # turn 1's tokens first, then the observation (0), then turn 2's
        row = [v for v in versions[i].tolist() if v]
        assert row == sorted(row) and row[0] == 11 and row[-1] == 12, row
        assert row.count(11) == int(turns[0][i].sum())
    plain = runner.play(ids, mask, rows)
    assert plain[4] is None
    again = runner.run(ids, mask, rows)
    assert torch.equal(again[0].responses, rollout.responses) and torch.equal(again[1], logprobs)
    assert torch.equal(plain[0].responses, rollout.responses)
