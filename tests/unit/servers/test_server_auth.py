"""The bearer-token middleware (rlhf_engine/servers/auth.py), driven through the ASGI protocol itself: every HTTP
request without the right token gets 401 before the app runs; the right one passes; lifespan events pass."""
import asyncio

import pytest

from rlhf_engine.servers.auth import BearerToken
from rlhf_engine.servers.protocol import TOKEN_ENV_POINTER


def _call(mw, scope):
    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"] if "path" in scope else scope["type"])

    async def receive():
        return {"type": "http.request"}

    async def send(message):
        sent.append(message)

    mw.app = app
    asyncio.run(mw(scope, receive, send))
    return reached, sent


@pytest.fixture
def mw(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV_POINTER, "MY_TOKEN_VAR")
    monkeypatch.setenv("MY_TOKEN_VAR", "s3cret")
    return BearerToken(None)


def http(path, headers=()):
    return {"type": "http", "path": path, "headers": list(headers)}


@pytest.mark.parametrize("headers", [(), [(b"authorization", b"Bearer wrong")], [(b"authorization", b"Basic s3cret")],
                                     [(b"authorization", b"s3cret")], [(b"x-api-key", b"s3cret")]])
def test_without_the_token_every_route_is_401(mw, headers):
    for path in ("/update_weights", "/pause", "/collective_rpc", "/inference/v1/generate", "/health"):
        reached, sent = _call(mw, http(path, headers))
        assert reached == [] and sent[0]["status"] == 401


def test_the_token_passes(mw):
    for headers in ([(b"authorization", b"Bearer s3cret")], [(b"Authorization", b"bearer  s3cret ")]):
        reached, sent = _call(mw, http("/update_weights", headers))
        assert reached == ["/update_weights"] and sent == []
    assert _call(mw, {"type": "lifespan"})[0] == ["lifespan"]


def test_a_server_without_its_token_refuses_to_start(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV_POINTER, "MY_TOKEN_VAR")
    monkeypatch.delenv("MY_TOKEN_VAR", raising=False)
    with pytest.raises(RuntimeError, match="MY_TOKEN_VAR is empty or unset"):
        BearerToken(None)
    monkeypatch.delenv(TOKEN_ENV_POINTER)
    with pytest.raises(RuntimeError, match=TOKEN_ENV_POINTER):
        BearerToken(None)
