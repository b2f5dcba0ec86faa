"""The reference reward server (FastAPI + uvicorn) under load, over real localhost connections: several clients at
once beside one that stalls mid-body, one that stalls in its headers and one oversized request; a bearer token;
a retried request id computed once; reward functions one call at a time unless told otherwise; the warning for an
open address without a token; and the install hint when FastAPI is missing."""
import json
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

from rlhf_engine.rewards import RemoteReward, RewardFunctionError, remote
from rlhf_engine.rewards.serve import make_server

from _support import ROOT, clean_env, closed_within

TOKEN = "serve-bearer-Rk3ZpQ81xW"


def start(fn, **kw):
    server = make_server(fn, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/score"


def stop(server):
    server.shutdown()
    server.server_close()


def answers_of(server):
    return server.server.config.app.state.answers


def raw_socket(port, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)


def lengths_plus_tag(prompts, responses, tag):
    time.sleep(0.05)
    return [len(r) + float(t) for r, t in zip(responses, tag)]


def test_clients_are_answered_beside_a_stalled_one_and_an_oversized_one():
    server, url = start(lengths_plus_tag, max_request_bytes=4096, request_timeout_s=3.0)
    try:
        # stalls mid-body: 1000 bytes announced, 10 sent; and one that stalls in its headers
        body_stall = raw_socket(server.server_port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                                    b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompts\"")
        head_stall = raw_socket(server.server_port, b"POST /score HTTP/1.1\r\nHost: x\r\n")
        results, errors = {}, {}

        def client(i):
            responses = ["x" * (i + j) for j in range(3)]
            try:
                results[i] = RemoteReward(url, timeout_s=10, retries=0)(["p"] * 3, responses, tag=[i * 100] * 3)
            except Exception as e:  # noqa: BLE001  (reported below)
                errors[i] = e

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        t = time.monotonic()
        for th in threads:
            th.start()
        with pytest.raises(RewardFunctionError, match=r"failed after 1 attempt .*HTTP 413.*over this server's "
                                                      r"limit of 4096.*--max_request_mb"):
            RemoteReward(url, timeout_s=10, retries=3)(["p"], ["y" * 5000], tag=[0])
        for th in threads:
            th.join(20)
        took = time.monotonic() - t
        # every client answered with its own scores, in order, while the stalled connections were still open
        assert errors == {} and results == {i: [i * 101.0 + j for j in range(3)] for i in range(8)}
        assert took < 2.8, took  # well before the stalled connections' deadline
        assert answers_of(server).computed == 8
        # the stalled connections are closed at the 3 s deadline (counted from their start)
        assert closed_within(body_stall, 4.0) and closed_within(head_stall, 4.0)
        assert RemoteReward(url, timeout_s=5, retries=0)(["p"], ["ok"], tag=[1]) == [3.0]  # still serving
    finally:
        stop(server)


def test_a_retry_after_a_client_timeout_is_answered_from_the_first_computation():
    calls = []

    def slow(prompts, responses):
        calls.append(len(responses))
        time.sleep(1.0 if prompts[0] == "slow" else 0.0)
        return [float(len(r)) for r in responses]

    server, url = start(slow)
    try:
        # attempts time out at 0.4 s and 0.85 s; the third gets the first computation's answer at 1 s
        assert RemoteReward(url, timeout_s=0.4, retries=3)(["slow", "b"], ["xy", "xyz"]) == [2.0, 3.0]
        assert calls == [2]
        answers = answers_of(server)
        assert answers.computed == 1 and answers.shared >= 1
        # control: a new batch (a new id) is computed, the same id with another body is refused
        assert RemoteReward(url, timeout_s=5, retries=0)(["a"], ["xy"]) == [2.0] and calls == [2, 1]
        req = {"Content-Type": "application/json", "X-Request-Id": "fixed-id"}
        for body, status in ((["q"], 200), (["other"], 409)):
            conn = socket.create_connection(("127.0.0.1", server.server_port), timeout=10)
            data = json.dumps({"prompts": body, "responses": body}).encode()
            head = "".join(f"{k}: {v}\r\n" for k, v in req.items())
            conn.sendall(f"POST /score HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {len(data)}\r\n\r\n".encode()
                         + data)
            assert conn.recv(4096).split(b" ")[1] == str(status).encode()
            conn.close()
    finally:
        stop(server)


@pytest.mark.parametrize("concurrency, overlap", [(1, False), (3, True)])
def test_reward_function_calls_run_one_at_a_time_unless_concurrency_allows_more(concurrency, overlap):
    spans = []

    def timed(prompts, responses):
        t = time.monotonic()
        time.sleep(0.3)
        spans.append((t, time.monotonic()))
        return [0.0] * len(responses)

    server, url = start(timed, concurrency=concurrency)
    try:
        threads = [threading.Thread(target=RemoteReward(url, timeout_s=10, retries=0), args=(["p"], ["r"]))
                   for _ in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
    finally:
        stop(server)
    spans.sort()
    assert len(spans) == 3
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])) == overlap, spans


