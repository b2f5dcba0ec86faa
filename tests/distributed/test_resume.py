"""Checkpoints and exact resume on real DeepSpeed engines (CPU, gloo, 2 ranks), the export, and the SLURM rendezvous.

Two launches of tests/distributed/scripts/resume_checks.py:

1. 2 forked ranks (tests/_forked.py): "straight" runs 8 iterations; "part1" is the same command stopped (as a preemption
   would) right after its iteration-4 checkpoint. Both: sampling on, lr > 0 with a linear schedule and warm-up,
   adaptive KL, 2 generation batches of 3 prompts per rank (a global batch of 6 of 32 prompts: 5 batches per epoch,
   so the checkpoint after 8 batches sits mid-epoch), 2 PPO epochs x 2 mini-batches, save_interval 4, keep_last 1.
2. Between the launches the test copies part1 (for the negative control) and plants an INCOMPLETE checkpoint
   iter_000006 in part1 (a copy of iter_000004 without its COMPLETE marker and with garbage state files: loading
   it would crash). Then one process per rank with a fake SLURM environment (srun-style: no launcher variables, the
   rendezvous comes from SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_STEP_NODELIST / SLURM_JOB_ID): "resume"
   continues part1 with `--resume auto` for iterations 4-7 (then the reference hash and the export checks);
   "resume_norng" continues the copy with the RNG restore skipped (test hook), the negative control.

The refusal of a different run and --resume_force run in-process on one rank against the 2-rank checkpoints.
"""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from _support import ROOT, SCRIPTS, check, clean_env, launch, ppo_args

VOLATILE = ("time/", "throughput/", "memory/")
ATOL = 1e-6
RUN = dict(per_device_generation_batch_size=3, generation_batches=2, per_device_training_batch_size=3,
           ppo_epochs=2, max_steps=8, save_interval=4, keep_last=1, seed=7, actor_learning_rate=1e-3,
           critic_learning_rate=1e-3, actor_lr_scheduler_type="linear", actor_num_warmup_steps=2,
           adaptive_kl="true", kl_target=0.05, kl_horizon=200, kl_coef=0.1, do_sample="true", enable_ema="true",
           ema_decay=0.9, normalize_reward="true", unsup_coef=0.5, unsup_text_column="prompt")

# the same checks on partitioned engines, short: actor (and reference, EMA) at ZeRO 3, critic at ZeRO 2; 2 iterations
# straight vs 1 + 1 (a checkpoint every iteration)
ZERO = {**RUN, "max_steps": 2, "save_interval": 1, "actor_zero_stage": 3, "critic_zero_stage": 2,
        "per_device_generation_batch_size": 2, "generation_batches": 1, "per_device_training_batch_size": 2,
        "ppo_epochs": 1}


def args_for(tiny, output_dir, **flags):
    # ptx reads the prompt file as its unsupervised text (its data position is part of the checkpoint)
    return ppo_args(tiny, output_dir, **{"unsupervised_dataset_name": tiny.prompts, **flags})


def _write_spec(tmp, name, runs):
    spec, result = os.path.join(tmp, f"{name}_spec.json"), os.path.join(tmp, f"{name}_result.json")
    with open(spec, "w") as f:
        json.dump({"runs": runs}, f)
    return spec, result


def _read(result):
    with open(result) as f:
        return {r["name"]: r for r in json.load(f)["runs"]}


def _slurm_job_id_with_free_port():
    """A fake SLURM_JOB_ID whose derived rendezvous port (rlhf_engine.engine.distributed.slurm_port) is free."""
    from rlhf_engine.engine.distributed import slurm_port

    for job in range(os.getpid() % 9000 + 1000, 10**7, 7919):
        port = slurm_port(str(job))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(job), port
    raise RuntimeError("no free port")


