"""Reliability under faults, on real DeepSpeed engines (CPU, gloo, 2 ranks, the deepspeed launcher): a rank killed
mid-iteration, a rank stalled inside a checkpoint write, and `--resume auto` back to the uninterrupted result; and the
kill once more under torchrun (a launch of its own).

Three launches, each checking several things (faults injected with the test hooks of rlhf_engine/faults.py):

1. tests/distributed/scripts/fault_checks.py: "straight" runs 4 iterations uninterrupted (checkpoints every 2);
   then "victim", the same run in another folder, where rank 1 SIGKILLs itself right after the first actor optimizer
   step of iteration 3 (RLHF_ENGINE_TEST_KILL=1:3:train_step): its weights in memory have moved, the newest complete
   checkpoint is iter_000002. -> the launch exits non-zero within seconds, and no rank process survives it.
2. launch/train_ppo.py --resume auto on the victim's folder, with a 15 s collective timeout (dist_timeout_minutes)
   and rank 1 stalling forever inside the save of iter_000004, after the engine files and before the state files and
   the marker (RLHF_ENGINE_TEST_STALL=1:4:checkpoint). -> it resumes from iter_000002 and says so; rank 0 times out
   at the barrier that precedes the marker and ends the job with one clear `error:` line, within the timeout + a
   margin, no rank process survives; iter_000004 is left without its COMPLETE marker.
3. launch/train_ppo.py --resume auto again, no fault (forked ranks: the launcher is not under test). -> it skips the
   partial iter_000004, says so, resumes from iter_000002, and ends with metrics.jsonl and final weights equal to the
   straight run's.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from _support import ROOT, SCRIPTS, clean_env, launch, ppo_args

VOLATILE = ("time/", "throughput/", "memory/")
ATOL = 1e-6
TIMEOUT_S = 15  # the collective timeout of launch 2
RUN = dict(per_device_generation_batch_size=2, generation_batches=2, per_device_training_batch_size=2, ppo_epochs=2,
           max_steps=4, save_interval=2, keep_last=0, seed=11, actor_learning_rate=1e-3, critic_learning_rate=1e-3,
           adaptive_kl="true", kl_target=0.05, kl_horizon=200, do_sample="true")


args_for = ppo_args


def _procs_with(marker: str, parents: dict | None = None) -> dict[int, str]:
    """pid -> cmdline of every live (not zombie) process whose command line contains `marker`; `parents`, when
    given, gets pid -> parent pid of each."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if marker in cmd and fields[0] != "Z":
            out[int(pid)] = cmd
            if parents is not None:
                parents[int(pid)] = int(fields[1])
    return out


def _ranks_in(marker: str, launcher: str) -> set[int]:
    """The pids of a launch's ranks now running: not the launcher, and not a rank's own child caught between its
    fork and its exec (it shows the rank's command line then: a rank's subprocess, e.g. matplotlib's fc-list)."""
    parents: dict = {}
    procs = _procs_with(marker, parents)
    ranks = {pid for pid, cmd in procs.items() if _is_rank(cmd, launcher)}
    return {pid for pid in ranks if parents[pid] not in ranks}


def _is_rank(cmd: str, launcher: str) -> bool:
    """Whether a process (its command line) is one of a launch's ranks, not the launcher itself."""
    if launcher == "deepspeed":
        return "--local_rank=" in cmd
    return "torchrun" not in cmd and "torch.distributed.run" not in cmd


def launch_watched(script, args, marker, log_path, env=None, timeout=300, launcher="deepspeed"):
    """A launcher (deepspeed or torchrun) on 2 ranks, watched: the pids of its rank processes (command line holds
    `marker`), its exit time, and every process still alive with `marker` right after it exited."""
    from rlhf_engine.engine.distributed import free_port

    bindir = os.path.dirname(sys.executable)
    if launcher == "deepspeed":
        head = [os.path.join(bindir, "deepspeed"), "--num_gpus", "2"]
    else:
        head = [os.path.join(bindir, "torchrun"), "--nproc_per_node", "2"]
    cmd = head + ["--master_port", str(free_port()), script] + args
    ranks: set[int] = set()
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(**(env or {})), stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            ranks |= _ranks_in(marker, launcher)
            if time.time() - t0 > timeout:
                proc.kill()
                raise AssertionError(f"launch still running after {timeout}s: {cmd}")
            time.sleep(0.2)
    t_exit = time.time()
    survivors = _procs_with(marker)
    with open(log_path) as f:
        out = f.read()
    return {"rc": proc.returncode, "out": out, "t_exit": t_exit, "ranks": sorted(ranks), "survivors": survivors,
            "wall": t_exit - t0}


