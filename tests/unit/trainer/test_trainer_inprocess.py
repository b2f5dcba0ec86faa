"""The PPO trainer on one in-process rank: seeding, non-finite scores, and bad input through launch/train_ppo.py."""
import importlib.util
import json
import os

import pytest
import torch

from _trainer_args import train_args
from rlhf_engine.cli import parse_args
from rlhf_engine.outputs.metrics import read_metrics
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.experience import NonFiniteError
from rlhf_engine.trainer.reward_sources import RewardFnSource

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VOLATILE = ("time/", "throughput/", "memory/")  # wall-clock and memory keys: the only ones allowed to differ between identical runs


def _train_ppo_main():
    spec = importlib.util.spec_from_file_location("train_ppo_entry", os.path.join(ROOT, "launch", "train_ppo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _run(tiny, out, seed, steps=2, **flags):
    """Build a trainer through the entry point's path, run `steps` iterations; return (first rollout, records)."""
    cfg = parse_args(train_args(tiny, out, seed=seed, max_steps=steps, per_device_generation_batch_size=4,
                                per_device_training_batch_size=2, actor_learning_rate=1e-3,
                                critic_learning_rate=1e-3, **flags))
    trainer = build_trainer(cfg)
    trainer.step()
    first = trainer.last_experience.rollout
    for _ in range(steps - 1):
        trainer.step()
    trainer.metrics.close()
    return first, read_metrics(out)


def test_same_seed_same_run_other_seed_other_rollout(tiny, dist_single, tmp_path):
    a_roll, a = _run(tiny, str(tmp_path / "a"), seed=11)
    b_roll, b = _run(tiny, str(tmp_path / "b"), seed=11)
    c_roll, c = _run(tiny, str(tmp_path / "c"), seed=12)
    assert len(a) == 2 and _stable(a) == _stable(b)
    assert torch.equal(a_roll.sequences, b_roll.sequences)
    # another seed: another prompt order and other samples, so the first rollout differs
    assert a_roll.sequences.shape != c_roll.sequences.shape or not torch.equal(a_roll.sequences, c_roll.sequences)
    assert _stable(a)[0] != _stable(c)[0]


def test_new_critic_head_depends_on_the_seed_only(tiny, dist_single, tmp_path):
    """critic_init_from=actor gives the critic a freshly drawn score head: it must come from --seed, not from whatever
    the process drew before (here: a previous trainer's sampling), or two runs with one seed are different runs."""
    heads = []
    for i, seed in enumerate((11, 11, 12)):
        cfg = parse_args(train_args(tiny, str(tmp_path / str(i)), seed=seed, critic_init_from="actor",
                                    critic_model_name_or_path="", max_steps=1))
        trainer = build_trainer(cfg)
        sd = trainer.engine.full_state_dict("critic")
        heads.append(next(v for k, v in sd.items() if k.endswith("score.weight")))
        trainer.step()  # draws from the RNG, as a real run does, before the next build
        trainer.metrics.close()
    assert torch.equal(heads[0], heads[1])
    assert not torch.equal(heads[0], heads[2])


def test_nan_score_stops_training_naming_rank_iteration_and_rows(tiny, dist_single, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path), max_steps=3, per_device_generation_batch_size=4,
                                per_device_training_batch_size=4))
    trainer = build_trainer(cfg)
    calls = []

    def reward_fn(prompt_ids, rollout):
        calls.append(1)
        scores = torch.zeros(rollout.batch_size)
        if len(calls) == 2:  # the second iteration goes bad
            scores[2] = float("nan")
        return scores

    trainer.reward_source = RewardFnSource(reward_fn)
    expected = r"rank 0, iteration 1: reward_fn returned non-finite scores for rows \[2\]"
    with pytest.raises(NonFiniteError, match=expected):
        trainer.train()
    assert len(read_metrics(str(tmp_path))) == 1  # the good iteration was written, the bad one was not


def test_prompt_longer_than_the_limit_exits_2_naming_the_row(tiny, dist_single, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    rows = ["short prompt here", "another short one", " ".join(["longer"] * 80), "fine too", "and this"]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    out = tmp_path / "run"
    rc = _train_ppo_main()(train_args(tiny, str(out), data_path=str(prompts), max_prompt_seq_len=16))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "max_prompt_seq_len" in err and "row 2 (" in err and "row 0 (" not in err, err
    assert not (out / "config.json").exists()  # stopped before anything was built


def test_too_few_prompts_for_a_global_batch_exits_2_before_models_load(tiny, dist_single, tmp_path, capsys):
    out = tmp_path / "run"
    # 32 prompts cannot fill one generation batch of 40 (40 rollouts divide into mini-batches of 4 x 1 = 4)
    rc = _train_ppo_main()(train_args(tiny, str(out), per_device_generation_batch_size=40,
                                      per_device_training_batch_size=4))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "per_device_generation_batch_size = 40" in err and "32 prompts" in err, err
    assert not (out / "config.json").exists() and not (out / "ds_config_actor.json").exists()
