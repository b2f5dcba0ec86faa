"""Rollout servers (`--rollout_servers`, docs/rollout-servers.md): two real `launch/rollout_server.py` processes (stock
vLLM's server with our extension and token) serve every test here.

* 2 trainer ranks and 2 servers at max_staleness 0, lr > 0, 3 iterations: every logged metric equals the colocated
  vllm run's (one engine per rank) within 1e-5 and the rollouts are equal token for token, greedy at ZeRO-2 and
  sampled at ZeRO-3 (the seeds of the requests are the colocated engine's); both servers answered requests.
* No route answers without the token; a push lands bitwise and the server then decodes as the pushed weights do;
  the plan refuses a server that cannot serve the run, naming it.
Skipped, with the reason, where vLLM is not installed (the trainer's side needs no vLLM; the servers do).
"""
from __future__ import annotations

import importlib.util
import os
import secrets
import types

import pytest
import torch

from _servers import TOKEN_ENV, RolloutServers
from _support import assert_generated_alike, free_address, ppo_args, run_harness

pytestmark = [pytest.mark.distributed, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here (bash scripts/install.sh --vllm, then "
                                        ".venv-vllm/bin/python -m pytest -m vllm)")]

ATOL = 1e-5
BASE = dict(generation_backend="vllm", do_sample="false", max_steps=3, seed=3, actor_zero_stage=2,
            actor_learning_rate=1e-3, critic_learning_rate=1e-3, per_device_generation_batch_size=4,
            per_device_training_batch_size=2)
SAMPLED = dict(BASE, do_sample="true", actor_zero_stage=3, reference_zero_stage=3)


@pytest.fixture(scope="module")
def servers(tiny_vllm, tmp_path_factory):
    s = RolloutServers(str(tmp_path_factory.mktemp("rollout_servers")), 2, tiny_vllm.actor, secrets.token_hex(16))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def runs(servers, tiny_vllm, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("server_runs"))
    via = dict(rollout_servers=",".join(servers.urls), rollout_auth_token_env=TOKEN_ENV)
    spec = [{"name": "colocated", "args": ppo_args(tiny_vllm, os.path.join(tmp, "colocated"), **BASE)},
            {"name": "servers", "args": ppo_args(tiny_vllm, os.path.join(tmp, "servers"), **BASE, **via)},
            {"name": "colocated_sampled", "args": ppo_args(tiny_vllm, os.path.join(tmp, "colocated_s"), **SAMPLED)},
            {"name": "servers_sampled", "args": ppo_args(tiny_vllm, os.path.join(tmp, "servers_s"), **SAMPLED,
                                                         **via)}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TOKEN_ENV, servers.token)  # the ranks' environment (clean_env copies this process's)
        return run_harness(tmp, "rollout_servers", spec, 2, "torchrun")


def _train(run):
    return [r for r in run["records"] if "objective/kl" in r]


def test_servers_at_staleness_0_equal_the_colocated_vllm_run(runs):
    assert len(_train(runs["servers"])) == len(_train(runs["colocated"])) == 3
    assert_generated_alike(runs["servers"], runs["colocated"], ATOL)
    assert all(r["servers/up"] == 2 and r["servers/moved_requests"] == 0 for r in _train(runs["servers"]))
    assert all(r["time/weight_sync"] > 0 for r in _train(runs["servers"]))  # a push every iteration (lr > 0)


def test_sampled_requests_carry_the_colocated_seeds(runs):
    assert_generated_alike(runs["servers_sampled"], runs["colocated_sampled"], ATOL)
    # sampling really happened: the sampled rollouts are not the greedy ones
    assert runs["servers_sampled"]["ranks"][0]["rollouts"] != runs["servers"]["ranks"][0]["rollouts"]


def test_both_servers_answered_requests(runs, servers):
    for url in servers.urls:
        status, text = servers.request(url, "/metrics")
        assert status == 200
        done = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{"))
        assert done > 0, url


@pytest.mark.parametrize("path,body", [("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {
    "max_tokens": 2, "temperature": 0}}), ("/update_weights", {"update_info": {}}), ("/pause", None),
    ("/collective_rpc", {"method": "rlhf_server_info"}), ("/v1/models", None)])
def test_no_route_answers_without_the_token(servers, path, body):
    url = servers.urls[0]
    method = "GET" if path == "/v1/models" else "POST"
    assert servers.request(url, path, body, token="", method=method)[0] == 401
    assert servers.request(url, path, body, token="not-" + servers.token, method=method)[0] == 401


