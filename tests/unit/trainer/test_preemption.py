"""Preemption and time-based saving on one in-process rank, through the launch scripts' `main` (which installs the
signal handlers): a SIGUSR1 at the end of an epoch checkpoints it and exits 75, and `--resume auto` continues into
the next epoch, ending where an uninterrupted run ends (PPO and step 1); before the first iteration a signal exits 75
with no checkpoint; the last iteration ends the run normally; --save_interval_minutes saves once the time has
passed; a SLURM job without any save interval is warned about."""
import json
import os
import signal
import time

import pytest
import torch
from _trainer_args import train_args

from rlhf_engine import signals
from rlhf_engine.outputs.metrics import read_metrics
from rlhf_engine.trainer.preemption import Boundary

import launch.train_ppo as train_ppo
import launch.train_sft as train_sft

VOLATILE = ("time/", "throughput/", "memory/")
# 32 prompts, 8 per iteration: 4 iterations an epoch, 2 epochs
PPO = dict(per_device_generation_batch_size=8, per_device_training_batch_size=4, gradient_accumulation_steps=1,
           ppo_epochs=1, num_train_epochs=2, max_steps=100, seed=5, actor_learning_rate=1e-3,
           critic_learning_rate=1e-3, export_final="false")


@pytest.fixture(autouse=True)
def fresh_signal_state():
    signals.reset()
    yield
    signals.reset()


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _close(a, b, atol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(_stable(a), _stable(b)):
        assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) <= atol, (x, y)


def test_ppo_preempted_at_an_epoch_boundary_resumes_into_the_next_epoch(tiny, dist_single, tmp_path, monkeypatch):
    straight, victim = str(tmp_path / "straight"), str(tmp_path / "victim")
    assert train_ppo.main(train_args(tiny, straight, **PPO)) == 0
    monkeypatch.setenv("RLHF_ENGINE_TEST_SIGNAL", "0:3:train")  # the last iteration of epoch 0
    assert train_ppo.main(train_args(tiny, victim, **PPO)) == 75
    ckpt = os.path.join(victim, "checkpoints", "iter_000004")
    assert os.listdir(os.path.join(victim, "checkpoints")) == ["iter_000004"]
    assert {"COMPLETE", "PREEMPTED"} <= set(os.listdir(ckpt))
    state = torch.load(os.path.join(ckpt, "state_rank0.pt"), weights_only=True)["providers"]["data"]
    assert (state["epoch"], state["batch"]) == (1, 0)  # the next batch: the first of epoch 1
    monkeypatch.delenv("RLHF_ENGINE_TEST_SIGNAL")
    signals.reset()
    assert train_ppo.main(train_args(tiny, victim, resume="auto", **PPO)) == 0
    _close(read_metrics(straight), read_metrics(victim))
    assert len(read_metrics(victim)) == 8  # epoch 1 was trained, not skipped as if the run had ended


def test_sft_preempted_at_an_epoch_boundary_resumes_into_the_next_epoch(tiny, dist_single, tmp_path, monkeypatch):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}", "response": f"answer {i}"}) + "\n"
                            for i in range(8)))
    args = ["--model_name_or_path", tiny.actor, "--data_path", str(data), "--per_device_training_batch_size", "2",
            "--num_train_epochs", "2", "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8",
            "--learning_rate", "1e-3", "--seed", "3"]
    straight, victim = str(tmp_path / "straight"), str(tmp_path / "victim")
    assert train_sft.main(args + ["--output_dir", straight]) == 0
    monkeypatch.setenv("RLHF_ENGINE_TEST_SIGNAL", "0:3:train_step")  # step 4 of 8: the end of epoch 0
    assert train_sft.main(args + ["--output_dir", victim]) == 75
    assert os.listdir(os.path.join(victim, "checkpoints")) == ["iter_000004"]
    assert os.path.exists(os.path.join(victim, "PREEMPTED")) and not os.path.exists(os.path.join(victim, "model"))
    monkeypatch.delenv("RLHF_ENGINE_TEST_SIGNAL")
    signals.reset()
    assert train_sft.main(args + ["--output_dir", victim, "--resume", "auto"]) == 0
    a, b = read_metrics(straight), read_metrics(victim)
    steps = [r["iteration"] for r in a if "sft/loss" in r]
    assert len(steps) == 8 and [r["iteration"] for r in b if "sft/loss" in r] == steps  # epoch 1 was trained
    _close(a, b)
    from safetensors.torch import load_file

    x, y = (load_file(os.path.join(d, "model", "model.safetensors")) for d in (straight, victim))
    assert max(float((x[k] - y[k]).abs().max()) for k in x) <= 1e-6


