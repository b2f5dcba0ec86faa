"""The reference reward server's application (FastAPI): one POST route scoring a batch, with a bearer token, a body
size limit and answers shared by the retries of one request id. serve.py runs it under uvicorn.

Per request, in order: the token (401 without the right one), the body (413 past `max_body_bytes`; an oversized or
unauthorised body is read and dropped, never kept, so the client gets the answer rather than a reset connection),
the JSON (400), then the score, computed on a worker thread so that the event loop keeps serving other clients.
A request id (`X-Request-Id`) seen before with the same body is answered from that first computation: awaited while
it runs, or its answer while it is among the last `keep_answers`; the same id with another body is a 409. A failed
computation is forgotten, so a retry computes again.
"""
import asyncio  # no `from __future__ import annotations`: FastAPI reads the route's annotations at run time
import hashlib
import hmac
import importlib
import json
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Optional

from .scorers import BadRequest

log = logging.getLogger("rlhf_engine.rewards.serve")
INSTALL = "pip install 'rlhf_engine[serve]'"


def require(module: str) -> Any:
    """Import one of the server's libraries, or say how to install them (the trainer side never needs them)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the reward server needs FastAPI and uvicorn ({e}): {INSTALL}") from e


class Conflict(Exception):
    """A request id reused for another body."""


class Answers:
    """The computations of recent request ids (module docstring); lives on the event loop's thread."""

    def __init__(self, keep: int = 1024):
        self.keep = keep
        self.entries: OrderedDict[str, tuple[str, asyncio.Future]] = OrderedDict()
        self.computed = 0  # computations started
        self.shared = 0  # requests answered from another request's computation

    async def get(self, request_id: Optional[str], digest: str, compute: Callable[[], Awaitable]) -> Any:
        if not request_id:
            self.computed += 1
            return await compute()
        entry = self.entries.get(request_id)
        if entry is not None:
            if entry[0] != digest:
                raise Conflict(f"request id {request_id} was used before for another body; send a new id per batch")
            self.shared += 1
            self.entries.move_to_end(request_id)
            return await asyncio.shield(entry[1])
        task = asyncio.ensure_future(compute())  # a task: a client that hangs up does not cancel it for its retry
        self.computed += 1
        self.entries[request_id] = (digest, task)
        task.add_done_callback(lambda t: self._forget_if_failed(request_id, t))
        while len(self.entries) > self.keep:
            self.entries.popitem(last=False)
        return await asyncio.shield(task)

    def _forget_if_failed(self, request_id: str, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is not None:
            if self.entries.get(request_id, (None, None))[1] is task:
                del self.entries[request_id]


def authorized(header: Optional[str], token: str) -> bool:
    """Whether an Authorization header carries the bearer token (compared in constant time)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def read_body(request: Any, limit: int, keep: bool) -> tuple[Optional[bytes], int]:
    """(the body, or None when it is over `limit` or not kept; its size). Read to the end either way."""
    declared = request.headers.get("content-length", "")
    keep = keep and not (declared.isdigit() and int(declared) > limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if keep and size > limit:
            keep, chunks = False, []
        if keep:
            chunks.append(chunk)
    return (b"".join(chunks) if keep else None), size


def build_app(scorer: Any, auth_token: Optional[str] = None, max_body_bytes: int = 64 << 20,
              keep_answers: int = 1024, threads: int = 8) -> Any:
    """The FastAPI app scoring with `scorer` (scorers.py: `score(body) -> [float]`)."""
    fastapi = require("fastapi")
    from fastapi.responses import JSONResponse
    from starlette.requests import ClientDisconnect

    app = fastapi.FastAPI(title="rlhf_engine reward server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.answers = answers = Answers(keep_answers)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward-score")
    name = getattr(scorer, "__rlhf_spec__", type(scorer).__name__)

    def error(code: int, message: str, **headers: str) -> Any:
        return JSONResponse({"error": message}, status_code=code, headers=headers or None)

    @app.get("/health")
    async def health():
        return {"ok": True, "scorer": name, "computed": answers.computed, "shared": answers.shared}

    @app.post("/{path:path}")
    async def score(request: fastapi.Request, path: str):
        allowed = auth_token is None or authorized(request.headers.get("authorization"), auth_token)
        try:
            raw, size = await read_body(request, max_body_bytes, keep=allowed)
        except ClientDisconnect:  # gone (or cut off by the connection deadline): nobody to answer
            return error(400, "the client disconnected mid-request")
        if not allowed:
            return error(401, "this reward server needs a bearer token: give the trainer --reward_auth_token_env "
                              "NAME, with the server's token in that variable", **{"WWW-Authenticate": "Bearer"})
        if raw is None:
            return error(413, f"the request body has {size} bytes, over this server's limit of {max_body_bytes} "
                              "(--max_request_mb): send smaller batches per rank, or raise the limit")
        try:
            body = json.loads(raw)
        except ValueError as e:
            return error(400, f"the body is not JSON: {e}")
        loop = asyncio.get_running_loop()
        try:
            scores = await answers.get(request.headers.get("x-request-id"), hashlib.sha256(raw).hexdigest(),
                                       lambda: loop.run_in_executor(pool, scorer.score, body))
        except Conflict as e:
            return error(409, str(e))
        except BadRequest as e:
            return error(400, str(e))
        except Exception as e:  # noqa: BLE001  (the client retries 5xx, then names this server and the error)
            log.exception("scoring failed")
            return error(500, f"{type(e).__name__}: {e}")
        return {"scores": scores}

    return app
