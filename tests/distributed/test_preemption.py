"""Preemption through the real deepspeed launcher (CPU, gloo, 2 ranks): a SIGUSR1 that reaches one rank mid-run
makes both agree at the next iteration boundary, write a complete checkpoint with a PREEMPTED marker beside its
COMPLETE, and exit 75 (the launcher passes it through); `--resume auto` then ends exactly where an uninterrupted run
ends. The signal is a real one, sent by the rank to itself at a chosen point (RLHF_ENGINE_TEST_SIGNAL, faults.py)."""
import json
import os

import pytest

from _support import ROOT, launch, ppo_args

ENTRY = os.path.join(ROOT, "launch", "train_ppo.py")
VOLATILE = ("time/", "throughput/")
ATOL = 1e-6
RUN = dict(per_device_generation_batch_size=2, generation_batches=2, per_device_training_batch_size=2, ppo_epochs=2,
           max_steps=4, keep_last=0, seed=11, actor_learning_rate=1e-3, critic_learning_rate=1e-3, adaptive_kl="true",
           kl_target=0.05, kl_horizon=200, do_sample="true", export_final="true")


@pytest.fixture(scope="module")
def preempted(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preempt")
    straight, victim = str(tmp / "straight"), str(tmp / "victim")
    runs = {"straight": launch(ENTRY, ppo_args(tiny, straight, **RUN))}
    # rank 1 gets SIGUSR1 as iteration 1's train phase begins: the phase, and the iteration, run to their end
    runs["signal"] = launch(ENTRY, ppo_args(tiny, victim, **RUN), env={"RLHF_ENGINE_TEST_SIGNAL": "1:1:train"})
    listing = sorted(os.listdir(os.path.join(victim, "checkpoints")))
    exported = os.path.exists(os.path.join(victim, "final"))
    run_marker = open(os.path.join(victim, "PREEMPTED")).read() if os.path.exists(os.path.join(victim, "PREEMPTED")) \
        else None
    runs["resume"] = launch(ENTRY, ppo_args(tiny, victim, resume="auto", **RUN))
    return {"straight": straight, "victim": victim, "runs": runs, "listing": listing, "run_marker": run_marker,
            "exported": exported}


def _tail(proc):
    return proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-5000:]


@pytest.mark.distributed
def test_the_signal_checkpoints_the_iteration_reached_and_exits_75(preempted):
    proc = preempted["runs"]["signal"]
    assert proc.returncode == 75, _tail(proc)
    assert preempted["listing"] == ["iter_000002"], preempted["listing"]  # save_interval 0: the signal's only
    ckpt = os.path.join(preempted["victim"], "checkpoints", "iter_000002")
    complete = json.load(open(os.path.join(ckpt, "COMPLETE")))
    marker = json.load(open(os.path.join(ckpt, "PREEMPTED")))
    assert preempted["run_marker"] is not None  # <output_dir>/PREEMPTED: what the sbatch scripts requeue on
    run_marker = json.loads(preempted["run_marker"])
    assert complete["iteration"] == marker["iteration"] == run_marker["iteration"] == 2
    assert run_marker["checkpoint"] == ckpt and "another rank was asked to stop" in run_marker["why"]
    assert "Preempted: preempted at iteration 2" in proc.stderr and "error: Preempted" not in proc.stderr
    assert not preempted["exported"]  # no export: the run is not over


@pytest.mark.distributed
def test_resume_after_preemption_equals_the_uninterrupted_run(preempted):
    from safetensors.torch import load_file

    from rlhf_engine.outputs.metrics import read_metrics

    runs = preempted["runs"]
    assert runs["straight"].returncode == 0, _tail(runs["straight"])
    assert runs["resume"].returncode == 0, _tail(runs["resume"])
    assert not os.path.exists(os.path.join(preempted["victim"], "PREEMPTED"))  # the new attempt cleared it
    straight, resumed = read_metrics(preempted["straight"]), read_metrics(preempted["victim"])
    assert [r["iteration"] for r in resumed] == list(range(4))
    for a, b in zip(straight, resumed):
        a = {k: v for k, v in a.items() if not k.startswith(VOLATILE)}
        b = {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
        assert a.keys() == b.keys()
        assert max(abs(a[k] - b[k]) for k in a) <= ATOL, (a, b)
    for role in ("actor", "critic"):
        x = load_file(os.path.join(preempted["straight"], "final", role, "model.safetensors"))
        y = load_file(os.path.join(preempted["victim"], "final", role, "model.safetensors"))
        assert max(float((x[k].float() - y[k].float()).abs().max()) for k in x) <= ATOL, role
