"""--reward_url against real HTTP servers on localhost (no mocks): one that fails once then answers, one that always
answers 500, one that hangs, one that returns the wrong count; and the reference server, `python -m
rlhf_engine.rewards.serve`, with a reward function and with a reward model."""
import json
import os
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
    returns (url, calls list, stop)."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append(body)
            behaviour(self, body, len(calls))

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
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
        assert calls == [{"prompts": PROMPTS, "responses": RESPONSES, "columns": {"answer": ["2", "7"]}}]
    finally:
        stop()


def test_a_server_that_fails_once_then_answers_is_retried():
    def flaky(handler, body, n):
        if n == 1:
            return answer(handler, 503, {"error": "warming up"})
        scores_by_length(handler, body, n)

    url, calls, stop = serve(flaky)
    try:
        assert RemoteReward(url, timeout_s=5, retries=2)(PROMPTS, RESPONSES) == [1.0, 15.0]
        assert len(calls) == 2
    finally:
        stop()


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


def _start_reference_server(*args):
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_engine.rewards.serve", "--port", "0", *args], cwd=ROOT,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("serving "), line + proc.stderr.read()
    return proc, line.split(" on ")[-1].strip() + "score"


def test_the_reference_server_scores_with_a_reward_function_and_its_columns():
    proc, url = _start_reference_server("--reward_fn", "rlhf_engine.rewards.math_answer:exact_answer")
    try:
        fn = RemoteReward(url, timeout_s=10, retries=0)
        assert fn(PROMPTS, RESPONSES, answer=["2", "8"], other=["x", "y"]) == [1.0, 1.0]
        assert fn(PROMPTS, RESPONSES, answer=["3", "#### 8"]) == [0.0, 1.0]
        with pytest.raises(RewardFunctionError, match=r"HTTP 400.*needs the columns \['answer'\]"):
            fn(PROMPTS, RESPONSES)
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_reference_server_scores_with_a_reward_model(tiny):
    """The served scores are the reward model's own at the last token of prompt + response."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    proc, url = _start_reference_server("--reward_model", tiny.reward)
    try:
        got = RemoteReward(url, timeout_s=30, retries=0)(PROMPTS, RESPONSES)
    finally:
        proc.terminate()
        proc.wait(10)
    tok = AutoTokenizer.from_pretrained(tiny.reward)
    model = AutoModelForSequenceClassification.from_pretrained(tiny.reward).eval()
    with torch.no_grad():
        want = [float(model(**tok(p + r, return_tensors="pt")).logits[0, 0]) for p, r in zip(PROMPTS, RESPONSES)]
    assert got == pytest.approx(want, abs=1e-5) and got[0] != got[1]
