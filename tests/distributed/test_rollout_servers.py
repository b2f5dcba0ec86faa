"""Rollout servers (`--rollout_servers`, docs/rollout-servers.md): two real `launch/rollout_server.py` processes (stock
vLLM's server with our extension and token) serve every test here, on a tiny Llama whose LM head is tied to its
embedding (SmolLM2's layout: the server repacks the tied head after every push, servers/repack.py).

* 2 trainer ranks and 2 servers at max_staleness 0, lr > 0, 3 iterations: every logged metric equals the colocated
  vllm run's (one engine per rank) within 1e-5 and the rollouts are equal token for token, greedy at ZeRO-2 and
  sampled at ZeRO-3 with a LoRA actor (the seeds of the requests are the colocated engine's, the adapter merged
  into the pushed weights); both servers answered requests.
* Ahead of training: at max_staleness 1 every token is one version old after the first iteration and the rollout
  correction acts (none without it: the negative control); 2-turn episodes are played one version ahead; at 2 with
  partial rollouts the batches run two ahead.
* No route answers without the token; a push lands bitwise and the server then decodes as the pushed weights do; a
  push while a request generates splits its answer by version, each part its own weights' tokens and log-probs;
  the plan refuses a server that cannot serve the run, naming it; a server killed mid-run costs nothing.
Skipped, with the reason, where vLLM is not installed (the trainer's side needs no vLLM; the servers do).
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import types

import pytest
import torch

from _servers import TOKEN_ENV, RolloutServers
from _support import (ROOT, VOLATILE, assert_generated_alike, assert_resumed_exactly, free_address, ppo_args,
                      run_harness)

pytestmark = [pytest.mark.distributed, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here (bash scripts/install.sh --vllm, then "
                                        ".venv-vllm/bin/python -m pytest -m vllm)")]

ATOL = 1e-5
BASE = dict(generation_backend="vllm", do_sample="false", max_steps=3, seed=3, actor_zero_stage=2,
            actor_learning_rate=1e-3, critic_learning_rate=1e-3, per_device_generation_batch_size=4,
            per_device_training_batch_size=2)
# a LoRA actor: the push carries the adapter merged into the plain weights (gathered under ZeRO-3)
SAMPLED = dict(BASE, do_sample="true", actor_zero_stage=3, reference_zero_stage=3, actor_lora_dim=4,
               actor_lora_alpha=8.0)
ENV = dict(BASE, environment="_envs:counting", max_turns=2)  # 2-turn episodes played on the trainer's ranks
AHEAD = dict(BASE, max_staleness=1)  # greedy: the killed-server run must equal it


@pytest.fixture(scope="module")
def servers(tiny_vllm_tied, tmp_path_factory):
    s = RolloutServers(str(tmp_path_factory.mktemp("rollout_servers")), 2, tiny_vllm_tied.actor, secrets.token_hex(16))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def runs(servers, tiny_vllm_tied, tmp_path_factory):
    tmp, tiny = str(tmp_path_factory.mktemp("server_runs")), tiny_vllm_tied
    via = dict(rollout_servers=",".join(servers.urls), rollout_auth_token_env=TOKEN_ENV)
    spec = [{"name": "colocated", "args": ppo_args(tiny, os.path.join(tmp, "colocated"), **BASE)},
            {"name": "servers", "args": ppo_args(tiny, os.path.join(tmp, "servers"), **BASE, **via,
                                                 save_interval=2)},
            # resumed from its checkpoint after 2 iterations, the servers kept alive (holding the later weights)
            {"name": "servers_resumed", "args": ppo_args(tiny, os.path.join(tmp, "servers_resumed"), **BASE,
                                                         **via, resume=os.path.join(tmp, "servers", "checkpoints",
                                                                                    "iter_000002"))},
            {"name": "colocated_sampled", "args": ppo_args(tiny, os.path.join(tmp, "colocated_s"), **SAMPLED)},
            {"name": "servers_sampled", "args": ppo_args(tiny, os.path.join(tmp, "servers_s"), **SAMPLED,
                                                         **via)},
            {"name": "colocated_env", "args": ppo_args(tiny, os.path.join(tmp, "colocated_env"), **ENV)},
            {"name": "servers_env", "args": ppo_args(tiny, os.path.join(tmp, "servers_env"), **ENV, **via)},
            {"name": "env_ahead", "args": ppo_args(tiny, os.path.join(tmp, "env_ahead"),
                                                   **dict(ENV, max_staleness=1), **via)},
            {"name": "ahead", "args": ppo_args(tiny, os.path.join(tmp, "ahead"), **AHEAD, **via)},
            {"name": "ahead_uncorrected", "args": ppo_args(tiny, os.path.join(tmp, "ahead_u"), **AHEAD, **via,
                                                           rollout_correction="none")},
            {"name": "two_ahead", "args": ppo_args(tiny, os.path.join(tmp, "two_ahead"), **dict(
                AHEAD, do_sample="true", max_staleness=2, max_steps=4), partial_rollouts="true", **via)}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TOKEN_ENV, servers.token)  # the ranks' environment (clean_env copies this process's)
        return run_harness(tmp, "rollout_servers", spec, 2, "fork")  # the launcher is not under test here


def _train(run):
    return [r for r in run["records"] if "objective/score" in r]


def test_servers_at_staleness_0_equal_the_colocated_vllm_run(runs):
    assert len(_train(runs["servers"])) == len(_train(runs["colocated"])) == 3
    assert_generated_alike(runs["servers"], runs["colocated"], ATOL)
    assert all(r["servers/up"] == 2 and r["servers/moved_requests"] == 0 for r in _train(runs["servers"]))
    assert all(r["time/weight_sync"] > 0 for r in _train(runs["servers"]))  # a push every iteration (lr > 0)


def test_a_resumed_trainer_pushes_first_and_goes_on_exactly(runs):
    """K = 0: the trainer resumed from the checkpoint after 2 iterations, the servers still holding the straight
    run's last weights: its first push gives them the checkpoint's, and iteration 2 is the straight run's exactly
    (every logged metric but the clocks, every rank's rollout)."""
    straight, resumed = runs["servers"], runs["servers_resumed"]
    assert_resumed_exactly(straight, resumed, 2)


def test_sampled_requests_carry_the_colocated_seeds(runs):
    """Also the colocated engine's own check at ZeRO-3 with a LoRA actor (the adapter merged into the gathered
    weights of every push): its log-probs are the trainer's over 3 iterations at lr > 0 (fp32: about 1e-6)."""
    assert max(r["rollout/logprob_diff_max"] for r in _train(runs["colocated_sampled"])) < 1e-4
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


def test_episodes_through_the_servers_equal_the_colocated_episodes(runs):
    """K = 0 with a 2-turn environment: each turn's requests go to the servers (the episode runner on the trainer's
    ranks, as in the colocated run); every metric and rollout equals the colocated run's, every episode took both
    turns."""
    assert_generated_alike(runs["servers_env"], runs["colocated_env"], ATOL)
    assert all(r["env/turns_mean"] == 2 for r in _train(runs["servers_env"]))


def test_episodes_one_version_ahead(runs):
    """K = 1 with a 2-turn environment: each rank plays iteration k + 1's episodes in a thread while it trains on k.
    Iteration 0 (the first weights, greedy) is the colocated run's token for token; after it every token is one
    version old, no episode met a push between its turns (a push waits for the batch taken), and every episode
    took both turns."""
    records, colocated = _train(runs["env_ahead"]), _train(runs["colocated_env"])
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1]
    assert [r["async/staleness_mean"] for r in records] == [0, 1, 1]
    assert all(r["async/partial_responses"] == 0 and r["async/dropped_batches"] == 0 for r in records)
    assert all(r["env/turns_mean"] == 2 and r["env/errors"] == 0 for r in records)
    for key in ("env/turn1_reward_mean", "env/turn2_reward_mean", "env/observation_tokens_mean"):
        assert records[0][key] == pytest.approx(colocated[0][key], abs=ATOL), key
    for ra, rb in zip(runs["env_ahead"]["ranks"], runs["colocated_env"]["ranks"]):
        assert ra["rollouts"][0] == rb["rollouts"][0]
    assert runs["env_ahead"]["max_param_change"]["actor"] > 1e-4


