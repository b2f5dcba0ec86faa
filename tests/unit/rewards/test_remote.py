"""--reward_url's client against real HTTP servers on localhost (no mocks): one that fails once then answers, one that
always answers 500, one that hangs, one that trickles its answer a byte a second, one that breaks its answer off, one
that returns the wrong count; and the reference server, `python -m rlhf_engine.rewards.serve`, with a reward function.
That the served reward model scores as the reward engine does: test_served_reward_model.py."""
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_engine.rewards import RemoteReward, RewardFunctionError, call_reward_fn
from rlhf_engine.rewards import remote

from _support import ROOT, clean_env

PROMPTS, RESPONSES = ["1 + 1 =", "2 + 5 ="], ["2", "the answer is 8"]


def serve(behaviour):
    """A server on a free localhost port whose POST handler is `behaviour(handler, request_json, call_number)`;
    returns (url, calls list of (body, headers), stop)."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append((body, dict(self.headers)))
            try:
                behaviour(self, body, len(calls))
            except (BrokenPipeError, ConnectionResetError):  # the client gave up: what these tests provoke
                pass

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop():
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{server.server_port}/score", calls, stop


def answer(handler, code, obj):
    data = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def scores_by_length(handler, body, n):
    answer(handler, 200, {"scores": [float(len(r)) for r in body["responses"]]})


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)


def test_the_request_carries_prompts_responses_and_columns_and_the_scores_come_back_in_order():
    url, calls, stop = serve(scores_by_length)
    try:
        fn = RemoteReward(url, timeout_s=5, retries=0)
        assert call_reward_fn(fn, PROMPTS, RESPONSES, {"answer": ["2", "7"]}) == [1.0, 15.0]
        want = {"prompts": PROMPTS, "responses": RESPONSES, "columns": {"answer": ["2", "7"]}}
        assert [c[0] for c in calls] == [want]
        assert "Authorization" not in calls[0][1]
    finally:
        stop()


def test_a_server_that_fails_once_then_answers_is_retried_under_the_same_request_id():
    def flaky(handler, body, n):
        if n == 1:
            return answer(handler, 503, {"error": "warming up"})
        scores_by_length(handler, body, n)

    url, calls, stop = serve(flaky)
    try:
        fn = RemoteReward(url, timeout_s=5, retries=2)
        assert fn(PROMPTS, RESPONSES) == [1.0, 15.0]
        assert fn(PROMPTS, RESPONSES) == [1.0, 15.0]
        ids = [headers["X-Request-Id"] for _, headers in calls]
        # the retry is the same batch (one id, so a server can answer it from the first computation); a new batch
        # is another id
        assert len(ids) == 3 and ids[0] == ids[1] != ids[2] and len(ids[0]) == 32
    finally:
        stop()


def _busy_then_scores(header_value, seen):
    """A server that answers 503 with `Retry-After: header_value` once, then scores; `seen` gets each arrival time."""
    def behaviour(handler, body, n):
        seen.append(time.monotonic())
        if n == 1:
            data = b'{"error": "busy"}'
            handler.send_response(503)
            handler.send_header("Retry-After", header_value)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            return handler.wfile.write(data)
        scores_by_length(handler, body, n)
    return behaviour


@pytest.mark.parametrize("form", ["seconds", "http date"])
def test_a_503_s_retry_after_is_waited_for_before_the_retry(form):
    """The retry comes after the server's Retry-After (1.5 s; the backoff here is 0.05 s), given in seconds or as an
    HTTP date. Before, the client ignored it and came back after its own backoff."""
    import email.utils

    seen = []
    value = "1.5" if form == "seconds" else email.utils.formatdate(time.time() + 2.5, usegmt=True)  # whole seconds
    url, calls, stop = serve(_busy_then_scores(value, seen))
    try:
        assert RemoteReward(url, timeout_s=5, retries=1)(PROMPTS, RESPONSES) == [1.0, 15.0]
        assert len(seen) == 2 and seen[1] - seen[0] >= 1.4
    finally:
        stop()


def test_a_retry_after_past_the_cap_waits_the_cap(monkeypatch):
    monkeypatch.setattr(remote, "MAX_RETRY_AFTER_S", 0.3)
    seen = []
    url, calls, stop = serve(_busy_then_scores("3600", seen))
    try:
        assert RemoteReward(url, timeout_s=5, retries=1)(PROMPTS, RESPONSES) == [1.0, 15.0]
        assert 0.25 <= seen[1] - seen[0] < 30
    finally:
        stop()


@pytest.mark.parametrize("value, seconds", [("", 0.0), ("2", 2.0), ("0.5", 0.5), ("-3", 0.0), ("soon", 0.0),
                                            ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)])
def test_retry_after_values(value, seconds):
    assert remote.retry_after(value) == seconds


def test_a_server_that_answers_500_stops_after_the_retries_naming_url_and_status():
    url, calls, stop = serve(lambda h, b, n: answer(h, 500, {"error": "reward model crashed"}))
    try:
        with pytest.raises(RewardFunctionError, match=rf"reward server {url} failed after 3 attempts "
                                                      r"\(--reward_retries 2.*last: HTTP 500 .*reward model crashed"):
            RemoteReward(url, timeout_s=5, retries=2)(PROMPTS, RESPONSES)
        assert len(calls) == 3
    finally:
        stop()


def test_a_400_is_not_retried():
    url, calls, stop = serve(lambda h, b, n: answer(h, 400, {"error": "needs the column answer"}))
    try:
        with pytest.raises(RewardFunctionError, match=r"failed after 1 attempt .*HTTP 400.*needs the column answer"):
            RemoteReward(url, timeout_s=5, retries=3)(PROMPTS, RESPONSES)
        assert len(calls) == 1
    finally:
        stop()


def test_a_server_that_hangs_times_out_on_every_attempt():
    url, calls, stop = serve(lambda h, b, n: time.sleep(30))
    try:
        t = time.monotonic()
        with pytest.raises(RewardFunctionError, match=r"failed after 2 attempts .*last: no answer within 0.5 s"):
            RemoteReward(url, timeout_s=0.5, retries=1)(PROMPTS, RESPONSES)
        assert time.monotonic() - t < 5 and len(calls) == 2
    finally:
        stop()


def _trickle(head_first: bool):
    """A handler that sends its (valid) answer one byte a second: the body after the head, or the head itself."""
    def behaviour(handler, body, n):
        data = json.dumps({"scores": [1.0] * len(body["responses"])}).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        if head_first:
            handler.wfile.write(head)
            handler.wfile.flush()
        trickled = data if head_first else head + data
        for i in range(len(trickled)):
            handler.wfile.write(trickled[i:i + 1])
            handler.wfile.flush()
            time.sleep(1.0)
    return behaviour


@pytest.mark.parametrize("head_first, retries", [(True, 1), (False, 0)])
def test_a_server_that_trickles_its_answer_a_byte_a_second_is_cut_at_the_deadline(head_first, retries):
    """Each read gets a byte within 1 s, under the 1.5 s socket timeout: only a deadline for the whole attempt ends
    it (the answer would take ~18 s)."""
    url, calls, stop = serve(_trickle(head_first))
    try:
        t = time.monotonic()
        with pytest.raises(RewardFunctionError, match=rf"reward server {url} failed after {retries + 1} attempt.*"
                                                      r"last: no answer within 1.5 s"):
            RemoteReward(url, timeout_s=1.5, retries=retries)(PROMPTS, RESPONSES)
        took = time.monotonic() - t
        assert 1.5 * (retries + 1) - 0.1 < took < 1.5 * (retries + 1) + 1.5, took
        assert len(calls) == retries + 1
    finally:
        stop()


def _broken(handler, body, n, always=True):
    if n == 1 or always:  # announces 100 bytes, sends 10, hangs up
        handler.send_response(200)
        handler.send_header("Content-Length", "100")
        handler.end_headers()
        handler.wfile.write(b'{"scores":')
        handler.wfile.flush()
        handler.connection.shutdown(socket.SHUT_RDWR)
        return
    scores_by_length(handler, body, n)


def test_an_answer_broken_off_is_retried():
    url, calls, stop = serve(lambda h, b, n: _broken(h, b, n, always=False))
    try:
        assert RemoteReward(url, timeout_s=5, retries=1)(PROMPTS, RESPONSES) == [1.0, 15.0]
        assert len(calls) == 2
    finally:
        stop()


@pytest.mark.parametrize("behaviour, name", [(_broken, "IncompleteRead"),
                                             (lambda h, b, n: h.connection.shutdown(socket.SHUT_RDWR),
                                              "RemoteDisconnected")])
def test_broken_answers_stop_after_the_retries_naming_server_and_error(behaviour, name):
    url, calls, stop = serve(behaviour)
    try:
        with pytest.raises(RewardFunctionError, match=rf"reward server {url} failed after 2 attempts .*last: broken "
                                                      rf"answer \({name}"):
            RemoteReward(url, timeout_s=5, retries=1)(PROMPTS, RESPONSES)
        assert len(calls) == 2
    finally:
        stop()


def test_nobody_listening_is_a_connection_error():
    url, _, stop = serve(scores_by_length)
    stop()  # the port is closed now
    with pytest.raises(RewardFunctionError, match=r"failed after 2 attempts .*last: connection failed"):
        RemoteReward(url, timeout_s=1, retries=1)(PROMPTS, RESPONSES)


@pytest.mark.parametrize("scores, message", [([1.0], r"returned 1 scores for 2 responses"),
                                             ([1.0, "NaN"], r"returned non-finite scores for responses \[1\]"),
                                             (None, r"answered without a 'scores' list")])
def test_a_wrong_answer_is_an_error_naming_the_server(scores, message):
    url, _, stop = serve(lambda h, b, n: answer(h, 200, {"scores": scores} if scores is not None else {"x": 1}))
    try:
        with pytest.raises(RewardFunctionError, match=rf"reward server {url} " + message):
            RemoteReward(url, timeout_s=5, retries=0)(PROMPTS, RESPONSES)
    finally:
        stop()


def test_the_bearer_token_is_sent_from_its_variable_and_shown_nowhere(monkeypatch):
    token = "rm-bearer-7Hq2xY9pL4"
    url, calls, stop = serve(lambda h, b, n: answer(h, 401, {"error": "wrong token"}))
    try:
        with pytest.raises(ValueError, match=r"reward_auth_token_env = 'RM_BEARER_T': the environment variable is "
                                             r"not set"):
            RemoteReward(url, auth_token_env="RM_BEARER_T")
        monkeypatch.setenv("RM_BEARER_T", token)
        fn = RemoteReward(url, timeout_s=5, retries=2, auth_token_env="RM_BEARER_T")
        with pytest.raises(RewardFunctionError, match=r"failed after 1 attempt .*HTTP 401") as e:
            fn(PROMPTS, RESPONSES)
        assert calls[0][1]["Authorization"] == f"Bearer {token}"
        assert token not in str(e.value) and token not in repr(fn)
    finally:
        stop()


def test_the_reference_server_scores_with_a_reward_function_and_its_columns():
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_engine.rewards.serve", "--port", "0", "--reward_fn",
                             "rlhf_engine.rewards.math_answer:exact_answer"], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving "), line + proc.stderr.read()
        fn = RemoteReward(line.split(" on ")[-1].strip() + "score", timeout_s=10, retries=0)
        assert fn(PROMPTS, RESPONSES, answer=["2", "8"], other=["x", "y"]) == [1.0, 1.0]
        assert fn(PROMPTS, RESPONSES, answer=["3", "#### 8"]) == [0.0, 1.0]
        with pytest.raises(RewardFunctionError, match=r"HTTP 400.*needs the columns \['answer'\]"):
            fn(PROMPTS, RESPONSES)
    finally:
        proc.terminate()
        proc.wait(10)
