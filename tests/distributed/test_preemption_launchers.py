"""Preemption through the real deepspeed launcher (CPU, gloo, 2 ranks): a SIGUSR1 that reaches one rank mid-run
makes both agree at the next iteration boundary, write a complete checkpoint with a PREEMPTED marker beside its
COMPLETE, and exit 75 (the launcher passes it through); `--resume auto` then ends exactly where an uninterrupted run
ends. The signal is a real one, sent by the rank to itself at a chosen point (RLHF_ENGINE_TEST_SIGNAL, faults.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _support import ROOT, clean_env, launch, ppo_args

ENTRY = os.path.join(ROOT, "launch", "train_ppo.py")
VOLATILE = ("time/", "throughput/", "memory/")
ATOL = 1e-6
RUN = dict(per_device_generation_batch_size=2, generation_batches=2, per_device_training_batch_size=2, ppo_epochs=2,
           max_steps=4, keep_last=0, seed=11, actor_learning_rate=1e-3, critic_learning_rate=1e-3, adaptive_kl="true",
           kl_target=0.05, kl_horizon=200, do_sample="true", export_final="true")


def harness_runs(tiny, tmp):
    """The uninterrupted run, in the shared 2-rank launch of ppo_checks.py (tests/_support.py: SharedHarness; it
    trains and exports as launch/train_ppo.py does): only the signalled run needs the deepspeed launcher."""
    return {"two_rank": [{"name": "straight", "args": ppo_args(tiny, os.path.join(tmp, "straight"), **RUN)}]}


@pytest.fixture(scope="module")
def preempted(tiny, tmp_path_factory, two_rank):
    tmp = tmp_path_factory.mktemp("preempt")
    straight, victim = two_rank["straight"]["output_dir"], str(tmp / "victim")
    runs = {}
    # rank 1 gets SIGUSR1 as iteration 1's train phase begins: the phase, and the iteration, run to their end
    runs["signal"] = launch(ENTRY, ppo_args(tiny, victim, **RUN), env={"RLHF_ENGINE_TEST_SIGNAL": "1:1:train"})
    listing = sorted(os.listdir(os.path.join(victim, "checkpoints")))
    exported = os.path.exists(os.path.join(victim, "final"))
    run_marker = open(os.path.join(victim, "PREEMPTED")).read() if os.path.exists(os.path.join(victim, "PREEMPTED")) \
        else None
    # the requeued command: the launcher is not under test there (the signal's launch above is)
    runs["resume"] = launch(ENTRY, ppo_args(tiny, victim, resume="auto", **RUN), launcher="fork")
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


@pytest.mark.distributed
def test_torchrun_sigterm_with_the_opt_in_ends_with_a_complete_checkpoint(tiny, tmp_path):
    """Kubernetes or a torchrun elastic agent: the notice is a real SIGTERM to the torchrun agent, which passes it on
    to its workers and kills them 30 s later. With `--preempt_signals USR1,TERM` the ranks note it, agree at the
    next boundary and write a complete checkpoint in time; the marker records how long that took."""
    from rlhf_engine.engine.distributed import free_port

    out = str(tmp_path / "run")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", "--master_port",
           str(free_port()), ENTRY, *ppo_args(tiny, out, **{**RUN, "max_steps": 200, "export_final": "false"},
                                              preempt_signals="USR1,TERM")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 240
    while not (os.path.exists(metrics) and open(metrics).read().count("\n") >= 1):  # iteration 0 is done
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=120)[0]
    marker = json.load(open(os.path.join(out, "PREEMPTED")))
    assert "SIGTERM received" in marker["why"], text[-4000:]
    assert os.path.exists(os.path.join(marker["checkpoint"], "COMPLETE"))
    assert 0 < marker["seconds_since_signal"] < 30, marker  # before the agent's SIGKILL
    assert marker["iteration"] < 200


# ---- slow: torchrun, a signal during a save, the real sbatch script, two nodes ------------------------------------
@pytest.mark.slow
def test_under_torchrun_the_marker_is_written_though_the_code_is_not_passed(tiny, tmp_path):
    out = str(tmp_path / "run")
    proc = launch(ENTRY, ppo_args(tiny, out, **RUN), launcher="torchrun", env={"RLHF_ENGINE_TEST_SIGNAL": "0:1:train"})
    assert proc.returncode != 0, _tail(proc)  # torchrun reports a rank's 75 as a failure (1)
    marker = json.load(open(os.path.join(out, "PREEMPTED")))
    assert marker["checkpoint"].endswith("iter_000002") and "SIGUSR1 received" in marker["why"]
    assert os.path.exists(os.path.join(marker["checkpoint"], "COMPLETE"))


@pytest.mark.slow
def test_a_signal_during_a_save_lets_it_finish_and_is_not_saved_twice(tiny, tmp_path):
    out = str(tmp_path / "run")
    proc = launch(ENTRY, ppo_args(tiny, out, **dict(RUN, save_interval=2)),
                  env={"RLHF_ENGINE_TEST_SIGNAL": "1:2:checkpoint"})  # inside the save of iter_000002, rank 1
    assert proc.returncode == 75, _tail(proc)
    assert os.listdir(os.path.join(out, "checkpoints")) == ["iter_000002"]
    ckpt = os.path.join(out, "checkpoints", "iter_000002")
    assert {"COMPLETE", "PREEMPTED", "state_rank0.pt", "state_rank1.pt"} <= set(os.listdir(ckpt))
    assert json.load(open(os.path.join(ckpt, "PREEMPTED")))["iteration"] == 2


def _wait_for_records(path, n, proc, timeout=300):
    import time

    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_the_sbatch_script_forwards_the_signal_and_requeues_a_preempted_run(tiny, tmp_path):
    """ppo_single_node.sbatch with the real deepspeed launcher (2 CPU ranks) and a fake `scontrol` on PATH: SIGUSR1 to
    the batch shell -> the ranks checkpoint and exit 75 -> `scontrol requeue`; the requeued job resumes and ends
    normally, without a requeue."""
    import signal
    import subprocess
    import sys

    from _support import clean_env

    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"
    (bindir / "scontrol").write_text(f"#!/bin/bash\necho \"scontrol $*\" >> {calls}\n")
    (bindir / "scontrol").chmod(0o755)
    out = str(tmp_path / "run")
    env = clean_env(PATH=f"{bindir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", SLURM_JOB_ID="4321",
                    SLURM_GPUS_ON_NODE="2", SLURM_CPUS_PER_TASK="2", RLHF_REPO=ROOT, RLHF_VENV="none",
                    OUTPUT_DIR=out, MASTER_PORT=str(__import__("rlhf_engine.engine.distributed",
                                                                 fromlist=["free_port"]).free_port()))
    args = ppo_args(tiny, out, **dict(RUN, max_steps=40))
    args = [a for a in args if a not in ("--output_dir", out)]  # the script passes --output_dir "$OUTPUT_DIR"
    script = os.path.join(ROOT, "launch", "slurm", "ppo_single_node.sbatch")
    first = subprocess.Popen(["bash", script, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    assert _wait_for_records(os.path.join(out, "metrics.jsonl"), 1, first)
    first.send_signal(signal.SIGUSR1)
    log, _ = first.communicate(timeout=300)
    assert first.returncode == 75, log[-5000:]
    assert "scontrol requeue 4321" in calls.read_text()
    marker = json.load(open(os.path.join(out, "PREEMPTED")))
    assert os.path.exists(os.path.join(marker["checkpoint"], "COMPLETE"))
    second = subprocess.run(["bash", script, *args, "--max_steps", str(marker["iteration"] + 1)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout + second.stderr
    assert calls.read_text().count("scontrol requeue") == 1 and not os.path.exists(os.path.join(out, "PREEMPTED"))


@pytest.mark.slow
def test_two_nodes_on_one_machine_run_and_a_lost_node_ends_the_job(tiny, tmp_path):
    """torchrun --nnodes 2 over a localhost c10d rendezvous, two agents of one rank each: a short run completes on
    both; in a long one, killing the second "node" (its agent and rank) ends the first within seconds."""
    import signal
    import subprocess
    import sys
    import time

    from _support import clean_env
    from rlhf_engine.engine.distributed import free_port

    def agents(out, steps):
        port = free_port()
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"job{port}", ENTRY,
               *ppo_args(tiny, out, **dict(RUN, max_steps=steps, export_final="false"))]
        return [subprocess.Popen(cmd, env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True) for _ in range(2)]

    short = agents(str(tmp_path / "short"), 2)
    logs = [p.communicate(timeout=300)[0] for p in short]
    assert [p.returncode for p in short] == [0, 0], [log[-3000:] for log in logs]
    first, second = agents(str(tmp_path / "long"), 200)
    assert _wait_for_records(str(tmp_path / "long" / "metrics.jsonl"), 1, first)
    os.killpg(second.pid, signal.SIGKILL)  # the whole "node": agent and rank
    t0 = time.time()
    log, _ = first.communicate(timeout=120)
    assert first.returncode != 0 and time.time() - t0 < 60, (time.time() - t0, log[-3000:])