def test_one_version_ahead_the_correction_acts(runs):
    """max_staleness 1: each batch is generated while the trainer trains on the one before, so every token is one
    version old after the first iteration, and the rollout correction moved its weights from 1 (token_truncate, the
    default ahead of training); the same run without a correction has no weights (the negative control)."""
    records = _train(runs["ahead"])
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1]
    assert all(r["async/dropped_responses"] == 0 and r["async/partial_responses"] == 0 for r in records)
    with open(os.path.join(runs["ahead"]["output_dir"], "config.json")) as f:
        assert json.load(f)["rollout_correction"] == "token_truncate"
    assert records[0]["rollout/correction_weight_dev_max"] < 1e-3  # on-policy: kernel rounding only
    for r in records[1:]:
        assert r["rollout/logprob_diff_max"] > 1e-3 and r["rollout/correction_weight_dev_max"] > 1e-3, r
    uncorrected = _train(runs["ahead_uncorrected"])
    assert [r["async/staleness_max"] for r in uncorrected] == [0, 1, 1]
    assert all(r["rollout/logprob_diff_max"] > 1e-3 for r in uncorrected[1:])
    assert not any("rollout/correction_weight_dev_max" in r for r in uncorrected)


def test_two_versions_ahead(runs):
    """max_staleness 2 with partial rollouts: the batches run two iterations ahead, no token is older than 2
    versions, nothing is dropped."""
    records = _train(runs["two_ahead"])
    assert [r["async/staleness_max"] for r in records] == [0, 1, 2, 2]
    assert all(0 <= r["async/staleness_mean"] <= r["async/staleness_max"] for r in records)
    assert all(r["async/dropped_responses"] == 0 for r in records)
    assert runs["two_ahead"]["max_param_change"]["actor"] > 1e-4


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


