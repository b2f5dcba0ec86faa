"""Rollout workers generating with vLLM (`--rollout_workers 1 --generation_backend vllm`): 2 trainer ranks under the
deepspeed launcher and one worker process per run, whose vLLM engine holds the only copy of its weights (the
broadcast streams into it block by block). Greedy at max_staleness 0 every logged metric equals the colocated vLLM
run's (one engine per trainer rank) over 3 iterations at lr > 0: the engine on the worker is loaded with the
trainer's weights after every step. At max_staleness 1 the worker samples one version ahead. One launch of
scripts/ppo_checks.py serves every test here; skipped, with the reason, where vLLM is not installed."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from _support import assert_generated_alike, free_address, ppo_args, run_harness_with_workers

pytestmark = [pytest.mark.distributed, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here (bash scripts/install.sh --vllm, then "
                                        ".venv-vllm/bin/python -m pytest -m vllm)")]

ATOL = 1e-5
BASE = dict(generation_backend="vllm", do_sample="false", max_steps=3, seed=3, actor_zero_stage=2,
            actor_learning_rate=1e-3, critic_learning_rate=1e-3, per_device_generation_batch_size=4,
            per_device_training_batch_size=2)
AHEAD = dict(BASE, do_sample="true", actor_zero_stage=3, reference_zero_stage=3, max_staleness=1)


@pytest.fixture(scope="module")
def runs(tiny_vllm, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm_rollout_workers"))
    addresses = [free_address(), free_address()]
    spec = [{"name": "colocated", "args": ppo_args(tiny_vllm, os.path.join(tmp, "colocated"), **BASE)},
            {"name": "workers", "args": ppo_args(tiny_vllm, os.path.join(tmp, "workers"), **BASE, rollout_workers=1,
                                                 rollout_address=addresses[0])},
            {"name": "ahead", "args": ppo_args(tiny_vllm, os.path.join(tmp, "ahead"), **AHEAD, rollout_workers=1,
                                               rollout_address=addresses[1])}]
    return run_harness_with_workers(tmp, "vllm_rollout_workers", spec, addresses, forked=False)


def _train(run):
    return [r for r in run["records"] if "objective/kl" in r]


def test_synchronous_vllm_workers_equal_the_colocated_vllm_run(runs):
    colocated, remote = runs["colocated"], runs["workers"]
    assert len(_train(remote)) == len(_train(colocated)) == 3
    assert_generated_alike(remote, colocated, ATOL)
    # the engine's log-probs are the trainer's recompute to kernel rounding, on the worker as on the trainer's ranks
    assert max(r["rollout/logprob_diff_max"] for r in _train(remote)) < 1e-4


def test_vllm_workers_one_version_ahead(runs):
    records = _train(runs["ahead"])
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1]
    assert all(r["async/dropped_batches"] == 0 for r in records)
    with open(os.path.join(runs["ahead"]["output_dir"], "config.json")) as f:
        assert json.load(f)["rollout_correction"] == "token_truncate"
    assert runs["ahead"]["max_param_change"]["actor"] > 1e-4


def test_every_vllm_worker_stops_cleanly(runs):
    assert runs["worker_exit_codes"] == [0, 0]