def _fault_time(out: str) -> float:
    m = re.search(r"\[fault injection\] .*\(unix time ([0-9.]+)\)", out)
    assert m, out[-4000:]
    return float(m.group(1))


@pytest.fixture(scope="module")
def faults(tiny, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("faults"))
    straight, victim = os.path.join(tmp, "straight"), os.path.join(tmp, "victim")
    spec, result = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
    with open(spec, "w") as f:
        json.dump({"runs": [
            {"name": "straight", "args": args_for(tiny, straight, **RUN)},
            {"name": "victim", "args": args_for(tiny, victim, **RUN),
             "env": {"RLHF_ENGINE_TEST_KILL": "1:3:train_step"}},
        ]}, f)
    first = launch_watched(os.path.join(SCRIPTS, "fault_checks.py"), ["--spec", spec, "--out", result], tmp,
                           os.path.join(tmp, "launch1.log"))
    runs = {}
    if os.path.isfile(result):
        with open(result) as f:
            runs = {r["name"]: r for r in json.load(f)["runs"]}
    after_kill = sorted(os.listdir(os.path.join(victim, "checkpoints")))
    entry = os.path.join(ROOT, "launch", "train_ppo.py")
    second = launch_watched(entry, args_for(tiny, victim, resume="auto", dist_timeout_minutes=TIMEOUT_S / 60, **RUN),
                            tmp, os.path.join(tmp, "launch2.log"), env={"RLHF_ENGINE_TEST_STALL": "1:4:checkpoint"})
    partial = sorted(os.listdir(os.path.join(victim, "checkpoints", "iter_000004")))
    # the requeued command: the launcher is not under test there (forked: tests/_forked.py)
    done = launch(entry, args_for(tiny, victim, resume="auto", **RUN), 2, "fork")
    third = {"rc": done.returncode, "out": done.stdout + done.stderr}
    return {"tmp": tmp, "straight": straight, "victim": victim, "runs": runs, "first": first, "second": second,
            "third": third, "partial": partial, "after_kill": after_kill}


def _stable(rec):
    return {k: v for k, v in rec.items() if not k.startswith(VOLATILE)}


@pytest.mark.distributed
def test_a_killed_rank_ends_the_job_promptly_and_leaves_no_process(faults):
    first = faults["first"]
    assert "straight" in faults["runs"] and "victim" not in faults["runs"], first["out"][-4000:]
    assert first["rc"] != 0, first["out"][-4000:]
    assert "rank 1 (pid" in first["out"] and "SIGKILL at iteration 3, phase train_step" in first["out"]
    assert len(first["ranks"]) == 2, first  # both rank processes were seen running ...
    assert first["survivors"] == {}, first["survivors"]  # ... and nothing of the launch outlived it
    assert first["t_exit"] - _fault_time(first["out"]) < 15, first["out"][-3000:]
    assert faults["after_kill"] == ["iter_000002"]  # the kill came before iteration 3 ended: no iter_000004


@pytest.mark.distributed
def test_a_killed_rank_under_torchrun_ends_the_job_promptly_and_leaves_no_process(tiny, tmp_path):
    """The same kill under torchrun (its elastic agent, not the deepspeed launcher, must end the other rank)."""
    out_dir = str(tmp_path / "victim")
    res = launch_watched(os.path.join(ROOT, "launch", "train_ppo.py"),
                         args_for(tiny, out_dir, **{**RUN, "max_steps": 2, "save_interval": 0}), str(tmp_path),
                         str(tmp_path / "torchrun.log"), env={"RLHF_ENGINE_TEST_KILL": "1:1:train_step"},
                         launcher="torchrun")
    assert res["rc"] != 0, res["out"][-4000:]
    assert "SIGKILL at iteration 1, phase train_step" in res["out"], res["out"][-4000:]
    assert len(res["ranks"]) == 2, res  # both rank processes were seen running ...
    assert res["survivors"] == {}, res["survivors"]  # ... and nothing of the launch outlived it
    assert res["t_exit"] - _fault_time(res["out"]) < 15, res["out"][-3000:]


@pytest.mark.distributed
def test_a_stalled_rank_ends_the_job_at_the_collective_timeout_with_a_clear_message(faults):
    second = faults["second"]
    out = second["out"]
    assert second["rc"] != 0, out[-4000:]
    assert "rank 1 (pid" in out and "stalls forever at iteration 4, phase checkpoint" in out, out[-4000:]
    waited = second["t_exit"] - _fault_time(out)
    assert TIMEOUT_S - 1 < waited < TIMEOUT_S + 25, (waited, out[-3000:])  # the timeout, not the 10-minute default
    assert (f"error: rank 0: a collective operation timed out after {TIMEOUT_S:g} s (dist_timeout_minutes = 0.25): "
            "another rank stalled" in out), out[-3000:]
    assert "--resume auto continues from the newest complete checkpoint" in out
    assert len(second["ranks"]) == 2 and second["survivors"] == {}, second
    # the kill of launch 1 came mid-iteration 3: this launch resumed from the last complete checkpoint, said so
    assert re.search(r"--resume auto: resuming from \S+/checkpoints/iter_000002 \(iteration 2\), the newest complete "
                     r"checkpoint\n", out), out[-4000:]