def _perturbed(path: str, seed: int = 7):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _push(senders: dict, model, version: int, mode: str = "keep"):
    from rlhf_engine.engine.policy_weights import stream_blocks
    from rlhf_engine.servers.weights import WeightPush

    push = WeightPush(senders, sha256=True, pause_mode=mode)
    push.start()
    for _, values in stream_blocks(model):
        push.block(values)
    push.finish(version)
    assert push.failed == {}  # the receipt's tensors, elements and sha256 equal what was sent


def _hf_logprobs(model, prompt: list, tokens: list, banned: tuple = ()) -> torch.Tensor:
    """Each token's log-prob under `model`, the `banned` ids masked out (what vLLM's processed log-probs are under
    min_tokens: EOS cannot be sampled, so the rest renormalise)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    logits[:, list(banned)] = -torch.inf
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _greedy(model, prompt: list, n: int) -> list:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def test_a_push_lands_bitwise_and_the_server_decodes_with_it(servers, tiny_vllm_tied, runs):
    """After the runs (the push replaces the server's weight group), on a server that a trainer left paused in the
    middle of an update (as a killed one would): perturbed weights pushed with the servers hashing what they
    receive; greedy tokens then equal the perturbed model's, log-probs to kernel rounding, every token stamped with
    the pushed version."""
    from rlhf_engine.servers.client import ServerClient
    from rlhf_engine.servers.weights import connect_senders

    client = ServerClient(servers.urls[0], servers.token, 120)
    model = _perturbed(tiny_vllm_tied.actor)
    client.pause("keep")
    client.start_weight_update()  # the trainer that started this update is gone
    assert client.info()["update_active"] is True
    senders, failed = connect_senders([client], {client.url: client.info()["workers"]}, 120)
    assert failed == {}
    _push(senders, model, 41)
    assert client.weight_version() == "41"
    prompt = [5, 6, 7, 8, 9]
    choice = client.generate(prompt, {"max_tokens": 10, "temperature": 0, "logprobs": 0, "detokenize": False})
    assert choice["weight_versions"] == [{"version": "41", "start": 0, "end": len(choice["token_ids"])}]
    expected = _greedy(model, prompt, 10)
    assert choice["token_ids"] == expected[:len(choice["token_ids"])]
    theirs = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    assert (_hf_logprobs(model, prompt, choice["token_ids"]) - theirs).abs().max().item() < 1e-4


def test_a_push_in_flight_splits_a_response_by_version(servers, tiny_vllm_tied, runs):
    """--partial_rollouts: weights A (version 50) generating a long greedy response when weights B (51) are pushed
    with the pause in keep mode. The answer spans both versions; the tokens before the switch are A's greedy
    continuation and those after are B's continuation of the prompt and A's tokens (the KV cache recomputed with B),
    each token's log-prob the one its own version gives, to kernel rounding."""
    import concurrent.futures
    import time

    from transformers import AutoModelForCausalLM

    from rlhf_engine.engine.generation.servers import answer_row
    from rlhf_engine.servers.client import ServerClient
    from rlhf_engine.servers.weights import connect_senders

    client = ServerClient(servers.urls[0], servers.token, 120)
    a = AutoModelForCausalLM.from_pretrained(tiny_vllm_tied.actor, dtype=torch.float32)
    b = _perturbed(tiny_vllm_tied.actor, seed=11)
    senders, failed = connect_senders([client], {client.url: client.info()["workers"]}, 120)
    assert failed == {}
    _push(senders, a, 50)

    def generated() -> float:
        text = servers.request(client.url, "/metrics")[1]
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total{"))

    prompt, n = [5, 6, 7, 8, 9], 240  # about 1.5 s of decoding on the test machine: the push lands inside it
    before = generated()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.generate, prompt, {"max_tokens": n, "min_tokens": n, "temperature": 0,
                                                       "logprobs": 0, "detokenize": False})
        deadline = time.monotonic() + 60
        while generated() <= before and time.monotonic() < deadline:  # A has sampled some tokens
            time.sleep(0.01)
        _push(senders, b, 51, mode="keep")
        choice = answer.result()
    tokens, logprobs, versions = answer_row(choice)
    j = versions.index(51)
    assert 0 < j < n and versions == [50] * j + [51] * (n - j), choice["weight_versions"]
    assert tokens[:j] == _greedy(a, prompt, j)
    assert tokens[j:] == _greedy(b, prompt + tokens[:j], n - j)
    eos = a.generation_config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)  # banned throughout: min_tokens = max_tokens
    ours = torch.cat([_hf_logprobs(a, prompt, tokens[:j], eos), _hf_logprobs(b, prompt + tokens[:j], tokens[j:], eos)])
    assert (ours - torch.tensor(logprobs)).abs().max().item() < 1e-4


