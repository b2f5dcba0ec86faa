"""The bearer-token check on every route of a rollout server (`--middleware rlhf_engine.servers.auth.BearerToken`).

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere: its weight-update, pause and /collective_rpc
routes (VLLM_SERVER_DEV_MODE) would be open to anyone who reaches the port. This ASGI middleware is added outermost,
so it answers every HTTP request that lacks `Authorization: Bearer <token>` with 401 before any route runs. The
token is read once from the variable that RLHF_ROLLOUT_AUTH_TOKEN_ENV names (launch/rollout_server.py
--auth_token_env sets both); a server started with the middleware and no token refuses to start.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os

from .protocol import TOKEN_ENV_POINTER


def configured_token() -> bytes:
    """The token's bytes from the environment; a RuntimeError naming the variable when it is missing or empty."""
    name = os.environ.get(TOKEN_ENV_POINTER, "")
    if not name:
        raise RuntimeError(f"{TOKEN_ENV_POINTER} is not set: it names the variable that holds the rollout server's "
                           "bearer token (launch/rollout_server.py --auth_token_env NAME sets it)")
    token = os.environ.get(name, "")
    if not token:
        raise RuntimeError(f"the rollout server's bearer token variable {name} is empty or unset")
    return token.encode()


class BearerToken:
    """Pure ASGI middleware: HTTP and websocket requests pass only with the right bearer token (compared in constant
    time); lifespan events pass."""

    def __init__(self, app):
        self.app = app
        self.digest = hashlib.sha256(configured_token()).digest()

    def allowed(self, headers) -> bool:
        for key, value in headers:
            if key.lower() == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    hashlib.sha256(given.strip()).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.allowed(scope.get("headers") or []):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: this rollout server needs Authorization: Bearer <token>"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
