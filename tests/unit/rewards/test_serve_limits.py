"""The reward server's bounds, over real localhost connections: `GET /health` behind the token and saying nothing but
whether it is up and ready; at most `max_concurrent_requests` requests served at once, the next one answered 503 with
Retry-After at once (not queued), and served again once a slot is free; the trainer's client retries the 503."""
import json
import socket
import threading
import time

import pytest

from rlhf_engine.rewards import RemoteReward, remote
from rlhf_engine.rewards.serve import make_server

from _support import closed_within

TOKEN = "limits-bearer-9fQw2LmZ"


def start(fn, **kw):
    """A server serving (its /health answered, with the token when it has one) before the test talks to it."""
    server = make_server(fn, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    deadline = time.monotonic() + 20
    while True:
        try:
            if request(server.server_port, "GET", "/health", token=kw.get("auth_token"), timeout=2)[0] == 200:
                return server
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)


def wait_until(cond, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def stop(server):
    server.shutdown()
    server.server_close()


def request(port, method, path, body=None, token=None, timeout=10.0):
    """(status, headers, parsed JSON body) of one request on a fresh connection."""
    data = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(data)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    if token:
        head += f"Authorization: Bearer {token}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n" + data)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head_raw, _, payload = raw.partition(b"\r\n\r\n")
    lines = head_raw.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(payload) if payload else None


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)


class ModelPath:
    """A scorer named like a reward model with a path, as scorers.ModelScorer is: the name must never be served."""

    __rlhf_spec__ = "reward model /secret/place/of/the/reward_model"

    def score(self, body):
        return [1.0] * len(body["responses"])


@pytest.mark.parametrize("token", [TOKEN, None])
def test_health_is_behind_the_token_and_reveals_nothing(token):
    server = start(ModelPath(), auth_token=token)
    try:
        port = server.server_port
        if token:
            status, headers, body = request(port, "GET", "/health")
            assert status == 401 and headers.get("www-authenticate") == "Bearer", (status, body)
            assert request(port, "GET", "/health", token="wrong-token")[0] == 401
        status, _, body = request(port, "GET", "/health", token=token)
        assert status == 200 and body == {"ok": True, "ready": True}
        assert request(port, "POST", "/score", {"prompts": ["p"], "responses": ["r"]}, token=token)[2] == \
            {"scores": [1.0]}
    finally:
        stop(server)


def test_past_the_limit_a_request_is_refused_at_once_and_served_once_a_slot_frees():
    limit = 32
    release, started = threading.Event(), []

    def blocked(prompts, responses):
        started.append(1)
        release.wait(30)
        return [float(len(r)) for r in responses]

    # concurrency 32: every admitted request's function call runs, so all 32 hold their slot at once
    server = start(blocked, max_concurrent_requests=limit, concurrency=limit)
    port = server.server_port
    answers = [None] * limit
    try:
        def client(i):
            answers[i] = request(port, "POST", "/score", {"prompts": ["p"], "responses": ["x" * i]}, timeout=40)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(limit)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(started) < limit and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(started) == limit
        assert request(port, "GET", "/health")[2] == {"ok": True, "ready": False}
        t0 = time.monotonic()
        status, headers, body = request(port, "POST", "/score", {"prompts": ["p"], "responses": ["late"]})
        assert time.monotonic() - t0 < 2.0  # answered, not queued behind the 32
        assert status == 503 and headers["retry-after"] == "1", body
        assert "--max_concurrent_requests" in body["error"] and len(started) == limit  # never scored
        release.set()
        for t in threads:
            t.join(30)
        assert [a[:1] + (a[2],) for a in answers] == [(200, {"scores": [float(i)]}) for i in range(limit)]
        assert request(port, "GET", "/health")[2] == {"ok": True, "ready": True}
        assert request(port, "POST", "/score", {"prompts": ["p"], "responses": ["late"]})[2] == {"scores": [4.0]}
    finally:
        release.set()
        stop(server)


def test_the_trainer_s_client_retries_a_503_until_a_slot_frees():
    release = threading.Event()

    def blocked(prompts, responses):
        if prompts[0] == "hold":
            release.wait(30)
        return [float(len(r)) for r in responses]

    server = start(blocked, max_concurrent_requests=1)
    url = f"http://127.0.0.1:{server.server_port}/score"
    try:
        slots = server.server.config.app.state.slots
        holder = threading.Thread(target=RemoteReward(url, timeout_s=30, retries=0), args=(["hold"], ["a"]))
        holder.start()
        wait_until(lambda: slots.active == 1)  # the one slot is taken
        # the slot frees once the client has been refused, while it backs off
        threading.Thread(target=lambda: (wait_until(lambda: slots.refused >= 1), release.set()), daemon=True).start()
        assert RemoteReward(url, timeout_s=10, retries=6)(["p"], ["xyz"]) == [3.0]
        holder.join(10)
        assert slots.refused >= 1
    finally:
        release.set()
        stop(server)


def test_a_keep_alive_request_is_not_closed_by_the_deadline_of_an_earlier_one():
    """Deadline 3 s, times from A's answer (t=0, A's deadline armed then: t=3). On one keep-alive connection B is
    answered at t=1 (armed again: t=4); C starts at t=1.5 and finishes its body at t=3.5: within its own deadline,
    though past A's. The stale timer of A must not close C's connection (half a second of margin each side)."""
    server = start(lambda prompts, responses: [float(len(r)) for r in responses], request_timeout_s=3.0)

    def req(body: bytes) -> bytes:
        return (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

    def answer(s: socket.socket) -> bytes:
        raw = b""
        while b"}" not in raw:
            chunk = s.recv(4096)
            assert chunk, "the server closed the keep-alive connection"
            raw += chunk
        return raw

    body = json.dumps({"prompts": ["p"], "responses": ["abc"]}).encode()
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as s:
            s.sendall(req(body))
            assert b" 200 " in answer(s)
            t0 = time.monotonic()
            until = lambda t: time.sleep(max(0.0, t - (time.monotonic() - t0)))  # noqa: E731
            until(1.0)
            s.sendall(req(body))
            assert b" 200 " in answer(s)
            b_answered = time.monotonic() - t0
            until(1.5)
            whole = req(body)
            s.sendall(whole[:-5])
            until(3.5)
            assert time.monotonic() - t0 < b_answered + 3.0  # still within C's own deadline
            s.sendall(whole[-5:])
            raw = answer(s)
            assert b" 200 " in raw and raw.endswith(b'{"scores":[3.0]}')
            # control: a request that stalls past its own deadline is closed
            s.sendall(whole[:-5])
            assert closed_within(s, 5.0)
    finally:
        stop(server)



def test_the_retried_answers_are_bounded_by_keep_answers():
    """The cache of answers kept for retries holds the last `keep_answers` request ids: an older id is computed again,
    a recent one is not."""
    import asyncio

    from rlhf_engine.rewards.serve_app import Answers

    async def run():
        answers, calls = Answers(keep=2), []

        async def compute(tag):
            calls.append(tag)
            return tag

        for rid in ("a", "b", "c"):
            assert await answers.get(rid, "digest-" + rid, lambda r=rid: compute(r)) == rid
        assert await answers.get("c", "digest-c", lambda: compute("c again")) == "c"  # kept: shared
        assert await answers.get("a", "digest-a", lambda: compute("a again")) == "a again"  # forgotten: computed
        return answers, calls

    answers, calls = asyncio.run(run())
    assert calls == ["a", "b", "c", "a again"] and len(answers.entries) == 2 and answers.shared == 1
