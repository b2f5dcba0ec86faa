"""One rollout server as the trainer sees it: JSON over HTTP, the bearer token on every call (docs/rollout-servers.md).

A `ServerClient` holds no connection between calls (each opens its own, so any number of threads may call at once)
and raises `ServerError` for every failure, saying whether another server could take the request instead
(`retriable`: refused, timed out, cut off, 5xx) or the request itself is wrong (4xx). Connections go straight to the
server (proxy variables are not read).
"""
from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from typing import Any, Optional


class ServerError(Exception):
    """A call to a rollout server that failed: `retriable` when the server (not the request) is at fault."""

    def __init__(self, url: str, what: str, retriable: bool, status: Optional[int] = None):
        super().__init__(f"rollout server {url}: {what}")
        self.url, self.retriable, self.status = url, retriable, status


class ServerClient:
    def __init__(self, url: str, token: str = "", timeout_s: float = 300.0):
        parsed = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"rollout server {url!r}: give http://HOST:PORT")
        self.url = f"{parsed.scheme}://{parsed.netloc}{parsed.path.rstrip('/')}"
        self.scheme, self.host, self.port = parsed.scheme, parsed.hostname, parsed.port or (
            443 if parsed.scheme == "https" else 80)
        self.base = parsed.path.rstrip("/")
        self.token, self.timeout_s = token, float(timeout_s)

    def __repr__(self) -> str:
        return f"ServerClient({self.url})"

    # ---- transport -----------------------------------------------------------------------------------------------
    def call(self, method: str, path: str, body: Any = None, query: Optional[dict] = None,
             timeout_s: Optional[float] = None) -> Any:
        """The decoded JSON answer of `method path` (None for an empty 200)."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout_s if timeout_s is None else timeout_s)
        target = self.base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, target, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut off mid-answer
            raise ServerError(self.url, f"{method} {path}: {type(e).__name__}: {e}", retriable=True) from e
        finally:
            conn.close()
        if resp.status >= 400:
            text = raw.decode(errors="replace")[:500]
            raise ServerError(self.url, f"{method} {path} answered {resp.status}: {text}",
                              retriable=resp.status >= 500 or resp.status in (408, 429), status=resp.status)
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ServerError(self.url, f"{method} {path}: not JSON ({raw[:200]!r})", retriable=True) from e

    def local_address(self) -> str:
        """This host's address on the route to the server (where the server can reach the trainer back)."""
        with socket.create_connection((self.host, self.port), timeout=self.timeout_s) as s:
            return s.getsockname()[0]

    # ---- what the trainer asks ---------------------------------------------------------------------------------
    def rpc(self, method: str, timeout_s: Optional[float] = None) -> list:
        """`/collective_rpc` of one of our extension's methods: one result per worker of the server."""
        answer = self.call("POST", "/collective_rpc", {"method": method}, timeout_s=timeout_s)
        return list((answer or {}).get("results") or [])

    def info(self, timeout_s: Optional[float] = None) -> dict:
        """The server's model, limits and extension (`rlhf_server_info` of each worker: they must agree), with
        `workers`, their count."""
        results = self.rpc("rlhf_server_info", timeout_s)
        if not results or not isinstance(results[0], dict):
            raise ServerError(self.url, "does not run the rlhf_engine worker extension (start it with "
                              "launch/rollout_server.py, or add --worker-extension-cls as docs/rollout-servers.md "
                              f"shows); /collective_rpc rlhf_server_info gave {results!r:.200}", retriable=False)
        return dict(results[0], workers=len(results))

    def generate(self, token_ids: list, sampling: dict, timeout_s: Optional[float] = None) -> dict:
        """One request, token ids in and out: its only choice ({token_ids, logprobs, finish_reason, weight_versions})."""
        answer = self.call("POST", "/inference/v1/generate", {"token_ids": list(token_ids),
                                                              "sampling_params": sampling}, timeout_s=timeout_s)
        choices = (answer or {}).get("choices") or []
        if len(choices) != 1:
            raise ServerError(self.url, f"/inference/v1/generate gave {len(choices)} choices for one request",
                              retriable=True)
        return choices[0]

    def pause(self, mode: str = "keep") -> None:
        self.call("POST", "/pause", query={"mode": mode, "clear_cache": "true"})

    def resume(self) -> None:
        self.call("POST", "/resume")

    def weight_version(self) -> str:
        return str((self.call("GET", "/weight_info") or {}).get("weight_version"))

    def init_weight_transfer(self, init_info: dict) -> None:
        self.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self.call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, version: str) -> None:
        self.call("POST", "/finish_weight_update", {"weight_version": version})

    def weight_receipts(self) -> list:
        return self.rpc("rlhf_weight_receipt")
