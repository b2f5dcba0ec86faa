"""RunLogger and the run directory: metrics.jsonl, wandb offline inside the run dir with no secret on disk,
samples, metrics.png, TensorBoard (optional), output-dir refusal/overwrite, redaction."""
import json
import os
import sys

import pytest

from rlhf_engine.errors import ConfigError
from rlhf_engine.outputs import (RunLogger, prepare_output_dir, read_metrics, redact, redact_argv, wandb_mode,
                                 write_run_files)
from rlhf_engine.outputs.redact import is_secret_name

FAKE_KEY = "wbkey-0123456789abcdef0123456789abcdef01"
OTHER_SECRET = "hf_s3cr3t-token-value-XYZ"


def _records(n=4):
    return [{"iteration": i, "objective/score": 0.1 * i, "objective/kl": 0.01 * i, "rollout/response_length": 10 + i,
             "policy/loss": 1.0 / (i + 1), "value/loss": 2.0 / (i + 1), "skip": None} for i in range(n)]


def _files_containing(root, needle: bytes):
    hits = []
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                if needle in fh.read():
                    hits.append(os.path.join(d, f))
    return hits


@pytest.fixture
def secrets(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, key or not
    monkeypatch.setenv("HF_TOKEN", OTHER_SECRET)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)


def test_metrics_wandb_offline_samples_plot_and_no_secret_on_disk(tmp_path, secrets, monkeypatch):
    out = tmp_path / "run"
    config = {"actor_model_name_or_path": "m", "note": f"key={FAKE_KEY}", "nested": {"api_key": "plain-value-1",
              "pad_token": "<pad>", "x": [OTHER_SECRET]}, "stop_token_ids": [1, 2]}
    argv = ["launch/train_ppo.py", "--actor_model_name_or_path", "m", "--wandb_project", "proj", "--hf_token",
            OTHER_SECRET, f"--note={FAKE_KEY}"]
    monkeypatch.setattr(sys, "argv", argv)  # wandb records sys.argv in its metadata
    write_run_files(str(out), config, argv)
    logger = RunLogger(str(out), True, config, wandb_project="proj", wandb_run_name="t", wandb_sample_interval=2,
                       tensorboard=True)  # its event files are searched for the secrets too
    recs = _records(4)
    for r in recs:
        logger.log(r)
        logger.log_samples(r["iteration"], [f"prompt {r['iteration']}", "p2"], ["resp", f"leak {FAKE_KEY}"],
                           [0.5, -1.0])
    png = logger.close()
    assert logger.close() == png  # idempotent

    assert read_metrics(str(out)) == [{k: v for k, v in r.items() if v is not None} for r in recs]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].is_dir()
    tables = list(runs[0].glob("files/media/table/samples_*.table.json"))
    assert len(tables) == 2  # iterations 0 and 2 (interval 2)
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and samples[0] == {"iteration": 0, "prompt": "prompt 0", "response": "resp", "score": 0.5}
    assert samples[1]["response"] == "leak ***"
    data = (out / "metrics.png").read_bytes()
    assert png == str(out / "metrics.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024

    saved = json.loads((out / "config.json").read_text())
    assert saved["note"] == "key=***" and saved["nested"] == {"api_key": "***", "pad_token": "<pad>", "x": ["***"]}
    assert saved["stop_token_ids"] == [1, 2]
    assert (out / "command.txt").read_text().split() == argv[:5] + ["--hf_token", "'***'", "'--note=***'"]
    for secret in (FAKE_KEY, OTHER_SECRET, "plain-value-1"):
        assert _files_containing(out, secret.encode()) == [], secret


@pytest.mark.parametrize("flag, drawn", [([], True), (["--plot", "false"], False)])
def test_the_plot_follows_the_flag(tmp_path, flag, drawn):
    """--plot false (config.logging.plot, as the run's logger is built from it) leaves metrics.png out and nothing
    else; the default draws it."""
    from rlhf_engine.cli import parse_args

    out = tmp_path / "run"
    cfg = parse_args(["--actor_model_name_or_path", "m", "--reward_model_name_or_path", "r", "--output_dir", str(out),
                      *flag])
    logger = RunLogger.from_config(cfg, True, {})
    for r in _records(3):
        logger.log(r)
    png = logger.close()
    assert (png == str(out / "metrics.png")) is drawn and (out / "metrics.png").exists() is drawn
    assert len(read_metrics(str(out))) == 3


def test_non_main_rank_writes_nothing(tmp_path, secrets):
    out = tmp_path / "run"
    logger = RunLogger(str(out), False, {"a": 1}, wandb_project="proj", tensorboard=True, total_iterations=3)
    logger.log(_records(1)[0])
    logger.log_samples(0, ["p"], ["r"], [1.0])
    assert logger.close() is None and not out.exists()


def test_tensorboard_optional(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importing it raises ImportError
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with caplog.at_level("WARNING"):
        logger = RunLogger(str(tmp_path / "a"), True, {}, tensorboard=True)
        for r in _records(3):
            logger.log(r)
        logger.close()
    assert caplog.text.count("neither tensorboard nor tensorboardX") == 1  # one warning, not one per record
    assert len(read_metrics(str(tmp_path / "a"))) == 3


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "b"
    logger = RunLogger(str(out), True, {}, tensorboard=True, total_iterations=4)
    for r in _records(3):
        logger.log(r)
    logger.log({"iteration": 3, "objective/score": 0.5, "flag": True, "tag": "x", "nan": float("nan")})
    logger.close()
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # every numeric metric, with the iteration as the step; no bool, text, NaN or None, and no "iteration" scalar
    assert tags == {"objective/score", "objective/kl", "rollout/response_length", "policy/loss", "value/loss"}
    score = [(e.step, e.value) for e in acc.Scalars("objective/score")]
    assert [s for s, _ in score] == [0, 1, 2, 3]
    assert [v for _, v in score] == pytest.approx([0.0, 0.1, 0.2, 0.5], abs=1e-6)
    assert [e.value for e in acc.Scalars("value/loss")] == pytest.approx([2.0, 1.0, 2.0 / 3], abs=1e-6)


def test_output_dir_refused_resumed_or_moved_aside(tmp_path):
    out = tmp_path / "run"
    assert prepare_output_dir(str(out), resume=False, overwrite=False) == [] and out.is_dir()
    (out / "notes.txt").write_text("mine")  # a folder without a run is fine
    assert prepare_output_dir(str(out), resume=False, overwrite=False) == []
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (out / "config.json").write_text("{}")
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        prepare_output_dir(str(out), resume=False, overwrite=False)
    (problem,) = e.value.problems
    assert problem.field == "output_dir" and problem.value == str(out)
    for hint in ("--resume", "--overwrite_output_dir", "another --output_dir", "metrics.jsonl, checkpoints"):
        assert hint in problem.fix
    with pytest.raises(ConfigError):  # other ranks raise the same error
        prepare_output_dir(str(out), resume=False, overwrite=False, is_main=False)
    assert prepare_output_dir(str(out), resume=True, overwrite=False) == []
    assert (out / "metrics.jsonl").exists()  # resume moves nothing
    assert prepare_output_dir(str(out), resume=False, overwrite=True, is_main=False) == []  # only rank 0 moves
    moved = prepare_output_dir(str(out), resume=False, overwrite=True)
    names = sorted(os.path.basename(m).split(".")[0] for m in moved)
    assert names == ["checkpoints", "config", "metrics"] and all(m.endswith(".bak") for m in moved)
    assert not (out / "metrics.jsonl").exists() and (out / "notes.txt").read_text() == "mine"
    bak = [m for m in moved if os.path.basename(m).startswith("metrics.jsonl.")][0]
    assert open(bak).read() == '{"iteration": 0}\n' and os.path.isdir([m for m in moved if "checkpoints" in m][0])
    (out / "metrics.jsonl").write_text("new\n")
    moved2 = prepare_output_dir(str(out), resume=False, overwrite=True)  # same second: a second, distinct backup
    assert len(moved2) == 1 and moved2[0] != bak and open(bak).read() == '{"iteration": 0}\n'
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        prepare_output_dir(str(tmp_path / "file"), resume=False, overwrite=False)


def test_redact_rules():
    env = {"WANDB_API_KEY": FAKE_KEY, "MY_PASSWORD": "hunter22", "GH_TOKEN": "ghp_short", "SOME_KEY": "1",
           "TOKENIZERS_PARALLELISM": "false-ish", "PATH": "/usr/bin:/bin", "AWS_SECRET_ACCESS_KEY": "aws/secret+x"}
    obj = {"a": f"x{FAKE_KEY}y", "b": ["hunter22", ("ghp_short", 3)], "c": 1, "flag": True, "path": "/usr/bin",
           "tokenizers": "false-ish", "client_secret": "s", "hf_token": "abc", "pad_token": "<pad>",
           "eos_token": "</s>", "stop_token_ids": [0], "nested": {"password": "pw", "url": "https://u:aws/secret+x@h"}}
    assert redact(obj, env) == {"a": "x***y", "b": ["***", ("***", 3)], "c": 1, "flag": True, "path": "/usr/bin",
                                "tokenizers": "false-ish", "client_secret": "***", "hf_token": "***",
                                "pad_token": "<pad>", "eos_token": "</s>", "stop_token_ids": [0],
                                "nested": {"password": "***", "url": "https://u:***@h"}}
    assert redact("value 1 stays", env) == "value 1 stays"  # too short to be a secret
    assert redact_argv(["run.py", "--api_key", "abc", "--wandb-api-key=def", "--kl_coef", "0.1", "--x",
                        f"pre{FAKE_KEY}", "--hf_token"], env) == \
        ["run.py", "--api_key", "***", "--wandb-api-key=***", "--kl_coef", "0.1", "--x", "pre***", "--hf_token"]
    for name, secret in [("WANDB_API_KEY", True), ("--hf-token", True), ("password", True), ("key", True),
                         ("pad_token", False), ("stop_token_ids", False), ("tokenizer_name_or_path", False),
                         ("max_prompt_seq_len", False), ("monkey", False)]:
        assert is_secret_name(name) is secret, name


def test_wandb_mode_rule():
    assert wandb_mode({}) == "offline"  # no key: never the network
    assert wandb_mode({"WANDB_MODE": "online"}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k" * 40}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode({"WANDB_API_KEY": "k" * 40, "WANDB_DISABLED": "true"}) == "disabled"


def test_a_resumed_run_continues_its_wandb_run(tmp_path, secrets):
    out = tmp_path / "run"
    first = RunLogger(str(out), True, {}, wandb_project="proj")
    run_id = first._wandb.id
    for r in _records(3):
        first.log(r)
    first.close()
    assert (out / "wandb" / "run_id").read_text().strip() == run_id
    again = RunLogger(str(out), True, {}, wandb_project="proj", resume=True)  # a resume in the same run directory
    assert again._wandb.id == run_id
    for r in _records(5)[2:]:  # from the checkpoint on: step 2 comes again
        again.log(r)
    again.close()
    # offline: two folders of the same run id, which `wandb sync` uploads into one run
    assert len(list((out / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))) == 2
    fresh = RunLogger(str(out), True, {}, wandb_project="proj")  # not a resume (e.g. --overwrite_output_dir)
    assert fresh._wandb.id != run_id and (out / "wandb" / "run_id").read_text().strip() == fresh._wandb.id
    fresh.close()