def test_a_token_is_required_when_set_and_never_logged(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    server, url = start(lambda prompts, responses: [1.0] * len(responses), auth_token=TOKEN)
    try:
        with pytest.raises(RewardFunctionError, match=r"failed after 1 attempt .*HTTP 401.*--reward_auth_token_env"):
            RemoteReward(url, timeout_s=5, retries=2)(["p"], ["r"])
        monkeypatch.setenv("RM_SERVE_WRONG", "not-the-token-123")
        with pytest.raises(RewardFunctionError, match=r"HTTP 401"):
            RemoteReward(url, timeout_s=5, retries=0, auth_token_env="RM_SERVE_WRONG")(["p"], ["r"])
        monkeypatch.setenv("RM_SERVE_RIGHT", TOKEN)
        assert RemoteReward(url, timeout_s=5, retries=0, auth_token_env="RM_SERVE_RIGHT")(["p"], ["r"]) == [1.0]
    finally:
        stop(server)
    assert TOKEN not in caplog.text


def test_the_cli_takes_the_token_from_its_variable_and_never_prints_it(monkeypatch):
    env = clean_env(RM_SERVE_TOKEN_VAR=TOKEN)
    cmd = [sys.executable, "-m", "rlhf_engine.rewards.serve", "--port", "0", "--reward_fn",
           "rlhf_engine.rewards.math_answer:exact_answer"]
    bad = subprocess.run(cmd + ["--auth_token_env", "RM_UNSET_VAR"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--auth_token_env RM_UNSET_VAR: that environment variable is not set" in bad.stderr
    proc = subprocess.Popen(cmd + ["--auth_token_env", "RM_SERVE_TOKEN_VAR", "--host", "0.0.0.0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving "), line + proc.stderr.read()
        url = f"http://127.0.0.1:{line.rsplit(':', 1)[1].strip().rstrip('/')}/score"
        monkeypatch.setenv("RM_CLIENT_VAR", TOKEN)
        fn = RemoteReward(url, timeout_s=10, retries=0, auth_token_env="RM_CLIENT_VAR")
        assert fn(["1 + 1 ="], ["2"], answer=["2"]) == [1.0]
        with pytest.raises(RewardFunctionError, match="HTTP 401"):
            RemoteReward(url, timeout_s=10, retries=0)(["1 + 1 ="], ["2"], answer=["2"])
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    assert TOKEN not in line + out + err and "without --auth_token_env" not in err  # a token: no warning


def test_an_open_address_without_a_token_is_warned_about(caplog):
    fn = lambda prompts, responses: [0.0] * len(responses)  # noqa: E731
    for host, token, warned in (("0.0.0.0", None, True), ("0.0.0.0", TOKEN, False), ("127.0.0.1", None, False),
                                ("localhost", None, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlhf_engine.rewards.serve"):
            make_server(fn, host=host, auth_token=token).server_close()
        assert ("without --auth_token_env" in caplog.text) == warned, (host, token, caplog.text)


def test_without_fastapi_the_trainer_side_imports_and_the_server_names_the_extra():
    code = ("import sys; sys.modules['fastapi'] = sys.modules['uvicorn'] = None\n"
            "import rlhf_engine.rewards, rlhf_engine.rewards.serve as s\n"
            "sys.exit(s.main(['--reward_fn', 'rlhf_engine.rewards.math_answer:exact_answer', '--port', '0']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "pip install 'rlhf_engine[serve]'" in done.stderr, done.stderr