def launch_srun_style(script, args, nproc=2, timeout=600):
    """One process per rank with the environment srun gives its tasks on one node (no launcher variables)."""
    job, _ = _slurm_job_id_with_free_port()
    procs = []
    for r in range(nproc):
        env = clean_env(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_LOCALID=str(r),
                        SLURM_NODEID="0", SLURM_NTASKS=str(nproc), SLURM_STEP_NUM_TASKS=str(nproc),
                        SLURM_STEP_TASKS_PER_NODE=str(nproc), SLURM_STEP_NODELIST="localhost",
                        SLURM_JOB_NODELIST="localhost")
        env.pop("MASTER_PORT", None)
        env.pop("MASTER_ADDR", None)
        procs.append(subprocess.Popen([sys.executable, script] + list(args), cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [o for o in outs if o.returncode != 0]
    return (bad or outs)[0], job


def _plant_incomplete(ckpt_root, src="iter_000004", dst="iter_000006"):
    path = os.path.join(ckpt_root, dst)
    shutil.copytree(os.path.join(ckpt_root, src), path)
    os.remove(os.path.join(path, "COMPLETE"))
    for name in os.listdir(path):
        if name.startswith("state_rank"):
            with open(os.path.join(path, name), "wb") as f:
                f.write(b"not a checkpoint: a save cut short")
    return path


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume"))
    d = lambda name: os.path.join(tmp, name)  # noqa: E731
    script = os.path.join(SCRIPTS, "resume_checks.py")
    spec, result = _write_spec(tmp, "first", [
        {"name": "straight", "args": args_for(tiny, d("straight"), **RUN)},
        {"name": "part1", "args": args_for(tiny, d("part1"), **RUN), "hooks": {"stop_after": 4}},
        {"name": "z_straight", "args": args_for(tiny, d("z_straight"), **ZERO)},
        {"name": "z_part1", "args": args_for(tiny, d("z_part1"), **ZERO), "hooks": {"stop_after": 1}},
    ])
    check(launch(script, ["--spec", spec, "--out", result], 2, "fork"))
    first = _read(result)
    shutil.copytree(d("part1"), d("part1_norng"))
    listing_before = sorted(os.listdir(os.path.join(d("part1"), "checkpoints")))
    state1 = torch.load(os.path.join(d("part1"), "checkpoints", "iter_000004", "state_rank1.pt"), weights_only=True)
    _plant_incomplete(os.path.join(d("part1"), "checkpoints"))
    spec, result = _write_spec(tmp, "second", [
        {"name": "resume", "args": args_for(tiny, d("part1"), resume="auto", **RUN), "checks": ["reference", "export"]},
        {"name": "resume_norng", "args": args_for(tiny, d("part1_norng"), resume="auto", **RUN),
         "hooks": {"skip_on_resume": ["rng"]}},
        {"name": "z_resume", "args": args_for(tiny, d("z_part1"), resume="auto", **ZERO), "checks": ["export"]},
    ])
    proc, job = launch_srun_style(script, ["--spec", spec, "--out", result])
    check(proc)
    return {"tmp": tmp, "first": first, "second": _read(result), "stdout": proc.stdout, "job": job,
            "listing_before": listing_before, "state_rank1": state1}


def _stable(rec):
    return {k: v for k, v in rec.items() if not k.startswith(VOLATILE)}


def _max_metric_diff(a_records, b_records):
    assert len(a_records) == len(b_records)
    worst = {}
    for a, b in zip(a_records, b_records):
        a, b = _stable(a), _stable(b)
        assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
        for k in a:
            worst[k] = max(worst.get(k, 0.0), abs(a[k] - b[k]))
    return worst


def _max_param_diff(dir_a, dir_b):
    out = {}
    for role in ("actor", "critic", "ema"):
        x = torch.load(os.path.join(dir_a, f"final_{role}.pt"))
        y = torch.load(os.path.join(dir_b, f"final_{role}.pt"))
        assert x.keys() == y.keys()
        out[role] = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
    return out


@pytest.mark.distributed
def test_setup_is_what_the_equivalence_needs(runs):
    straight, part1 = runs["first"]["straight"], runs["first"]["part1"]
    recs = straight["records"]
    assert len(recs) == 8 and part1["stopped"] and straight["dist"][0]["world_size"] == 2
    kl = [r["system/kl_coef"] for r in recs]
    assert len(set(kl)) == 8, f"the adaptive KL coefficient must move every iteration: {kl}"
    assert min(r["rollout/response_length"] for r in recs) < 8  # sampling with stop tokens: uneven lengths
    assert recs[-1]["system/optimizer_steps"] == 8 * 4  # 2 PPO epochs x 2 mini-batches per iteration
    # the checkpoint sits mid-epoch: 4 iterations x 2 generation batches = 8 global batches, 5 per epoch
    state = runs["state_rank1"]
    assert state["providers"]["data"]["epoch"] == 1 and state["providers"]["data"]["batch"] == 3, state["providers"]
    assert state["rank"] == 1 and state["iteration"] == 4
    assert set(state["providers"]) == {"trainer", "data", "kl_controller", "step_guard", "rng", "ptx_data",
                                         "reward_normalizer"}
    assert all("ptx/loss" in r for r in recs)  # ptx is on: its data position must survive the resume too
    assert runs["listing_before"] == ["iter_000004"]


@pytest.mark.distributed
def test_resume_in_a_new_process_equals_the_straight_run(runs):
    straight, resumed = runs["first"]["straight"], runs["second"]["resume"]
    assert resumed["start_iteration"] == 4 and resumed["resumed_from"].endswith("iter_000004")
    # every logged metric (timing aside) of iterations 4-7
    worst = _max_metric_diff(straight["records"][4:], resumed["records"])
    assert max(worst.values()) <= ATOL, worst
    # the resumed run's metrics.jsonl: iterations 0-3 from the first process, 4-7 from the second
    from rlhf_engine.outputs.metrics import read_metrics

    on_disk = read_metrics(resumed["output_dir"])
    assert [r["iteration"] for r in on_disk] == list(range(8))
    worst = _max_metric_diff(straight["records"], on_disk)
    assert max(worst.values()) <= ATOL, worst
    params = _max_param_diff(straight["output_dir"], resumed["output_dir"])
    assert max(params.values()) <= ATOL, params


@pytest.mark.distributed
def test_negative_control_without_rng_restore_differs(runs):
    straight, norng = runs["first"]["straight"], runs["second"]["resume_norng"]
    assert norng["start_iteration"] == 4
    worst = _max_metric_diff(straight["records"][4:], norng["records"])
    assert worst["objective/score"] > 1e-4 or worst["rollout/response_length"] > 1e-4, worst
    params = _max_param_diff(straight["output_dir"], norng["output_dir"])
    assert params["actor"] > 1e-4, params


@pytest.mark.distributed
def test_reference_after_resume_is_the_initial_actor(runs):
    h = runs["second"]["resume"]["hash"]
    assert h["reference"] == h["initial_actor"]
    assert h["actor"] != h["initial_actor"]  # the actor did move: the equality above is not trivial


@pytest.mark.distributed
def test_auto_resume_skips_the_incomplete_checkpoint_and_says_so(runs):
    resumed = runs["second"]["resume"]
    assert resumed["resumed_from"].endswith(os.path.join("checkpoints", "iter_000004"))
    assert ("--resume auto: resuming from " in runs["stdout"] and "iter_000004 (iteration 4), the newest complete "
            "checkpoint (skipped incomplete, no COMPLETE marker: iter_000006)" in runs["stdout"]), runs["stdout"][-3000:]
    root = os.path.join(resumed["output_dir"], "checkpoints")
    # keep_last 1: iter_000004 was removed once iter_000008 was complete; the incomplete folder is never touched
    assert sorted(os.listdir(root)) == ["iter_000006", "iter_000008"]
    assert os.path.isfile(os.path.join(root, "iter_000008", "COMPLETE"))
    assert not os.path.exists(os.path.join(root, "iter_000006", "COMPLETE"))
    meta = json.load(open(os.path.join(root, "iter_000008", "COMPLETE")))
    assert meta["iteration"] == 8 and meta["world_size"] == 2 and meta["roles"] == ["actor", "critic", "ema"]
    assert meta["state_files"] == ["state_rank0.pt", "state_rank1.pt"]
    assert not os.path.exists(os.path.join(root, "iter_000008", "latest"))  # DeepSpeed's pointer is off
    for name in ("actor", "critic", "ema/model.pt", "state_rank0.pt", "state_rank1.pt"):
        assert os.path.exists(os.path.join(root, "iter_000008", name)), name


@pytest.mark.distributed
def test_rendezvous_from_a_slurm_environment(runs):
    from rlhf_engine.engine.distributed import slurm_port

    for run in runs["second"].values():
        got = [(d["rank"], d["world_size"], d["local_rank"], d["MASTER_ADDR"], d["MASTER_PORT"]) for d in run["dist"]]
        port = str(slurm_port(runs["job"]))
        assert got == [(0, 2, 0, "localhost", port), (1, 2, 1, "localhost", port)], got


@pytest.mark.distributed
def test_export_reloads_with_from_pretrained_and_reproduces_the_engine(runs):
    ex = runs["second"]["resume"]["export"]
    assert ex["files"] == ["actor", "critic", "ema"] and ex["tokens"] > 0
    assert ex["actor_max_diff"] <= ATOL and ex["critic_max_diff"] <= ATOL and ex["ema_max_diff"] <= ATOL, ex
    assert ex["ema_vs_actor"] > 1e-4, ex  # the EMA is its own model, not a copy of the actor
    assert ex["tokenizer_same"]


# ---- refusal and --resume_force (one in-process rank against the 2-rank checkpoints) ------------------------------
def _train_ppo_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_ppo_entry", os.path.join(ROOT, "launch", "train_ppo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.distributed
def test_resume_of_another_run_is_refused_naming_every_key(runs, tiny, dist_single, capsys):
    main = _train_ppo_main()
    out = runs["first"]["straight"]["output_dir"]
    before = sorted(os.listdir(out))
    rc = main(args_for(tiny, out, resume="auto", **{**RUN, "seed": 8, "per_device_generation_batch_size": 2,
                                                     "generation_batches": 3}))
    err = capsys.readouterr().err
    assert rc == 2, err
    for key in ("global_generation_batch_size", "global_mini_batch_size", "seed", "generation_batches"):
        assert f"  - {key} = " in err, (key, err)
    assert "in 4 keys" in err and "--resume_force" in err and "iter_000008" in err, err
    assert "  - seed = 8: the checkpoint's run had seed = 7" in err, err
    assert sorted(os.listdir(out)) == before  # refused before anything was written or moved
    # an explicit path to a checkpoint without its marker is refused too
    incomplete = os.path.join(runs["second"]["resume"]["output_dir"], "checkpoints", "iter_000006")
    rc = main(args_for(tiny, out, resume=incomplete, **RUN))
    err = capsys.readouterr().err
    assert rc == 2 and "no COMPLETE marker" in err and "iter_000008" in err, err


@pytest.mark.distributed
def test_resume_force_continues_on_another_world_size(runs, tiny, dist_single, tmp_path, capsys):
    from rlhf_engine.outputs.metrics import read_metrics

    out = str(tmp_path / "forced")
    shutil.copytree(runs["first"]["straight"]["output_dir"], out)
    rc = _train_ppo_main()(args_for(tiny, out, resume="auto", resume_force="true", **{**RUN, "max_steps": 9}))
    assert rc == 0, capsys.readouterr().err
    recs = read_metrics(out)
    assert [r["iteration"] for r in recs] == list(range(9))
    assert recs[-1]["system/optimizer_steps"] == 9 * 4  # 6 rollouts per rank, mini-batches of 3, 2 epochs: 4 steps
    assert os.path.isfile(os.path.join(out, "checkpoints", "iter_000009", "COMPLETE"))


@pytest.mark.distributed
def test_zero3_and_zero2_resume_and_consolidated_export(runs):
    """Partitioned engines: ZeRO-3 actor (module and optimizer partitions per rank) and EMA, ZeRO-2 critic."""
    straight, resumed = runs["first"]["z_straight"], runs["second"]["z_resume"]
    assert resumed["start_iteration"] == 1 and len(straight["records"]) == 2
    worst = _max_metric_diff(straight["records"][1:], resumed["records"])
    assert max(worst.values()) <= ATOL, worst
    params = _max_param_diff(straight["output_dir"], resumed["output_dir"])
    assert max(params.values()) <= ATOL, params
    ckpt = os.path.join(resumed["output_dir"], "checkpoints", "iter_000002")
    files = sorted(os.listdir(os.path.join(ckpt, "actor")))
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in files, files  # ZeRO-3: every rank's partition
    ex = resumed["export"]
    assert ex["files"] == ["actor", "critic", "ema"]
    assert ex["actor_max_diff"] <= ATOL and ex["critic_max_diff"] <= ATOL and ex["ema_max_diff"] <= ATOL, ex
