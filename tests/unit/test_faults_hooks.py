"""The fault-injection test hooks (rlhf_engine/faults.py) and the one-line message for failed collectives; the
multi-rank behaviour they trigger is tests/distributed/test_faults.py."""
import os
import subprocess
import sys
import types

import pytest

from rlhf_engine import faults
from rlhf_engine.engine.distributed import collective_failure, describe_collective_failure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unset_hooks_do_nothing(monkeypatch):
    monkeypatch.delenv(faults.KILL_VAR, raising=False)
    monkeypatch.delenv(faults.STALL_VAR, raising=False)
    assert not faults.active()
    faults.fault_point("checkpoint", 4, 1)  # returns
    trainer = types.SimpleNamespace(rollout_phase=len, experience_phase=len, train_phase=len,
                                    engine=types.SimpleNamespace(step=len))
    faults.install(trainer)
    assert trainer.rollout_phase is len and trainer.engine.step is len  # nothing wrapped


@pytest.mark.parametrize("spec", ["1:3", "a:3:train", "1:3:warmup", "1:3:train,0:x:rollout"])
def test_a_bad_spec_is_an_error_naming_the_format(monkeypatch, spec):
    monkeypatch.setenv(faults.KILL_VAR, spec)
    with pytest.raises(ValueError, match="RANK:ITERATION:PHASE"):
        faults.fault_point("train", 3, 1)


def test_installed_hooks_fire_only_at_their_point(monkeypatch):
    monkeypatch.setenv(faults.KILL_VAR, "1:2:train_step, 0:5:rollout")
    fired = []
    monkeypatch.setattr(faults, "fault_point", lambda phase, it, rank: fired.append((phase, it, rank)))
    steps = {"actor": 0, "calls": 0}

    def step(role):  # gradient accumulation 2: every second call is an optimizer step
        steps["calls"] += role == "actor"
        steps["actor"] += role == "actor" and steps["calls"] % 2 == 0
        return role

    engine = types.SimpleNamespace(step=step, optimizer_steps=lambda role: steps[role],
                                   dist=types.SimpleNamespace(rank=1))
    trainer = types.SimpleNamespace(iteration=2, rollout_phase=lambda: "r", experience_phase=lambda r, s: "e",
                                    train_phase=lambda e, s: "t", engine=engine)
    faults.install(trainer)
    assert trainer.rollout_phase() == "r" and trainer.experience_phase(1, 2) == "e" and trainer.train_phase(1, 2) == "t"
    assert engine.step("critic") == "critic" and engine.step("actor") == "actor"  # a micro-step: no fault point
    assert fired == [("rollout", 2, 1), ("experience", 2, 1), ("train", 2, 1)]
    assert engine.step("actor") == "actor"  # the optimizer step
    assert fired[-1] == ("train_step", 2, 1)


def test_kill_point_sigkills_the_process():
    env = {**os.environ, faults.KILL_VAR: "1:3:checkpoint", "PYTHONPATH": ROOT}
    code = ("from rlhf_engine.faults import fault_point\n"
            "fault_point('checkpoint', 3, 0); fault_point('checkpoint', 2, 1); print('alive', flush=True)\n"
            "fault_point('checkpoint', 3, 1); print('not reached')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc
    assert proc.stdout.split() == ["alive"]
    assert "rank 1 (pid" in proc.stderr and "kills itself with SIGKILL at iteration 3, phase checkpoint" in proc.stderr


def test_collective_failures_are_recognised():
    timeout = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                           "waiting 15000ms for recv operation to complete")
    peer = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5015: Connection reset by peer.")
    assert collective_failure(timeout) == "timeout" and collective_failure(peer) == "peer"
    try:
        try:
            raise timeout
        except RuntimeError as e:
            raise ValueError("wrapped") from e
    except ValueError as wrapped:
        assert collective_failure(wrapped) == "timeout"  # found through the cause
    assert collective_failure(ValueError("timed out waiting")) == ""  # not an error a collective raises
    assert collective_failure(RuntimeError("CUDA out of memory")) == ""
    # a network error of the user's own code (a reward function calling a service) is not a collective's
    assert collective_failure(ConnectionResetError("[Errno 104] Connection reset by peer")) == ""
    msg = describe_collective_failure(timeout, 0.25)
    assert msg.startswith("rank 0: a collective operation timed out after 15 s (dist_timeout_minutes = 0.25): "
                          "another rank stalled"), msg
    assert "--resume auto continues from the newest complete checkpoint" in msg
    assert "lost the connection to another rank" in describe_collective_failure(peer)
    assert describe_collective_failure(RuntimeError("other")) == ""
