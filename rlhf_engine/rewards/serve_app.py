"""The reference reward server's application (FastAPI): one POST route scoring a batch and `GET /health`, with a
bearer token, a bound on the requests in flight, a body size limit and answers shared by the retries of one request
id. serve.py runs it under uvicorn.

Per request, on every route, in order: the token (401 without the right one, `/health` included), then a slot among
`max_concurrent_requests` (past them: 503 with `Retry-After`, at once; the client retries 5xx). A refused body is read
and dropped, never kept, so the client gets the answer rather than a reset connection. Then, to score: the body (413
past `max_body_bytes`, also read and dropped), the JSON (400), then the score, computed on a worker thread so that the
event loop keeps serving other clients. So at most `max_concurrent_requests` bodies are held at once, and as many
scoring jobs wait behind the model: the bound on the server's memory. A request id (`X-Request-Id`) seen before with
the same body is answered from that first computation: awaited while it runs, or its answer while it is among the
last `keep_answers`; the same id with another body is a 409. A failed computation is forgotten, so a retry computes
again.

`GET /health` answers `{"ok": true, "ready": <a scoring request would get a slot now>}` and nothing else: not the
scorer, whose name may hold a path. It takes no slot (it holds no body), so it answers while the server is full.
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


class Busy(Exception):
    """As many scoring jobs as allowed are pending (answered 503 with Retry-After)."""


RETRY_AFTER_S = 1  # what a 503 asks the client to wait (whole seconds: the header's form)


class Answers:
    """The computations of recent request ids (module docstring); lives on the event loop's thread."""

    def __init__(self, keep: int = 1024, max_pending: Optional[int] = None):
        self.keep, self.max_pending = keep, max_pending
        self.entries: OrderedDict[str, tuple[str, asyncio.Future]] = OrderedDict()
        self.computed = 0  # computations started
        self.shared = 0  # requests answered from another request's computation
        self.pending = 0  # computations started and not finished: the queue behind the model

    async def get(self, request_id: Optional[str], digest: str, compute: Callable[[], Awaitable]) -> Any:
        if not request_id:
            self._admit()
            return await self._counted(compute)
        entry = self.entries.get(request_id)
        if entry is not None:
            if entry[0] != digest:
                raise Conflict(f"request id {request_id} was used before for another body; send a new id per batch")
            self.shared += 1
            self.entries.move_to_end(request_id)
            return await asyncio.shield(entry[1])
        self._admit()
        task = asyncio.ensure_future(self._counted(compute))  # a task: a cancelled request leaves it to its retry
        self.entries[request_id] = (digest, task)
        task.add_done_callback(lambda t: self._forget_if_failed(request_id, t))
        while len(self.entries) > self.keep:
            self.entries.popitem(last=False)
        return await asyncio.shield(task)

    def _admit(self) -> None:
        # A computation outlives a request that is cancelled (the shield above), so the request slots alone do not
        # bound the jobs: this does, each holding its parsed body.
        if self.max_pending is not None and self.pending >= self.max_pending:
            raise Busy(f"{self.pending} scoring jobs are pending, this server's limit (--max_concurrent_requests)")
        self.computed += 1
        self.pending += 1

    async def _counted(self, compute: Callable[[], Awaitable]) -> Any:
        try:
            return await compute()
        finally:
            self.pending -= 1

    def _forget_if_failed(self, request_id: str, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is not None:
            if self.entries.get(request_id, (None, None))[1] is task:
                del self.entries[request_id]


def authorized(header: Optional[str], token: str) -> bool:
    """Whether an Authorization header carries the bearer token (compared in constant time)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def drain(receive: Callable[[], Awaitable[dict]]) -> None:
    """Read a request's body to its end and drop it (an answer before the body is read risks a reset connection)."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class Slots:
    """The requests in flight (lives on the event loop's thread)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0  # requests holding a slot
        self.refused = 0  # requests answered 503 for want of one


class Guard:
    """ASGI middleware in front of every route: the token, then one of the `slots` (module docstring). Checking the
    token first keeps clients without it from taking the slots of those with it."""

    def __init__(self, app: Any, auth_token: Optional[str], slots: Slots):
        from fastapi.responses import JSONResponse

        self.app, self.auth_token, self.slots, self.response = app, auth_token, slots, JSONResponse

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if self.auth_token is not None and not authorized(header, self.auth_token):
            return await self.refuse(scope, receive, send, 401, "this reward server needs a bearer token: give the "
                                     "trainer --reward_auth_token_env NAME, with the server's token in that variable",
                                     {"WWW-Authenticate": "Bearer"})
        if scope["method"] == "GET" and scope["path"] == "/health":  # no body to hold: no slot
            return await self.app(scope, receive, send)
        slots = self.slots
        if slots.active >= slots.limit:
            slots.refused += 1
            return await self.refuse(scope, receive, send, 503, f"this reward server is serving its limit of "
                                     f"{slots.limit} requests (--max_concurrent_requests): retry later",
                                     {"Retry-After": str(RETRY_AFTER_S)})
        slots.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            slots.active -= 1

    async def refuse(self, scope: dict, receive: Callable, send: Callable, code: int, message: str,
                     headers: dict) -> None:
        await drain(receive)
        await self.response({"error": message}, status_code=code, headers=headers)(scope, receive, send)


async def read_body(request: Any, limit: int) -> tuple[Optional[bytearray], int]:
    """(the body, or None when it is over `limit`; its size). Read to the end either way."""
    declared = request.headers.get("content-length", "")
    keep = not (declared.isdigit() and int(declared) > limit)
    body, size = bytearray(), 0  # grown in place: no list of chunks beside a joined copy
    async for chunk in request.stream():
        size += len(chunk)
        if keep and size > limit:
            keep, body = False, bytearray()
        if keep:
            body += chunk
    return (body if keep else None), size


def build_app(scorer: Any, auth_token: Optional[str] = None, max_body_bytes: int = 64 << 20,
              keep_answers: int = 1024, threads: int = 8, max_concurrent_requests: int = 32) -> Any:
    """The FastAPI app scoring with `scorer` (scorers.py: `score(body) -> [float]`)."""
    if max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests = {max_concurrent_requests}: must be at least 1")
    fastapi = require("fastapi")
    from fastapi.responses import JSONResponse
    from starlette.requests import ClientDisconnect

    app = fastapi.FastAPI(title="rlhf_engine reward server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.answers = answers = Answers(keep_answers, max_pending=max_concurrent_requests)
    app.state.slots = slots = Slots(max_concurrent_requests)
    app.add_middleware(Guard, auth_token=auth_token, slots=slots)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward-score")

    def error(code: int, message: str, **headers: str) -> Any:
        return JSONResponse({"error": message}, status_code=code, headers=headers or None)

    @app.get("/health")
    async def health():
        return {"ok": True, "ready": slots.active < slots.limit}

    @app.post("/{path:path}")
    async def score(request: fastapi.Request, path: str):
        try:
            raw, size = await read_body(request, max_body_bytes)
        except ClientDisconnect:  # gone (or cut off by the connection deadline): nobody to answer
            return error(400, "the client disconnected mid-request")
        if raw is None:
            return error(413, f"the request body has {size} bytes, over this server's limit of {max_body_bytes} "
                              "(--max_request_mb): send smaller batches per rank, or raise the limit")
        try:
            body = json.loads(raw)
        except ValueError as e:
            return error(400, f"the body is not JSON: {e}")
        digest = hashlib.sha256(raw).hexdigest()
        del raw  # the parsed body is what the job keeps
        loop = asyncio.get_running_loop()
        try:
            scores = await answers.get(request.headers.get("x-request-id"), digest,
                                       lambda: loop.run_in_executor(pool, scorer.score, body))
        except Busy as e:
            return error(503, str(e), **{"Retry-After": str(RETRY_AFTER_S)})
        except Conflict as e:
            return error(409, str(e))
        except BadRequest as e:
            return error(400, str(e))
        except Exception as e:  # noqa: BLE001  (the client retries 5xx, then names this server and the error)
            log.exception("scoring failed")
            return error(500, f"{type(e).__name__}: {e}")
        return {"scores": scores}

    return app
