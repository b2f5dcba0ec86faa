"""A reward server (--reward_url) and worker processes (--reward_workers) score a real PPO iteration in place of the
reward model (no reward engine built), with the data columns the calling rule gives; every bad combination of the
reward flags is one start-up error naming the field."""
import json

import pytest
from _trainer_args import train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.errors import ConfigError
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.experience import decode_rollout

from _reward_fns import length_and_bonus


@pytest.fixture(scope="module")
def bonus_data(tiny, tmp_path_factory):
    """The tiny prompts with a `bonus` column (the row's index)."""
    path = tmp_path_factory.mktemp("bonus") / "p.jsonl"
    raw = [json.loads(line)["prompt"] for line in open(tiny.prompts)][:8]
    path.write_text("".join(json.dumps({"prompt": p, "bonus": i}) + "\n" for i, p in enumerate(raw)))
    return str(path)


def _args(tiny, out, data, **flags):
    args = train_args(tiny, out, data_path=data, per_device_generation_batch_size=4, per_device_training_batch_size=4,
                      max_steps=1, export_final="false", **flags)
    return [a for a in args if a not in ("--reward_model_name_or_path", tiny.reward)]


def _scored(trainer):
    """(decoded responses, bonus column, scores) of the iteration's experience."""
    trainer.step()
    trainer.metrics.close()
    exp = trainer.last_experience
    _, responses = decode_rollout(trainer.engine.tokenizer, exp.rollout)
    return responses, [row.columns["bonus"] for row in exp.rollout.rows], exp.scores.tolist()


def test_a_reward_server_scores_the_iteration(tiny, bonus_data, tmp_path):
    import threading

    from rlhf_engine.rewards.serve import make_server

    server = make_server(length_and_bonus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/score"
        trainer = build_trainer(parse_args(_args(tiny, str(tmp_path / "url"), bonus_data, reward_url=url)))
        assert "reward" not in trainer.engine.engines
        responses, bonus, scores = _scored(trainer)
    finally:
        server.shutdown()
        server.server_close()
    assert scores == pytest.approx([len(r) + b for r, b in zip(responses, bonus)])


def test_worker_processes_score_the_iteration(tiny, bonus_data, tmp_path):
    trainer = build_trainer(parse_args(_args(tiny, str(tmp_path / "workers"), bonus_data,
                                             reward_fn="_reward_fns:length_and_bonus", reward_workers=2)))
    try:
        responses, bonus, scores = _scored(trainer)
    finally:
        trainer.reward_source.close()
    assert scores == pytest.approx([len(r) + b for r, b in zip(responses, bonus)])


@pytest.mark.parametrize("flags, field, message", [
    (dict(reward_fn="m:f", reward_url="http://x:1/"), "reward_url, reward_fn", "both score the rollouts"),
    (dict(environment="m:f", reward_url="http://x:1/"), "environment, reward_url",
     r"\('m:f', 'http://x:1/'\): both score the rollouts \(the environment's step rewards and a reward server\)"),
    (dict(environment="m:f", reward_fn="m:g", reward_workers=2), "environment, reward_fn, reward_workers",
     "worker processes"),
    (dict(reward_url="x:1"), "reward_url", "must be an http"),
    (dict(reward_url="http://x:1/", reward_workers=2), "reward_workers", "set reward_fn"),
    (dict(reward_fn="m:f", reward_workers=2, reward_on_error="zero"), "reward_on_error", "'stop' or a finite score"),
    (dict(reward_fn="m:f", reward_on_error="0"), "reward_on_error", "needs reward_workers >= 1"),
    (dict(reward_url="http://x:1/", reward_timeout_s=0), "reward_timeout_s", "must be > 0"),
    (dict(reward_url="http://x:1/", reward_retries=-1), "reward_retries", "whole number >= 0"),
])
def test_bad_reward_flags_are_named(flags, field, message):
    args = ["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl"]
    for k, v in flags.items():
        args += [f"--{k}", str(v)]
    with pytest.raises(ConfigError, match=rf"{field} = .*{message}"):
        parse_args(args)


def test_every_registered_source_kind_is_built_by_its_class_and_chosen_by_its_flags():
    """The registry (config/reward_source.py names the kinds, trainer/reward_sources maps them to classes by real
    imports, so the layering test sees the dependency and a typo fails at import): each kind's class exists and is a RewardSource; a config setting
    only a kind's flags chooses that kind, and the reward model is chosen when no flag is set (the config's
    scored_without_model agrees)."""
    from rlhf_engine.cli import parse_args
    from rlhf_engine.config.reward_source import REWARD_SOURCES, reward_source_kind
    from rlhf_engine.trainer.reward_sources import SOURCE_CLASSES, RewardSource, source_class

    base = ["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl"]
    flags = {"environment": ["--environment", "m:f"], "server": ["--reward_url", "http://x:1/"],
             "workers": ["--reward_fn", "m:f", "--reward_workers", "2"], "function": ["--reward_fn", "m:f"],
             "reward_model": []}
    assert set(flags) == set(REWARD_SOURCES) == set(SOURCE_CLASSES)  # the config's kinds are the trainer's classes
    for name, kind in REWARD_SOURCES.items():
        assert issubclass(source_class(kind), RewardSource), name
        cfg = parse_args(base + flags[name])
        assert reward_source_kind(cfg).name == name
        assert cfg.scored_without_model == (name != "reward_model")