def _cfg(tiny, tmp, **flags):
    from rlhf_engine.cli import parse_args

    return parse_args(ppo_args(tiny, tmp, **BASE, rollout_auth_token_env=TOKEN_ENV, **flags))


@pytest.fixture
def probe(tiny_vllm_tied, servers, tmp_path, monkeypatch):
    """probe_servers in this process (one rank), its errors as text."""
    from transformers import AutoConfig

    from rlhf_engine.engine.generation.servers import probe_servers
    from rlhf_engine.errors import ConfigError

    monkeypatch.setenv(TOKEN_ENV, servers.token)
    config = AutoConfig.from_pretrained(tiny_vllm_tied.actor)

    def run(urls, dtype="fp32", longest=72, **flags):
        cfg = _cfg(tiny_vllm_tied, str(tmp_path), rollout_servers=urls, **flags)
        try:
            run.link = probe_servers(cfg, types.SimpleNamespace(is_main=True), dtype, config, longest)
        except ConfigError as e:
            return str(e)
        return ""
    return run


def test_the_plan_accepts_servers_that_can_serve(probe, servers):
    assert probe(",".join(servers.urls)) == ""
    assert sorted(probe.link.infos) == sorted(servers.urls) and not probe.link.late


def test_a_server_not_up_at_start_is_late_not_refused(probe, servers):
    """One server answers and another does not (nothing listens there yet): the plan goes on, the silent one late
    (the pushes ask it again); with no server answering it refuses, naming them (the control)."""
    nobody = "http://" + free_address()
    assert probe(f"{servers.urls[0]},{nobody}", rollout_timeout_s=1) == ""
    assert list(probe.link.infos) == [servers.urls[0]] and list(probe.link.late) == [nobody]
    message = probe(nobody, rollout_timeout_s=1)
    assert "no server answered" in message and nobody in message, message


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


def _on_first_answer(log: str, act, answers: int = 1) -> "threading.Thread":
    """A started thread that calls `act()` once the server writing `log` has answered `answers` generate requests it
    had not answered before this call; `.done` (an Event) ends the wait."""
    import threading
    import time

    answered = '"POST /inference/v1/generate HTTP/1.1" 200'
    with open(log) as f:
        before = f.read().count(answered)  # earlier tests' requests
    done = threading.Event()

    def watch():
        while not done.is_set():
            with open(log) as f:
                if f.read().count(answered) >= before + answers:
                    act()
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=watch)
    thread.done = done
    thread.start()
    return thread


