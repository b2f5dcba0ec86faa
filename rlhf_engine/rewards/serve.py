"""The reference reward server: what `--reward_url` talks to (remote.py has the protocol). Needs FastAPI and uvicorn:
`pip install 'rlhf_engine[serve]'` (the trainer side does not).

    python -m rlhf_engine.rewards.serve --reward_fn rlhf_engine.rewards.math_answer:exact_answer --port 8000
    python -m rlhf_engine.rewards.serve --reward_model runs/rm/model --port 8000 --device cuda:0
    REWARD_TOKEN=... python -m rlhf_engine.rewards.serve --reward_model runs/rm/model --host 0.0.0.0 \
        --auth_token_env REWARD_TOKEN

POST any path with {"prompts", "responses", "columns", "rollout"} -> {"scores": [...]}. A reward function is called
by the calling rule (its declared columns are taken from "columns"; a missing one is a 400 naming it). A reward model
(a `*ForSequenceClassification` folder, as step 2 exports it) is scored as the PPO reward engine scores it: the same
inputs (the rollout's own ids when its vocabulary is the actor's, else the re-encoded text or, with
--use_chat_template, the conversation) and the same reading, at the last real token (scorers.py, reward_inputs.py).
A function that raises answers 500 with the error: the trainer retries 5xx, then stops naming this server.

Requests are served concurrently: a slow or stalled client holds only its own connection. A reward model runs one
forward at a time; a reward function `--concurrency` calls at a time (default 1: raise it only for a thread-safe
function, e.g. one that waits on another service). Each connection has --request_timeout_s to deliver each complete
request (headers and body), or it is closed; a body over --max_request_mb is answered 413. At most
--max_concurrent_requests requests are served at once (each may hold a body of up to --max_request_mb, parsed): past
them a request is answered 503 with `Retry-After` at once, which the trainer retries. A retry of a request id is
answered from the first computation (serve_app.py). --auth_token_env NAME requires `Authorization: Bearer <token>`
on every route, `GET /health` included, with the token read from that environment variable (never logged or written
anywhere); binding an address other than loopback without one logs a warning. `GET /health` answers
{"ok": true, "ready": <a request would be served now>}.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
import threading
from typing import Any, Callable, Optional

from .loader import load_reward_fn
from .scorers import DTYPES, FunctionScorer, ModelScorer
from .serve_app import build_app, require

log = logging.getLogger("rlhf_engine.rewards.serve")


def deadline_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline per request: from the connection's start (or the previous answer) to
    the request's last body byte. A connection that misses it is closed (uvicorn itself bounds only idle
    keep-alive connections)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            before = self.cycle  # the request answered last (None: none yet)
            self._armed = armed = getattr(self, "_armed", 0) + 1  # only the newest deadline of a connection acts

            def check() -> None:
                if self._armed != armed:  # a response completed since: a later deadline holds
                    return
                cycle = self.cycle
                mid_body = cycle is not None and cycle is not before and cycle.more_body
                if (mid_body or cycle is before) and not self.transport.is_closing():
                    # mid-body: a stalled client; otherwise headers that never completed, or an idle connection
                    log.log(logging.WARNING if mid_body else logging.INFO, "closing a connection from %s: no "
                            "complete request within %g s (--request_timeout_s)", self.client and self.client[0],
                            timeout_s)
                    self.transport.close()

            self.loop.call_later(timeout_s, check)

    return DeadlineH11


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


class RewardServer:
    """uvicorn serving the app on a socket bound at construction (port 0: a free one, read back from
    `server_port`). `serve_forever()` blocks (in a thread, or in the main one, where Ctrl-C and SIGTERM stop it);
    `shutdown()` stops it from another thread; `server_close()` releases the socket."""

    def __init__(self, app: Any, host: str, port: int, request_timeout_s: float, max_connections: Optional[int] = None):
        uvicorn = require("uvicorn")
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        self.socket = socket.socket(family, kind, proto)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(addr)
        self.socket.listen(128)
        self.server_port = self.socket.getsockname()[1]
        # limit_concurrency: uvicorn's own 503 (no Retry-After) past that many connections, a backstop above the
        # app's request limit so that the app's answer comes first
        config = uvicorn.Config(app, http=deadline_protocol(request_timeout_s), log_config=None, access_log=False,
                                lifespan="off", timeout_keep_alive=5, timeout_graceful_shutdown=5,
                                limit_concurrency=max_connections)
        self.server = uvicorn.Server(config)
        self._running = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        self._running.set()
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        if self._running.is_set():
            self._stopped.wait(timeout_s)

    def server_close(self) -> None:
        self.socket.close()


def make_server(fn: Callable, host: str = "127.0.0.1", port: int = 0, *, auth_token: Optional[str] = None,
                max_request_bytes: int = 64 << 20, request_timeout_s: float = 60.0,
                concurrency: int = 1, max_concurrent_requests: int = 32) -> RewardServer:
    """A server scoring with `fn` (a reward function by the calling rule, or a scorer such as `ModelScorer`), bound;
    call `serve_forever()`."""
    scorer = fn if hasattr(fn, "score") else FunctionScorer(fn, concurrency)
    if not auth_token and not is_loopback(host):
        log.warning("serving on %s without --auth_token_env: anyone who can reach this port can make it score; set "
                    "--auth_token_env NAME (the token in that variable), or bind 127.0.0.1", host)
    app = build_app(scorer, auth_token=auth_token or None, max_body_bytes=int(max_request_bytes),
                    threads=max(8, int(concurrency) + 2), max_concurrent_requests=int(max_concurrent_requests))
    # room beyond the served requests for idle keep-alive connections and refused ones (each holds a read buffer)
    return RewardServer(app, host, port, request_timeout_s, max_connections=2 * int(max_concurrent_requests) + 32)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--reward_fn", help="'module:function' reward function (the calling rule)")
    which.add_argument("--reward_model", help="a *ForSequenceClassification folder (step 2's exported model)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; then set "
                    "--auth_token_env)")
    ap.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    ap.add_argument("--auth_token_env", default="", help="NAME of an environment variable holding a bearer token "
                    "that every request must carry (the trainer's --reward_auth_token_env); never logged")
    ap.add_argument("--max_request_mb", type=float, default=64.0, help="largest request body; larger ones get 413")
    ap.add_argument("--request_timeout_s", type=float, default=60.0, help="seconds a connection has to deliver each "
                    "complete request (headers and body); a client that stalls is disconnected")
    ap.add_argument("--max_concurrent_requests", type=int, default=32, help="requests served at once, each holding "
                    "its body (up to --max_request_mb) and its parsed copy: the bound on the server's memory; past it "
                    "a request is answered 503 with Retry-After, which the trainer retries (--reward_retries times): "
                    "give at least the number of trainer ranks sharing this server (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=1, help="reward function calls at once (raise it only for a "
                    "thread-safe function); a reward model runs one forward at a time")
    ap.add_argument("--batch_size", type=int, default=8, help="reward model: sequences per forward")
    ap.add_argument("--device", default="cpu", help="reward model: torch device (cuda:0, ...)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="reward model: weights' dtype (the reward "
                    "engine's dtype gives the engine's scores)")
    ap.add_argument("--use_chat_template", action="store_true", help="reward model: score the conversation [user: "
                    "data-row prompt, assistant: response] in its tokenizer's chat template (the trainer's "
                    "--reward_use_chat_template)")
    return ap


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = None
    if args.auth_token_env:
        token = os.environ.get(args.auth_token_env, "").strip()
        if not token:
            print(f"error: --auth_token_env {args.auth_token_env}: that environment variable is not set or is empty; "
                  "export it with the token (the flag takes the variable's name, not the token)", file=sys.stderr)
            return 2
    bad = next((f"--{name} {value:g}: must be {rule}" for name, value, ok, rule in (
        ("max_request_mb", args.max_request_mb, args.max_request_mb > 0, "> 0"),
        ("request_timeout_s", args.request_timeout_s, args.request_timeout_s > 0, "> 0"),
        ("concurrency", args.concurrency, args.concurrency >= 1, "at least 1"),
        ("max_concurrent_requests", args.max_concurrent_requests, args.max_concurrent_requests >= 1, "at least 1"),
    ) if not ok), None)
    if bad:  # before a reward model is loaded
        print(f"error: {bad}", file=sys.stderr)
        return 2
    try:
        require("fastapi"), require("uvicorn")
        fn = (load_reward_fn(args.reward_fn) if args.reward_fn else
              ModelScorer(args.reward_model, args.batch_size, args.device, args.dtype, args.use_chat_template))
        server = make_server(fn, args.host, args.port, auth_token=token,
                             max_request_bytes=int(args.max_request_mb * (1 << 20)),
                             request_timeout_s=args.request_timeout_s, concurrency=args.concurrency,
                             max_concurrent_requests=args.max_concurrent_requests)
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {getattr(fn, '__rlhf_spec__', args.reward_fn)} on http://{args.host}:{server.server_port}/",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