def test_a_signal_before_the_first_iteration_exits_75_without_a_checkpoint(tiny, dist_single, tmp_path):
    signals.install()
    os.kill(os.getpid(), signal.SIGUSR1)  # arrives while the run starts up
    out = str(tmp_path / "run")
    try:
        assert train_ppo.main(train_args(tiny, out, **PPO)) == 75
    finally:
        signals.uninstall()
    assert not os.path.exists(os.path.join(out, "checkpoints"))
    assert json.load(open(os.path.join(out, "PREEMPTED")))["checkpoint"] is None


def test_a_signal_in_the_last_iteration_ends_the_run_normally(tiny, dist_single, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_ENGINE_TEST_SIGNAL", "0:1:train")
    out = str(tmp_path / "run")
    assert train_ppo.main(train_args(tiny, out, **dict(PPO, max_steps=2))) == 0
    assert not os.path.exists(os.path.join(out, "PREEMPTED"))
    assert os.listdir(os.path.join(out, "checkpoints")) == ["iter_000002"]  # the final one


def test_time_based_saving_and_the_slurm_warning(tiny, dist_single, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    out = str(tmp_path / "run")
    with caplog.at_level("WARNING"):
        assert train_ppo.main(train_args(tiny, out, **dict(PPO, max_steps=3))) == 0
    assert "running under SLURM (job 77) with neither save_interval nor save_interval_minutes" in caplog.text
    assert os.listdir(os.path.join(out, "checkpoints")) == ["iter_000003"]  # the end only
    caplog.clear()
    out = str(tmp_path / "timed")
    with caplog.at_level("WARNING"):  # a tiny interval: due at every boundary
        assert train_ppo.main(train_args(tiny, out, save_interval_minutes=1e-9, keep_last=0,
                                         **dict(PPO, max_steps=3))) == 0
    assert "running under SLURM" not in caplog.text
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["iter_000001", "iter_000002", "iter_000003"]


def test_the_time_interval_arithmetic(dist_single, tmp_path):
    now = [0.0]
    b = Boundary(dist_single, str(tmp_path), save_interval_minutes=2, clock=lambda: now[0])
    now[0] = 119.0
    assert b.poll() == (False, False)
    now[0] = 120.0
    assert b.poll() == (False, True)
    b.saved()
    now[0] = 200.0
    assert b.poll() == (False, False)
    assert b.seconds_since_notice() is None
    (tmp_path / "PREEMPT_REQUESTED").write_text("")
    assert b.poll() == (True, False) and "PREEMPT_REQUESTED found" in b.why()
    assert 0 <= b.seconds_since_notice() < 60  # from the request file's time: whichever rank or file asked
    assert Boundary(dist_single, str(tmp_path / "x"), 0, clock=lambda: 1e9).poll() == (False, False)


def test_sigterm_is_a_preemption_notice_only_inside_slurm(monkeypatch):
    """Outside SLURM the launchers tear a failed job's ranks down with SIGTERM: it must keep killing them."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert signals.handled() == (signal.SIGUSR1,)
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    assert signals.handled() == (signal.SIGUSR1, signal.SIGTERM)
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # noted, not fatal
        assert signals.received() == "SIGTERM"
    finally:
        signals.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_preempt_signals_opts_in_to_sigterm_outside_slurm_and_reinstalling_restores_the_rest(monkeypatch):
    """torchrun elastic agents and Kubernetes give notice with SIGTERM: `--preempt_signals USR1,TERM` notes it
    outside SLURM too; installing another set gives a dropped signal its own handler back."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert signals.handled("USR1,TERM") == signals.handled("sigusr1, SIGTERM") == (signal.SIGUSR1, signal.SIGTERM)
    signals.reset()
    signals.install("USR1,TERM")
    try:
        assert signals.installed() == (signal.SIGUSR1, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # noted, not fatal
        assert signals.received() == "SIGTERM" and 0 <= time.time() - signals.received_at() < 5
        signals.install("auto")  # back to SIGUSR1 only: SIGTERM kills again
        assert signals.installed() == (signal.SIGUSR1,)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signals.uninstall()
        signals.reset()
    assert signals.received_at() is None


@pytest.mark.parametrize("value", ["KILL", "USR1,HUP", ""])
def test_preempt_signals_outside_the_list_are_refused_naming_the_field(value):
    from rlhf_engine.cli import parse_args
    from rlhf_engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"preempt_signals = .*must be 'auto' or a comma-separated list of USR1, USR2"):
        parse_args(["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl", "--preempt_signals", value])
