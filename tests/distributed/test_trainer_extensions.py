"""The guards across 2 ranks (gloo, deepspeed launcher), in ONE launch of scripts/trainer_ext_checks.py:

* "skip": the critic's gradients become NaN on rank 1 only, in iteration 1 (actor ZeRO 0, critic ZeRO 2, 2 micro-batches
  x accumulation 2): BOTH engines skip on BOTH ranks: weights and Adam moments of every rank unchanged over iteration 1,
  learning rates not advanced, system/skipped_steps 0 -> 1; iteration 2 updates everything again;
* "loss": the actor's loss becomes NaN on rank 1 in iteration 1: both ranks stop in iteration 1 (no rank waits for the
  collective timeout), each naming rank 1, the iteration and the tensor;
* "score": the reward model's score of row 0 becomes NaN on rank 0 in iteration 1: both ranks stop there too;
* then launch/train_ppo.py's main with a NaN actor gradient on rank 0 in every iteration and max_consecutive_skips 2:
  the deepspeed launcher exits with code 3.
"""
import json
import os
import re

import pytest

from _support import SCRIPTS, launch, ppo_args

RUN = dict(per_device_generation_batch_size=4, per_device_training_batch_size=2, gradient_accumulation_steps=2,
           ppo_epochs=1, seed=6, actor_learning_rate=1e-3, critic_learning_rate=1e-3, actor_lr_scheduler_type="linear",
           actor_num_warmup_steps=2, critic_lr_scheduler_type="linear", critic_num_warmup_steps=2,
           export_final="false", max_consecutive_skips=3)


args_for = ppo_args


@pytest.fixture(scope="module")
def ext(tiny, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ext"))
    d = lambda name: os.path.join(tmp, name)  # noqa: E731
    spec = {
        "runs": [
            {"name": "skip", "args": args_for(tiny, d("skip"), max_steps=3, critic_zero_stage=2, **RUN),
             "inject": {"what": "grad", "role": "critic", "rank": 1, "iteration": 1}},
            {"name": "loss", "args": args_for(tiny, d("loss"), max_steps=3, **RUN),
             "inject": {"what": "loss", "role": "actor", "rank": 1, "iteration": 1}},
            {"name": "score", "args": args_for(tiny, d("score"), max_steps=3, **RUN),
             "inject": {"what": "score", "rank": 0, "iteration": 1}},
        ],
        "final": {"args": args_for(tiny, d("final"), max_steps=5, **{**RUN, "max_consecutive_skips": 2}),
                  "inject": {"what": "grad", "role": "actor", "rank": 0, "iteration": 0, "iterations": 0}},
    }
    spec_path, result = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    proc = launch(os.path.join(SCRIPTS, "trainer_ext_checks.py"), ["--spec", spec_path, "--out", result], 2,
                  "deepspeed")
    assert os.path.isfile(result), proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(result) as f:
        runs = {r["name"]: r for r in json.load(f)["runs"]}
    return proc, runs


@pytest.mark.distributed
def test_a_nan_gradient_on_one_rank_in_one_engine_skips_both_engines_on_every_rank(ext):
    _, runs = ext
    run = runs["skip"]
    assert len(run["ranks"]) == 2 and all(r["error"] is None for r in run["ranks"]), run["ranks"]
    for rank, r in enumerate(run["ranks"]):
        s0, s1, s2, s3 = r["snapshots"]  # before iteration 0, after 0, after 1 (skipped), after 2
        for role in ("actor", "critic"):
            # iteration 0 stepped (at learning rate 0: the first step of a linear warm-up), so Adam holds moments
            assert s0[role]["num_moments"] == 0 and s1[role]["num_moments"] > 0, (rank, role)
            assert s2[role]["params"] == s1[role]["params"], (rank, role)  # iteration 1: nothing moved
            assert s2[role]["moments"] == s1[role]["moments"], (rank, role)
            assert s2[role]["lr"] == s1[role]["lr"] and s2[role]["steps"] == s1[role]["steps"] == 1, (rank, role)
            assert s3[role]["params"] != s2[role]["params"] and s3[role]["moments"] != s2[role]["moments"]
            assert s3[role]["steps"] == 2, (rank, role)
        assert r["skipped"] == 1
    assert [rec["system/skipped_steps"] for rec in run["records"]] == [0, 1, 1]
    warnings = run["ranks"][0]["warnings"]
    assert any("iteration 1" in w and "non-finite critic gradient on rank 1" in w and "skipped the update of actor "
               "and critic" in w for w in warnings), warnings


@pytest.mark.distributed
@pytest.mark.parametrize("name, bad_rank, words", [
    ("loss", 1, "non-finite policy loss on rank 1 (PPO epoch 0, mini-batch 0)"),
    ("score", 0, None),
])
def test_a_nonfinite_number_on_one_rank_stops_every_rank_promptly(ext, name, bad_rank, words):
    _, runs = ext
    run = runs[name]
    assert len(run["records"]) == 1  # iteration 0 was fine
    for rank, r in enumerate(run["ranks"]):
        e = r["error"]
        assert e is not None and e["type"] == "NonFiniteError" and e["iteration"] == 1, (rank, e)
        assert e["message"].startswith(f"rank {rank}, iteration 1: "), e
        assert e["seconds"] < 60, e  # both ranks stopped in the same iteration, none waited for a timeout
        if words:
            assert words in e["message"], e
        elif rank == bad_rank:
            assert "returned non-finite scores for rows [0]" in e["message"], e
        else:
            assert f"non-finite score on rank {bad_rank}" in e["message"], e


@pytest.mark.distributed
def test_k_consecutive_skips_exit_3_through_the_deepspeed_launcher(ext):
    proc, _ = ext
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-6000:]
    # every rank stops in iteration 1 with this line, but the launcher kills the other ranks as soon as one exits
    # non-zero: the line of whichever rank got there first (rank 1's alone, seen in a fresh-clone CI run)
    assert re.search(r"error: TooManySkippedSteps: rank [01], iteration 1: 2 updates in a row were skipped", out), \
        out[-6000:]