def _ahead_run(servers, tiny_vllm_tied, tmp_path, name: str, act, watch: int = 1, **flags) -> dict:
    """The run of `runs["ahead"]` through both servers, `act()` called once server `watch` has answered its first
    request."""
    spec = [{"name": name, "args": ppo_args(tiny_vllm_tied, str(tmp_path / name), **AHEAD,
                                            rollout_servers=",".join(servers.urls),
                                            rollout_auth_token_env=TOKEN_ENV, **flags)}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TOKEN_ENV, servers.token)
        watcher = _on_first_answer(servers.logs[watch], act)
        try:
            return run_harness(str(tmp_path), name, spec, 2, "fork")[name]
        finally:
            watcher.done.set()
            watcher.join()


def test_an_environment_failing_on_one_rank_ahead_of_training_stops_every_rank(servers, tiny_vllm_tied, tmp_path):
    """K = 1 with an environment that raises on rank 1 only: rank 1's episodes played ahead fail, and both ranks
    stop together with the environment's error naming the step (rank 0 does not go on to push alone)."""
    from _support import launch

    out = tmp_path / "env_fails"
    args = ppo_args(tiny_vllm_tied, str(out), **dict(ENV, max_staleness=1, environment="_envs:raising_on_rank_one"),
                    rollout_servers=",".join(servers.urls), rollout_auth_token_env=TOKEN_ENV)
    done = launch(os.path.join(ROOT, "launch", "train_ppo.py"), args, 2, "fork", env={TOKEN_ENV: servers.token})
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "environment step 1" in text and "the tool is broken" in text, text[-3000:]
    assert "timed out" not in text.lower(), text[-3000:]  # a rank left alone in a collective would time out


def test_a_server_late_at_start_is_taken_in(servers, tiny_vllm_tied, runs, tmp_path):
    """Server 1 stopped (SIGSTOP) before the trainer starts: the plan finds it silent for --rollout_timeout_s and goes
    on with server 0 alone; server 1 continued once server 0 has answered, and the next push takes it in with the
    current weights. Every metric and rollout equals the run where both served throughout."""
    import signal

    proc = servers.procs[1]

    def answered() -> int:
        with open(servers.logs[1]) as f:
            return f.read().count('"POST /inference/v1/generate HTTP/1.1" 200')

    before = answered()
    proc.send_signal(signal.SIGSTOP)  # before the plan asks: silent at start, whatever the timing after
    try:
        late = _ahead_run(servers, tiny_vllm_tied, tmp_path, "late", lambda: proc.send_signal(signal.SIGCONT), watch=0,
                          rollout_timeout_s=3)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert answered() > before  # taken in: it served this run's later requests
    assert servers.request(servers.urls[1], "/weight_info")[1]["weight_version"] == "2"  # and took every push since
    assert all(r["servers/up"] == 2 for r in _train(late)[1:])
    assert_generated_alike(late, runs["ahead"], ATOL, skip=("servers/",))


def test_a_hung_server_is_left_then_taken_back(servers, tiny_vllm_tied, runs, tmp_path):
    """Server 1 stopped (SIGSTOP) after its first answer, for longer than --rollout_timeout_s, then continued: its
    requests time out and go to server 0 with the same body (or, where it had answered them all, a push finds it
    silent); once it answers again, the next push finds it, gives
    it the current weights on a new weight group and takes it back. Every metric and rollout equals the run where
    both served throughout."""
    import signal
    import threading

    proc, timeout_s = servers.procs[1], 5

    def hang_then_continue():
        proc.send_signal(signal.SIGSTOP)
        threading.Timer(timeout_s + 1.5, proc.send_signal, (signal.SIGCONT,)).start()

    taken_back = _ahead_run(servers, tiny_vllm_tied, tmp_path, "taken_back", hang_then_continue,
                            rollout_timeout_s=timeout_s)
    records = _train(taken_back)
    # left: its requests moved to server 0, or (when it had answered them all before it stopped) a push found it
    # silent and an iteration ended with server 0 alone; then taken back
    left = records[-1]["servers/moved_requests"] >= 1 or any(r["servers/up"] == 1 for r in records)
    assert len(records) == 3 and left and records[-1]["servers/up"] == 2, [
        (r["servers/up"], r["servers/moved_requests"]) for r in records]
    assert_generated_alike(taken_back, runs["ahead"], ATOL, skip=("servers/",))
    assert servers.request(servers.urls[1], "/weight_info")[1]["weight_version"] == "2"  # the last push (iteration 2)