def test_the_token_opens_every_route(servers):
    url = servers.urls[1]
    assert servers.request(url, "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 2, "temperature": 0}})[0] == 200
    assert servers.request(url, "/collective_rpc", {"method": "rlhf_server_info"})[0] == 200
    assert servers.request(url, "/pause?mode=keep", method="POST")[0] == 200
    assert servers.request(url, "/resume", method="POST")[0] == 200
    # past the token: vLLM's own answer (no update was started), not the middleware's
    status, answer = servers.request(url, "/update_weights", {"update_info": {}})
    assert status == 500 and "start_weight_update" in str(answer)


def test_a_push_lands_bitwise_and_the_server_decodes_with_it(servers, tiny_vllm, runs):
    """After the runs (the push replaces the server's weight group): perturbed weights pushed with the servers
    hashing what they receive; greedy tokens then equal the perturbed model's, log-probs to kernel rounding, every
    token stamped with the pushed version."""
    from transformers import AutoModelForCausalLM

    from rlhf_engine.engine.policy_weights import stream_blocks
    from rlhf_engine.servers.client import ServerClient
    from rlhf_engine.servers.weights import WeightPush, connect_senders

    client = ServerClient(servers.urls[0], servers.token, 120)
    model = AutoModelForCausalLM.from_pretrained(tiny_vllm.actor, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    senders, failed = connect_senders([client], {client.url: client.info()["workers"]}, 120)
    assert failed == {}
    push = WeightPush(senders, sha256=True)
    push.start()
    for _, values in stream_blocks(model):
        push.block(values)
    push.finish(41)
    assert push.failed == {}  # the receipt's tensors, elements and sha256 equal what was sent
    assert client.weight_version() == "41"
    prompt = [5, 6, 7, 8, 9]
    choice = client.generate(prompt, {"max_tokens": 10, "temperature": 0, "logprobs": 0, "detokenize": False})
    assert choice["weight_versions"] == [{"version": "41", "start": 0, "end": len(choice["token_ids"])}]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert choice["token_ids"] == expected[:len(choice["token_ids"])]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + choice["token_ids"]])).logits[0, len(prompt) - 1:-1]
    ours = torch.log_softmax(logits, -1).gather(1, torch.tensor(choice["token_ids"])[:, None])[:, 0]
    theirs = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    assert (ours - theirs).abs().max().item() < 1e-4


def _cfg(tiny, tmp, **flags):
    from rlhf_engine.cli import parse_args

    return parse_args(ppo_args(tiny, tmp, **BASE, rollout_auth_token_env=TOKEN_ENV, **flags))


@pytest.fixture
def probe(tiny_vllm, servers, tmp_path, monkeypatch):
    """probe_servers in this process (one rank), its errors as text."""
    from transformers import AutoConfig

    from rlhf_engine.engine.generation.servers import probe_servers
    from rlhf_engine.errors import ConfigError

    monkeypatch.setenv(TOKEN_ENV, servers.token)
    config = AutoConfig.from_pretrained(tiny_vllm.actor)

    def run(urls, dtype="fp32", longest=72, **flags):
        cfg = _cfg(tiny_vllm, str(tmp_path), rollout_servers=urls, **flags)
        try:
            probe_servers(cfg, types.SimpleNamespace(is_main=True), dtype, config, longest)
        except ConfigError as e:
            return str(e)
        return ""
    return run


def test_the_plan_accepts_servers_that_can_serve(probe, servers):
    assert probe(",".join(servers.urls)) == ""


@pytest.mark.parametrize("case,expect", [
    ("too_short", "--max_model_len 300"), ("dtype", "--dtype bfloat16"), ("token", "401"),
    ("nobody", "rollout_server.py")])
def test_the_plan_refuses_a_server_naming_it(probe, servers, monkeypatch, case, expect):
    url = servers.urls[1]
    if case == "too_short":
        message = probe(url, longest=300)
    elif case == "dtype":
        message = probe(url, dtype="bf16")
    elif case == "token":
        monkeypatch.setenv(TOKEN_ENV, "wrong")
        message = probe(url)
    else:
        url = "http://" + free_address()  # nothing listens there
        message = probe(url, rollout_timeout_s=1)
    assert url in message and expect in message, message