@pytest.mark.distributed
def test_the_partial_checkpoint_is_never_loaded_and_resume_says_so(faults):
    # launch 2 stopped inside the save: rank 0 wrote its state file, rank 1 never did, nobody wrote the marker
    assert faults["partial"] == ["actor", "critic", "state_rank0.pt"], faults["partial"]
    out = faults["third"]["out"]
    assert faults["third"]["rc"] == 0, out[-4000:]
    assert re.search(r"--resume auto: resuming from \S+/checkpoints/iter_000002 \(iteration 2\), the newest complete "
                     r"checkpoint \(skipped incomplete, no COMPLETE marker: iter_000004\)", out), out[-4000:]
    root = os.path.join(faults["victim"], "checkpoints")
    assert sorted(os.listdir(root)) == ["iter_000002", "iter_000004"]
    meta = json.load(open(os.path.join(root, "iter_000004", "COMPLETE")))
    assert meta["iteration"] == 4 and set(meta["files"]) >= {"state_rank0.pt", "state_rank1.pt"}


@pytest.mark.distributed
def test_resume_after_the_faults_equals_the_uninterrupted_run(faults):
    from safetensors.torch import load_file

    from rlhf_engine.outputs.metrics import read_metrics

    straight = faults["runs"]["straight"]["records"]
    resumed = read_metrics(faults["victim"])
    assert [r["iteration"] for r in resumed] == list(range(4))
    assert len(set(r["system/kl_coef"] for r in straight)) == 4  # the adaptive KL moved: a state worth restoring
    for a, b in zip(straight, resumed):
        a, b = _stable(a), _stable(b)
        assert a.keys() == b.keys()
        worst = max(abs(a[k] - b[k]) for k in a)
        assert worst <= ATOL, (a, b)
    for role in ("actor", "critic"):
        x = load_file(os.path.join(faults["straight"], "final", role, "model.safetensors"))
        y = load_file(os.path.join(faults["victim"], "final", role, "model.safetensors"))
        assert x.keys() == y.keys()
        assert max(float((x[k].float() - y[k].float()).abs().max()) for k in x) <= ATOL, role
    # the records the interrupted launches had logged after iter_000002 were set aside, not lost
    assert any(n.startswith("metrics.jsonl.dropped-") for n in os.listdir(faults["victim"]))
    assert torch.load(os.path.join(faults["victim"], "checkpoints", "iter_000004", "state_rank1.pt"),
                      weights_only=True)["iteration"] == 4


@pytest.mark.distributed
def test_an_error_inside_generate_on_one_rank_ends_the_job_before_the_collective_timeout(tiny, tmp_path):
    """Rank 1 raises inside a generate call of iteration 1 while rank 0 is inside the same call's collectives
    (per-layer ZeRO-3, an environment's turn loop, whose own failures are caught to keep the turn protocol): rank 1
    must exit with its error, and the launcher end rank 0, well before the 15 s collective timeout."""
    flags = dict(RUN, max_steps=2, save_interval=0, environment="_envs:counting", max_turns=2, actor_zero_stage=3,
                 reference_zero_stage=3, critic_zero_stage=3, generation_gather_once="off",
                 dist_timeout_minutes=TIMEOUT_S / 60)
    res = launch_watched(os.path.join(ROOT, "launch", "train_ppo.py"), args_for(tiny, str(tmp_path / "run"), **flags),
                         str(tmp_path), str(tmp_path / "raise.log"), env={"RLHF_ENGINE_TEST_RAISE": "1:1:generate"})
    out = res["out"]
    assert res["rc"] != 0, out[-4000:]
    assert "raises InjectedFailure at iteration 1, phase generate" in out, out[-4000:]
    assert "InjectedFailure: injected failure on rank 1 at iteration 1, phase generate" in out, out[-4000:]
    assert "timed out" not in out, out[-4000:]  # it did not take the collective timeout to end
    assert "(this rank ends the job: its peers may be waiting for it in a collective)" in out, out[-4000:]
    assert res["t_exit"] - _fault_time(out) < TIMEOUT_S, out[-3000:]
    assert len(res["ranks"]) == 2 and res["survivors"] == {}, res