def test_a_killed_server_costs_nothing(servers, tiny_vllm_tied, runs, tmp_path):
    """Next to last in this file (it kills a server the others use): the run of `runs["ahead"]` (max_staleness 1) again,
    server 1 SIGKILLed as soon as it has answered its first request. The run completes, every request of the dead
    server goes to the other with the same body, and every metric and rollout equals the run where both lived
    (nothing lost, nothing trained twice)."""
    import signal

    proc = servers.procs[1]
    killed = _ahead_run(servers, tiny_vllm_tied, tmp_path, "killed", lambda: proc.send_signal(signal.SIGKILL))
    assert proc.wait(timeout=30) == -signal.SIGKILL
    records = _train(killed)
    assert len(records) == 3 and records[-1]["servers/up"] == 1 and records[-1]["servers/moved_requests"] >= 1
    assert_generated_alike(killed, runs["ahead"], ATOL, skip=("servers/",))


def test_with_no_server_up_the_run_waits_then_stops_after_a_checkpoint(servers, tiny_vllm_tied, runs, tmp_path):
    """After the killed server only server 0 is left; a run on it alone (K = 0, greedy, 4 iterations,
    --rollout_timeout_s 6). Server 0 stopped (SIGSTOP) once it has answered iteration 0's 8 requests and one more, and
    continued 7 s later: its requests time out, no server is up, the requests wait, and once it answers again the
    ranks push it the current weights and go on; the iterations across the outage equal the run where it served
    throughout. Then stopped for good once 2 iterations are logged: after 6 s with no server up every rank stops,
    naming it, after a checkpoint of the iterations completed (2 or 3, wherever the stop lands)."""
    import signal
    import threading
    import time

    from _support import launch

    proc, url, timeout_s = servers.procs[0], servers.urls[0], 6
    out = tmp_path / "lost"
    args = ppo_args(tiny_vllm_tied, str(out), **dict(BASE, max_steps=4), rollout_servers=url,
                    rollout_auth_token_env=TOKEN_ENV, rollout_timeout_s=timeout_s)

    def outage():
        proc.send_signal(signal.SIGSTOP)
        threading.Timer(timeout_s + 1, proc.send_signal, (signal.SIGCONT,)).start()

    def stop_after_two_iterations():
        while not done_event.is_set():
            if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2:
                proc.send_signal(signal.SIGSTOP)
                return
            time.sleep(0.05)

    done_event = threading.Event()
    watcher = _on_first_answer(servers.logs[0], outage, answers=9)
    stopper = threading.Thread(target=stop_after_two_iterations)
    stopper.start()
    try:
        done = launch(os.path.join(ROOT, "launch", "train_ppo.py"), args, 2, "fork", env={TOKEN_ENV: servers.token})
    finally:
        watcher.done.set()
        done_event.set()
        watcher.join()
        stopper.join()
        proc.send_signal(signal.SIGKILL)  # the last test here: nothing uses the servers after it
    text = done.stdout + done.stderr
    assert "none is up: requests wait" in text and f"{url} back, with the current weights" in text, text[-3000:]
    assert done.returncode == 1 and f"no rollout server has been up for {timeout_s} s" in text and url in text, (
        text[-3000:])
    with open(out / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "objective/score" in r]
    assert len(records) in (2, 3), len(records)
    assert sorted(os.listdir(out / "checkpoints")) == [f"iter_{len(records):06d}"]
    worst = max(abs(got[k] - want[k]) for got, want in zip(records, _train(runs["servers"]))
                for k in want if isinstance(want[k], (int, float)) and not isinstance(want[k], bool)
                and not k.startswith(VOLATILE + ("servers/",)))
    assert worst <= ATOL, worst  # iteration 1 (across the outage) as where the server served throughout
