"""The fault-injection test hooks (rlhf_engine/faults.py) and the one-line message for failed collectives; the
multi-rank behaviour they trigger is tests/distributed/test_faults.py."""
import os
import subprocess
import sys

import pytest
import torch

from rlhf_engine import faults
from rlhf_engine.hooks import INJECT_ENV, TestHooks
from rlhf_engine.engine.distributed import collective_failure, describe_collective_failure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unset_hooks_do_nothing(monkeypatch):
    monkeypatch.delenv(faults.KILL_VAR, raising=False)
    monkeypatch.delenv(faults.STALL_VAR, raising=False)
    monkeypatch.delenv(INJECT_ENV, raising=False)
    assert not faults.active()
    faults.fault_point("checkpoint", 4, 1)  # returns
    hooks = TestHooks.from_env().attach(1, actor_steps=lambda: 0)
    assert not hooks.faults and hooks.nonfinite is None
    hooks.at("rollout", 0), hooks.after_step(0)  # return
    loss, fn = torch.tensor(1.5), object()
    assert hooks.loss("actor", loss, 0) is loss and hooks.grad("critic", loss, 0) == 0.0
    assert hooks.scores(fn, 0) is fn
    guard, step = object(), type("Step", (), {"role": "actor"})()
    assert hooks.wrap_guard(guard) is guard and hooks.wrap_update_step(step) is step and not vars(step)


@pytest.mark.parametrize("spec", ["1:3", "a:3:train", "1:3:warmup", "1:3:train,0:x:rollout"])
def test_a_bad_spec_is_an_error_naming_the_format(monkeypatch, spec):
    monkeypatch.setenv(faults.KILL_VAR, spec)
    with pytest.raises(ValueError, match="RANK:ITERATION:PHASE"):
        faults.fault_point("train", 3, 1)


def test_hooks_fire_only_at_their_point(monkeypatch):
    monkeypatch.setenv(faults.KILL_VAR, "1:2:train_step, 0:5:rollout")
    fired = []
    monkeypatch.setattr(faults, "fault_point", lambda phase, it, rank: fired.append((phase, it, rank)))
    steps = {"actor": 0}
    hooks = TestHooks(faults_on=True).attach(1, actor_steps=lambda: steps["actor"])
    for phase in ("rollout", "experience", "train"):
        hooks.at(phase, 2)
    assert fired == [("rollout", 2, 1), ("experience", 2, 1), ("train", 2, 1)]
    hooks.after_step(2)  # a micro-step of gradient accumulation: the optimizer has not stepped, no point
    assert fired[-1] == ("train", 2, 1)
    steps["actor"] += 1
    hooks.after_step(2)  # the optimizer step
    assert fired[-1] == ("train_step", 2, 1)
    steps["actor"] += 1
    hooks.after_step(2)  # only the iteration's first optimizer step is a point
    assert [f for f in fired if f[0] == "train_step"] == [("train_step", 2, 1)]


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


def test_wrap_planner_is_the_local_token_mean_negative_control_only_when_asked():
    import types

    import torch

    from rlhf_engine.hooks import TestHooks

    def planner():
        return types.SimpleNamespace(reduce_counts=lambda local: local + 100)  # stands for the all-reduce

    assert TestHooks().wrap_planner(planner(), 2).reduce_counts(torch.tensor(3.0)) == 103.0  # untouched
    local = TestHooks(loss_token_mean="local").wrap_planner(planner(), 2)
    assert local.reduce_counts(torch.tensor(3.0)) == 6.0  # this rank's count times the world size


def test_the_generate_point_acts_in_rollouts_only_not_in_the_evaluation_before_them(monkeypatch):
    """The evaluation's generate calls come after the previous iteration's last point and before this iteration's
    rollout point: a `generate` fault meant for the rollouts of iteration 2 must not fire in them (nor one of
    iteration 1 after its training)."""
    fired = []
    monkeypatch.setattr(faults, "fault_point", lambda phase, it, rank: fired.append((phase, it, rank)))
    backend = type("Backend", (), {"generate": lambda self, *a: "tokens"})()
    hooks = TestHooks(faults_on=True).attach(1, actor_steps=lambda: 0)
    wrapped = hooks.wrap_generator(backend)
    hooks.at("train", 1)
    assert wrapped.generate("evaluation prompts") == "tokens"
    assert [f for f in fired if f[0] == "generate"] == []
    hooks.at("rollout", 2)
    assert wrapped.generate("rollout prompts") == "tokens"
    assert [f for f in fired if f[0] == "generate"] == [("generate", 2, 1)]
