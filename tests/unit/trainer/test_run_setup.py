"""The PPO recipe's set-up: reward functions instead of a reward model, run-directory policy, run files."""
import json
import os

import pytest
from _trainer_args import train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.trainer import build_trainer

import launch.train_ppo as train_ppo


def _lengths(prompts, responses):
    return [float(len(r)) for r in responses]


def test_reward_fn_replaces_the_reward_model(tiny, tmp_path, dist_single, monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    args = train_args(tiny, str(tmp_path / "run"), max_steps=1, reward_fn="test_run_setup:_lengths")
    args = [a for a in args if a not in ("--reward_model_name_or_path", tiny.reward)]
    trainer = build_trainer(parse_args(args), args)
    assert set(trainer.engine.engines) == {"actor", "critic", "reference"}  # no reward engine built
    assert trainer.engine.plans["critic"].path == tiny.actor  # the critic starts from the actor
    rec = trainer.step()
    trainer.metrics.close()
    exp = trainer.last_experience
    # the score is the character length of each decoded response: recompute it from the ids by hand
    tok = trainer.engine.tokenizer
    want = [float(len(tok.decode(r[: int(n)].tolist(), skip_special_tokens=True)))
            for r, n in zip(exp.rollout.responses, exp.rollout.response_lengths)]
    assert exp.scores.tolist() == pytest.approx(want, abs=0)
    assert rec["objective/score"] == pytest.approx(sum(want) / len(want), rel=1e-6)
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    assert len(samples) == 4 and {"prompt", "response", "score"} <= set(samples[0])


def test_bad_reward_fn_is_a_config_error_before_any_engine(tiny, tmp_path, capsys, dist_single):
    rc = train_ppo.main(train_args(tiny, str(tmp_path / "run"), reward_fn="no_such_module_xyz:f"))
    err = capsys.readouterr().err
    assert rc == 2 and "reward_fn" in err and "cannot import 'no_such_module_xyz'" in err
    assert not (tmp_path / "run").exists()


def test_output_dir_holding_a_run_is_refused_and_nothing_overwritten(tiny, tmp_path, capsys, dist_single):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n')
    rc = train_ppo.main(train_args(tiny, str(out), max_steps=1))
    assert rc == 2 and "output_dir" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"iteration": 0}\n'
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]
    # --overwrite_output_dir moves the old run aside instead of deleting it
    rc = train_ppo.main(train_args(tiny, str(out), max_steps=1, overwrite_output_dir="true"))
    assert rc == 0
    backups = [f for f in os.listdir(out) if f.startswith("metrics.jsonl.") and f.endswith(".bak")]
    assert len(backups) == 1 and (out / backups[0]).read_text() == '{"iteration": 0}\n'
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_steps"] == 1 and cfg["output_dir"] == str(out)


def test_overwrite_moves_every_file_of_the_previous_run_aside(tiny, tmp_path, dist_single):
    """A real run that writes every kind of run file (evaluation, checkpoints, export), then a new run over it with
    --overwrite_output_dir: each file of the first run is kept as *.bak, none is appended to or left in place (the
    run directory's one list of run files; before it, eval_samples.jsonl stayed and the new run appended to it)."""
    out = tmp_path / "run"
    flags = dict(max_steps=1, eval_interval=1, eval_split=0.25, save_interval=1, tensorboard="true", plot="true")
    assert train_ppo.main(train_args(tiny, str(out), **flags)) == 0
    first = set(os.listdir(out))
    assert {"eval_samples.jsonl", "metrics.jsonl", "samples.jsonl", "checkpoints", "final", "tensorboard",
            "ds_config_actor.json", "config.json", "command.txt", "metrics.png"} <= first, first
    old_eval = (out / "eval_samples.jsonl").read_text()
    assert train_ppo.main(train_args(tiny, str(out), overwrite_output_dir="true", **flags)) == 0
    for name in first - {"wandb"}:  # wandb/: every wandb run has its own folder
        assert [f for f in os.listdir(out) if f.startswith(name + ".") and f.endswith(".bak")], name
    backup = next(f for f in os.listdir(out) if f.startswith("eval_samples.jsonl.") and f.endswith(".bak"))
    assert (out / backup).read_text() == old_eval
    # the new run's records only: evaluation before iteration 0 and after the last, as in the first run
    assert (out / "eval_samples.jsonl").read_text().count("\n") == old_eval.count("\n")
