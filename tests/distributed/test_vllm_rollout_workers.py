"""Rollout workers generating with vLLM (`--rollout_workers 1 --generation_backend vllm`), the cheap form kept until
the workers are removed (the rollout servers replace them: tests/distributed/test_rollout_servers.py holds the K = 0
equality with the colocated vLLM run, and tests/distributed/test_rollout_workers.py the workers' own with lean): 2
trainer ranks and one worker process whose vLLM engine holds the only copy of its weights (the broadcast streams into
it block by block) samples one version ahead at max_staleness 1. Skipped, with the reason, where vLLM is not
installed."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from _support import free_address, ppo_args, run_harness_with_workers

pytestmark = [pytest.mark.distributed, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here (bash scripts/install.sh --vllm, then "
                                        ".venv-vllm/bin/python -m pytest -m vllm)")]

BASE = dict(generation_backend="vllm", do_sample="false", max_steps=3, seed=3, actor_zero_stage=2,
            actor_learning_rate=1e-3, critic_learning_rate=1e-3, per_device_generation_batch_size=4,
            per_device_training_batch_size=2)
AHEAD = dict(BASE, do_sample="true", actor_zero_stage=3, reference_zero_stage=3, max_staleness=1)


@pytest.fixture(scope="module")
def runs(tiny_vllm, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm_rollout_workers"))
    addresses = [free_address()]
    spec = [{"name": "ahead", "args": ppo_args(tiny_vllm, os.path.join(tmp, "ahead"), **AHEAD, rollout_workers=1,
                                               rollout_address=addresses[0])}]
    return run_harness_with_workers(tmp, "vllm_rollout_workers", spec, addresses, forked=False)


def _train(run):
    return [r for r in run["records"] if "objective/kl" in r]


def test_vllm_workers_one_version_ahead(runs):
    records = _train(runs["ahead"])
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1]
    assert all(r["async/dropped_batches"] == 0 for r in records)
    with open(os.path.join(runs["ahead"]["output_dir"], "config.json")) as f:
        assert json.load(f)["rollout_correction"] == "token_truncate"
    assert runs["ahead"]["max_param_change"]["actor"] > 1e-4


def test_every_vllm_worker_stops_cleanly(runs):
    assert runs["worker_exit_codes"] == [0]
