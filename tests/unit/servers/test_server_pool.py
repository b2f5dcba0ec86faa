"""Requests over several servers (rlhf_engine/servers/pool.py, client.py) against real HTTP servers on this host
(small stdlib servers that answer the generate route as vLLM's does): least outstanding requests, a failed server's
request moved with the same body, nothing answered twice, and a clear stop when no server is up."""
import http.server
import json
import threading
import time

import pytest

from rlhf_engine.servers.client import ServerClient, ServerError
from rlhf_engine.servers.pool import NoServerUp, ServerPool


class Fake(http.server.ThreadingHTTPServer):
    """Answers POST /inference/v1/generate with the request's first token id echoed back, after `delay` s; `status`
    other than 200 answers that instead. Records every body it answered."""

    def __init__(self, status=200, delay=0.0):
        self.status, self.delay, self.bodies, self.lock = status, delay, [], threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.server.delay)
        if self.server.status != 200:
            self.send_response(self.server.status)
            self.end_headers()
            return
        with self.server.lock:
            self.server.bodies.append(body)
        out = json.dumps({"choices": [{"token_ids": body["token_ids"][:1], "weight_versions": [],
                                       "auth": self.headers.get("Authorization")}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def _gen(client, item):
    return client.generate([item], {"seed": item})


def test_requests_spread_by_least_outstanding():
    slow, fast = Fake(delay=0.3), Fake()
    pool = ServerPool([ServerClient(slow.url, "t", 5), ServerClient(fast.url, "t", 5)], max_in_flight=2)
    answers = pool.map(_gen, list(range(8)))
    assert [a["token_ids"] for a in answers] == [[i] for i in range(8)]  # in the items' order
    assert answers[0]["auth"] == "Bearer t"
    # the slow server holds its requests longer, so the fast one takes most: never all on one, never split evenly
    assert 1 <= len(slow.bodies) < 4 and len(slow.bodies) + len(fast.bodies) == 8
    assert pool.moved == 0 and pool.served == [len(slow.bodies), len(fast.bodies)]


def test_a_failing_server_is_marked_down_and_its_requests_move_with_their_seed():
    broken, good = Fake(status=503), Fake()
    pool = ServerPool([ServerClient(broken.url, "", 5), ServerClient(good.url, "", 5)], max_in_flight=4)
    answers = pool.map(_gen, list(range(6)))
    assert [a["token_ids"] for a in answers] == [[i] for i in range(6)]
    assert sorted(b["sampling_params"]["seed"] for b in good.bodies) == list(range(6))  # each once, same seed
    assert 0 in pool.down and "503" in pool.down[0] and pool.moved >= 1
    refused = ServerClient("http://127.0.0.1:1", "", 2)  # nothing listens on port 1
    with pytest.raises(ServerError) as e:
        refused.generate([1], {})
    assert e.value.retriable and e.value.status is None


def test_no_server_up_names_every_server():
    a, b = Fake(status=500), Fake(status=502)
    pool = ServerPool([ServerClient(a.url, "", 5), ServerClient(b.url, "", 5)], max_in_flight=2)
    with pytest.raises(NoServerUp) as e:
        pool.map(_gen, [1])
    assert a.url in str(e.value) and b.url in str(e.value) and "502" in str(e.value)


def test_a_refused_request_is_not_retried_elsewhere():
    bad, good = Fake(status=400), Fake()
    pool = ServerPool([ServerClient(bad.url, "", 5), ServerClient(good.url, "", 5)], max_in_flight=1)
    with pytest.raises(ServerError) as e:
        pool.map(_gen, [1])  # the first pick is server 0 (ties: the least recently chosen)
    assert e.value.status == 400 and not e.value.retriable and good.bodies == [] and pool.down == {}


def _waiting(pool, n=1):
    """Block until `n` requests of `pool` wait for a server (bounded: a pool that never waits fails the test)."""
    for _ in range(500):
        if pool.waiting >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"no request waited for a server: {pool.waiting}")


def test_with_no_server_up_a_request_waits_for_one_marked_up():
    server = Fake(status=503)
    pool = ServerPool([ServerClient(server.url, "", 5)], max_in_flight=2, wait_s=60)
    future = pool.submit(_gen, 7)
    _waiting(pool)  # its first try failed, the only server is down: it waits rather than failing
    assert not future.done() and 0 in pool.down
    server.status = 200  # the server came back; the trainer re-admits it (servers.py: after a push)
    pool.mark_up(0)
    assert future.result(timeout=10)["token_ids"] == [7] and server.bodies[0]["sampling_params"]["seed"] == 7
    assert pool.down == {} and pool.waiting == 0 and pool.served == [1]


def test_no_server_up_for_wait_s_fails_naming_them_and_close_ends_a_wait():
    a = Fake(status=500)
    pool = ServerPool([ServerClient(a.url, "", 5)], max_in_flight=2, wait_s=0.3)
    with pytest.raises(NoServerUp) as e:
        pool.map(_gen, [1])
    assert "for 0.3 s" in str(e.value) and a.url in str(e.value) and "500" in str(e.value)
    # a long wait ended by close (the trainer stopping): the request fails then, not after wait_s
    pool = ServerPool([ServerClient(a.url, "", 5)], max_in_flight=2, wait_s=600)
    future = pool.submit(_gen, 1)
    _waiting(pool)
    pool.close()
    with pytest.raises(NoServerUp):
        future.result(timeout=10)
