"""The trainer's per-rank checkpoint state without engines: random generators, the data cursor, the providers, the
run fingerprint, and the checkpoint config fields."""
import os
import random

import numpy as np
import pytest
import torch

from _trainer_args import train_args
from rlhf_engine.cli import parse_args
from rlhf_engine.data.sampler import DataCursor, PromptSampler
from rlhf_engine.engine.preflight import plan_engine, plan_model
from rlhf_engine.errors import ConfigError
from rlhf_engine.trainer.state import RNGState, providers_of, run_fingerprint


def _draw():
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.multinomial(
        torch.ones(50), 5).tolist())


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draw()
    state = RNGState().state_dict()
    torch.save(state, tmp_path / "s.pt")
    expected = _draw()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert _draw() != expected
    RNGState().load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert _draw() == expected


def test_data_cursor_resumes_mid_epoch_exactly():
    sampler = PromptSampler(32, 3, rank=1, world_size=2, seed=5)  # global batch 6: 5 batches per epoch
    straight = DataCursor(sampler)
    ref = sampler.iter_from(0, 0)
    first = [next(straight) for _ in range(8)]
    assert first == [next(ref) for _ in range(8)]  # the same tuples as the sampler's own iterator
    state = straight.state_dict()
    assert (state["epoch"], state["batch"], state["consumed"]) == (1, 3, 8)
    resumed = DataCursor(PromptSampler(32, 3, rank=1, world_size=2, seed=5))
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(7)] == [next(straight) for _ in range(7)]  # across the next epoch boundary
    # the end of an epoch: the position is the start of the next one
    c = DataCursor(sampler)
    for _ in range(5):
        next(c)
    assert (c.epoch, c.batch) == (1, 0)


def test_data_cursor_refuses_other_data_unless_forced():
    state = DataCursor(PromptSampler(32, 3, 0, 2, seed=5)).state_dict()
    state.update(epoch=1, batch=4)
    other = DataCursor(PromptSampler(32, 3, 0, 1, seed=5))  # one rank: global batch 3, 10 batches per epoch
    with pytest.raises(ConfigError) as e:
        other.load_state_dict(state)
    assert "global batch 6" in str(e.value)
    other.load_state_dict(state, strict=False)
    assert (other.epoch, other.batch) == (1, 8)  # the same share of the epoch


class _T:
    iteration = 3
    state_providers = {"data": object(), "kl_controller": object()}


def test_providers_order_rng_last():
    assert list(providers_of(_T())) == ["trainer", "data", "kl_controller", "rng"]
    assert providers_of(_T())["trainer"].state_dict() == {"iteration": 3}


def test_fingerprint_keys(tiny, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path), seed=3, generation_batches=2))
    fp = run_fingerprint(cfg, plan_engine(cfg).roles, world_size=2, num_prompts=32)
    # global sizes, not per-device ones: 2 ranks x 4 prompts per generation step, 2 ranks x mini-batch 4 x 1
    for key, value in {"global_generation_batch_size": 8, "global_mini_batch_size": 8, "seed": 3, "num_prompts": 32,
                       "generation_batches": 2, "actor_zero_stage": 0, "ppo_epochs": 1}.items():
        assert fp[key] == value, key
    assert not {"world_size", "per_device_training_batch_size", "per_device_generation_batch_size"} & set(fp)
    # another world size with per-device sizes that keep the global ones: the same fingerprint
    one = parse_args(train_args(tiny, str(tmp_path), seed=3, generation_batches=2, per_device_generation_batch_size=8,
                                per_device_training_batch_size=4, gradient_accumulation_steps=2))
    assert run_fingerprint(one, plan_engine(one).roles, world_size=1, num_prompts=32) == fp
    for role in ("actor", "reference", "critic", "reward"):
        assert fp[f"{role}_model_name_or_path"].startswith("/"), role  # absolute: another cwd is the same model
    assert "max_steps" not in fp  # a constant schedule: the run can be extended
    decaying = parse_args(train_args(tiny, str(tmp_path), actor_lr_scheduler_type="cosine"))
    assert run_fingerprint(decaying, plan_engine(decaying).roles, 1, 32)["max_steps"] == decaying.max_steps
    no_rm = parse_args(train_args(tiny, str(tmp_path), reward_fn="rlhf_engine.rewards.sentiment:vader_positive"))
    assert "reward_model_name_or_path" not in run_fingerprint(no_rm, plan_engine(no_rm).roles, 1, 32)


def test_supervised_fingerprint_keys(tiny, tmp_path):
    from rlhf_engine.config import SFTConfig
    from rlhf_engine.trainer.state import supervised_fingerprint

    argv = ["--model_name_or_path", os.path.relpath(tiny.actor), "--data_path", "d.jsonl", "--zero_stage", "3",
            "--gradient_accumulation_steps", "2", "--seed", "5"]
    cfg = parse_args(argv, config_cls=SFTConfig)
    fp = supervised_fingerprint(cfg, plan_model(cfg.model, 64)[0], world_size=2, num_rows=48)
    assert {k: fp[k] for k in ("global_mini_batch_size", "seed", "num_rows", "zero_stage")} == {
        "global_mini_batch_size": 2 * cfg.train.per_device_training_batch_size * 2, "seed": 5, "num_rows": 48,
        "zero_stage": 3}
    assert fp["model_name_or_path"] == os.path.realpath(tiny.actor)  # a relative path compares as absolute
    assert "max_steps" not in fp and "num_train_epochs" not in fp  # a constant schedule: the run can be extended
    decaying = parse_args(argv + ["--lr_scheduler_type", "cosine", "--num_train_epochs", "3"], config_cls=SFTConfig)
    assert supervised_fingerprint(decaying, plan_model(decaying.model, 64)[0], 2, 48)["num_train_epochs"] == 3


def test_checkpoint_config_fields(tiny, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path)))
    assert (cfg.run.save_interval, cfg.run.keep_last, cfg.run.resume_force, cfg.export_final, cfg.export_dir) == (0, 2, False,
                                                                                                   True, "")
    with pytest.raises(ConfigError) as e:
        parse_args(train_args(tiny, str(tmp_path), save_interval=-1, keep_last=-2))
    assert {p.field for p in e.value.problems} == {"save_interval", "keep_last"}
