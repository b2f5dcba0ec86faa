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


@pytest.mark.parametrize("flags, field", [
    (dict(reward_fn="rlhf_engine.rewards.sentiment:vader_positive"), "reward_fn"),
    (dict(min_answer_seq_len=2), "min_answer_seq_len"),
    (dict(normalize_reward="true"), "normalize_reward"),
    (dict(env_errors="ignore"), "env_errors"),
    (dict(max_turns=0), "max_turns"),
    (dict(environment="no_colon"), "environment"),
    (dict(generation_backend="hybrid"), "generation_backend"),
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
    """Each turn asks for at most the smallest room left: contexts never pass max_prompt + max_episode_tokens."""
    t = trainer_for(tiny, tmp_path, max_episode_tokens=11, max_answer_seq_len=8, max_steps=1, stop_token_ids=[])
    rec = t.step()
    r = t.last_experience.rollout
    # turn 1 writes 8, the observation takes 1-2, so turn 2 may write only what is left of 11
    assert int(r.response_lengths.max()) == 11 and r.response_width == 11
    assert rec["env/turns_mean"] == 2.0
