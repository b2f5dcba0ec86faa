"""Rollout workers of their own (`--rollout_workers 1`, max_staleness 0): 2 trainer ranks and one worker
process per run (3 processes, forked: tests/_forked.py), started after the trainer (a worker that comes late joins). With
greedy decoding every logged metric equals the colocated run's (lean on the trainer's ranks) over 3 iterations at
lr > 0: GAE at ZeRO 3, GRPO at ZeRO 2, and a 2-turn environment (GAE, ZeRO 2; its episodes played on the worker):
the proof that the weights the worker holds
after each broadcast are the trainer's. One launch of scripts/ppo_checks.py serves every test here."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from _support import ROOT, RolloutWorkers, assert_generated_alike, assert_resumed_exactly, clean_env, \
    free_address, ppo_args, run_harness_with_workers

ATOL = 1e-5
BASE = dict(do_sample="false", max_steps=3, seed=3, actor_learning_rate=1e-3, per_device_generation_batch_size=4,
            per_device_training_batch_size=2)
CASES = {"gae_z3": dict(actor_zero_stage=3, reference_zero_stage=3, critic_zero_stage=3, critic_learning_rate=1e-3),
         "grpo_z2": dict(actor_zero_stage=2, advantage_estimator="grpo", n_samples_per_prompt=2,
                         per_device_generation_batch_size=2),
         "env_z2": dict(actor_zero_stage=2, environment="_envs:counting", max_turns=2, critic_learning_rate=1e-3)}
# LR0 and AHEAD write 32 tokens a response (no stop token): a generation long enough that the K = 1 overlap test
# (test_k1_generates_one_version_ahead_and_never_staler) compares waits well apart from the mailbox's milliseconds
LONG = dict(max_answer_seq_len=32, stop_token_ids=[])
LR0 = dict(BASE, do_sample="true", actor_learning_rate=0.0, critic_learning_rate=0.0, ppo_epochs=2, **LONG)
AHEAD = dict(BASE, do_sample="true", max_steps=4, max_staleness=1, critic_learning_rate=1e-3, eval_split=0.25,
             eval_interval=2, **LONG)
# episodes played ahead on the worker (the environment runs there); no evaluation with an environment
AHEAD_ENV = dict(BASE, do_sample="true", max_steps=3, max_staleness=1, critic_learning_rate=1e-3,
                 environment="_envs:counting", max_turns=2)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("rollout_workers"))
    spec, addresses = [], []
    for name, flags in CASES.items():
        addresses.append(free_address())
        run = {**BASE, **flags}
        # greedy GRPO groups: member k keeps all but its last k tokens (the harness's group_spread), so they differ
        hooks = {"group_spread": True} if "grpo" in name else {}
        spec.append({"name": f"{name}_colocated", "hooks": hooks,
                     "args": ppo_args(tiny, os.path.join(tmp, f"{name}_colocated"), **run)})
        spec.append({"name": f"{name}_workers", "hooks": hooks,
                     "args": ppo_args(tiny, os.path.join(tmp, f"{name}_workers"), **run, rollout_workers=1,
                                      rollout_address=addresses[-1], save_interval=2)})
    # K = 0 resumed from gae_z3_workers' checkpoint after 2 iterations (its save_interval) with a worker started
    # again: the worker joins and takes the checkpoint's weights before it generates
    addresses.append(free_address())
    spec.append({"name": "gae_z3_resumed", "args": ppo_args(
        tiny, os.path.join(tmp, "gae_z3_resumed"), **{**BASE, **CASES["gae_z3"]}, rollout_workers=1,
        rollout_address=addresses[-1], resume=os.path.join(tmp, "gae_z3_workers", "checkpoints", "iter_000002"))})
    addresses.append(free_address())
    spec.append({"name": "lr0_workers", "args": ppo_args(tiny, os.path.join(tmp, "lr0_workers"), **LR0,
                                                         rollout_workers=1, rollout_address=addresses[-1])})
    # K = 1: straight (a checkpoint after 2 iterations, saved while iteration 2's batches were in flight), resumed from
    # that checkpoint with a worker started again, and episodes
    mid = os.path.join(tmp, "ahead", "checkpoints", "iter_000002")
    for name, out, run in (("ahead", os.path.join(tmp, "ahead"), {**AHEAD, "save_interval": 2}),
                           ("ahead_resumed", os.path.join(tmp, "ahead_resumed"), {**AHEAD, "resume": mid}),
                           ("ahead_env", os.path.join(tmp, "ahead_env"), AHEAD_ENV)):
        addresses.append(free_address())
        # the straight K = 1 run under a deliberately slow trainer: the worker's generation hides behind it
        spec.append({"name": name, "hooks": {"slow_train_s": 0.5} if name == "ahead" else {},
                     "args": ppo_args(tiny, out, **run, rollout_workers=1, rollout_address=addresses[-1])})
    # the bitwise broadcast checks (scripts/rollout_worker_checks.py), one worker each at ZeRO 2 and 3
    addresses += [free_address(), free_address()]
    spec.append({"name": "broadcast", "kind": "broadcast_checks", "actor": tiny.actor, "prompts": tiny.prompts,
                 "workdir": os.path.join(tmp, "broadcast"), "addresses": addresses[-2:]})
    return run_harness_with_workers(tmp, "rollout_workers", spec, addresses)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CASES))
def test_synchronous_workers_equal_the_colocated_run(runs, name):
    colocated, remote = runs[f"{name}_colocated"], runs[f"{name}_workers"]
    assert len(remote["records"]) == len(colocated["records"]) >= 3
    assert_generated_alike(remote, colocated, ATOL)
    assert all("time/weight_broadcast" in r for r in remote["records"] if "objective/kl" in r)


@pytest.mark.distributed
def test_every_worker_stops_cleanly_when_its_trainer_is_done(runs):
    # the cases, K = 0 resumed, lr 0, three K = 1 runs, two broadcast checks
    assert runs["worker_exit_codes"] == [0] * (len(CASES) + 7)


@pytest.mark.distributed
def test_k0_resume_with_a_worker_started_again_is_bitwise(runs):
    """The resumed run's worker is a new process: it joins, takes the checkpoint's weights, and iteration 2 is the
    straight run's exactly (every logged metric but the clocks, every rank's rollout)."""
    straight, resumed = runs["gae_z3_workers"], runs["gae_z3_resumed"]
    assert_resumed_exactly(straight, resumed, 2)


@pytest.mark.distributed
def test_lr0_every_ratio_is_one_with_worker_rollouts(runs):
    run = runs["lr0_workers"]
    assert run["ratio_trace"] and max(run["ratio_trace"]) == 0.0 and run["max_param_change"]["actor"] == 0.0
    # sampled on the worker: its generation-time log-probs are the trainer's to kernel rounding
    assert max(r["rollout/logprob_diff_max"] for r in run["records"]) < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_after_a_broadcast_the_worker_holds_the_trainer_s_weights_bitwise(runs, stage):
    w = runs["broadcast"][stage]
    assert w["after_broadcast"]["equal"] and w["after_next_broadcast"]["equal"]
    # negative control: the actor stepped and nothing was broadcast: the hashes differ
    assert w["stepped_without_broadcast"]["equal"] is False
    assert w["after_next_broadcast"]["version"] == w["after_broadcast"]["version"] + 1
    assert w["broadcast_again_is_a_no_op"]


def _train(run):
    return [r for r in run["records"] if "objective/kl" in r]  # not the final evaluation's record


@pytest.mark.distributed
def test_k1_generates_one_version_ahead_and_never_staler(runs):
    """Iteration k + 1's batches are generated while the trainer trains on k (with the weights before that update):
    staleness 1 from the second iteration on, 0 for the first, never more; the correction defaults to
    token_truncate; the waits on both sides are reported; an evaluation between iterations takes its own batch."""
    records = _train(runs["ahead"])
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1, 1]
    assert all(r["async/dropped_batches"] == 0 for r in records)
    assert all(r["time/trainer_wait"] >= 0 and r["time/worker_idle"] >= 0 for r in records)
    # overlap: under a trainer slowed by 0.5 s per update, the rollouts of iterations 1-3 were ready when it came for
    # them; a K = 0 run of the same batches waits for each generation (lr0_workers: the same shapes). Iterations
    # with an evaluation aside: its batch is generated when asked, behind the next iteration's at the worker
    waits = [r["time/trainer_wait"] for r in records[1:] if "eval/score" not in r]
    assert waits
    ahead_wait = max(waits)
    sync_wait = min(r["time/trainer_wait"] for r in _train(runs["lr0_workers"])[1:])
    assert ahead_wait < 0.5 * sync_wait, (ahead_wait, sync_wait)
    assert sum("eval/score" in r for r in runs["ahead"]["records"]) >= 2
    with open(os.path.join(runs["ahead"]["output_dir"], "config.json")) as f:
        assert json.load(f)["rollout_correction"] == "token_truncate"
    assert runs["ahead"]["max_param_change"]["actor"] > 1e-4


@pytest.mark.distributed
def test_k1_episodes_are_played_ahead_on_the_worker(runs):
    """An environment with K = 1: the worker plays iteration k + 1's 2-turn episodes while the trainer trains on k
    (staleness 0, 1, 1); every episode took both turns, turn 1 rewarded as the environment says."""
    records = _train(runs["ahead_env"])
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1]
    for r in records:
        assert r["env/turns_mean"] == 2.0 and r["env/turn1_reward_mean"] == 0.25 and r["env/errors"] == 0.0, r
        assert r["env/observation_tokens_mean"] > 0
    assert runs["ahead_env"]["max_param_change"]["actor"] > 1e-4


@pytest.mark.distributed
def test_k1_resume_discards_rollouts_in_flight_and_redraws_their_prompts(runs):
    """The straight run's checkpoint after 2 iterations, saved while iteration 2's batches were in flight, holds the
    data position of the first prompt not trained on: the run resumed from it (a new worker) trains iteration 2 on
    the same prompts as the straight run, generated afresh with its current weights (staleness 0)."""
    straight, resumed = runs["ahead"], runs["ahead_resumed"]
    assert [r["iteration"] for r in _train(resumed)] == [2, 3]
    assert _train(resumed)[0]["async/staleness_max"] == 0
    for rs, rr in zip(straight["ranks"], resumed["ranks"]):
        width = rs["rollouts"][2]["prompt_lengths"][0]
        prompts = [row[:width] for row in rs["rollouts"][2]["sequences"]]
        width_r = rr["rollouts"][0]["prompt_lengths"][0]
        assert prompts == [row[:width_r] for row in rr["rollouts"][0]["sequences"]]


@pytest.mark.distributed
def test_a_killed_worker_stops_the_run_naming_it_after_a_checkpoint(tiny, tmp_path):
    """SIGKILL to the worker after the trainer's second iteration: every rank stops with exit code 1 and one line
    naming the worker, after a complete checkpoint of the iterations done (the newest COMPLETE one is theirs)."""
    import signal

    from rlhf_engine.engine.distributed import free_port
    from rlhf_engine.outputs.checkpoint import latest_complete

    address, out = free_address(), str(tmp_path / "run")
    args = ppo_args(tiny, out, **{**BASE, "max_steps": 200, "save_interval": 5, "critic_learning_rate": 1e-3},
                    rollout_workers=1, rollout_address=address, rollout_timeout_s=8)
    bindir = os.path.dirname(sys.executable)
    trainer = subprocess.Popen([os.path.join(bindir, "deepspeed"), "--num_gpus", "2", "--master_port",
                                str(free_port()), os.path.join(ROOT, "launch", "train_ppo.py"), *args], cwd=ROOT,
                               env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = RolloutWorkers(str(tmp_path), [address], delay=0.0, forked=False)  # started as a user does
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and trainer.poll() is None:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 7:
            break
        time.sleep(0.2)
    workers.thread.join()
    workers.procs[0].send_signal(signal.SIGKILL)
    output, _ = trainer.communicate(timeout=180)
    codes = workers.wait()
    assert codes == [-signal.SIGKILL]
    assert trainer.returncode == 1, output[-3000:]
    # named: the worker whose answer did not come, or the broadcast it left (whichever it was in when killed)
    named = re.search(r"error: RolloutWorkerLost: .*rollout worker.*\(of 1, at " + re.escape(address), output)
    assert named, output[-3000:]
    done = sum(1 for _ in open(metrics))
    latest = latest_complete(os.path.join(out, "checkpoints"))
    assert latest is not None and latest.endswith(f"iter_{done:06d}"), (latest, done)
    # its data position is the start of the lost iteration: exactly the batches of the iterations done were drawn
    import torch

    from rlhf_engine.outputs.checkpoint import state_file

    state = torch.load(os.path.join(latest, state_file(0)), weights_only=False)
    assert state["providers"]["data"]["consumed"] == done * 1, state["providers"]["data"]  # 1 generation batch each
