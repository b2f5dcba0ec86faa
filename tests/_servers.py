"""Rollout servers for the tests: real `launch/rollout_server.py` processes (stock vLLM's server) on free local ports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil

from _support import ROOT, clean_env, free_address

TOKEN_ENV = "RLHF_ENGINE_TEST_ROLLOUT_TOKEN"


class RolloutServers:
    """`n` servers of `model`, started at once (each a vLLM start-up: about 40 s on the 2-core test machine, the
    servers side by side), with a bearer token read from TOKEN_ENV; `urls`, `wait_ready()`, `stop()`."""

    def __init__(self, tmp: str, n: int, model: str, token: str, max_model_len: int = 256, kv_cache_mb: int = 64):
        self.token, self.procs, self.logs, self.urls = token, [], [], []
        # each server's descendants once it is up (vLLM's engine core): one killed alone leaves its engine core
        # running, reparented to init, holding a core and a GiB after the tests; stop() ends them
        self.descendants: list = []
        for i in range(n):
            port = free_address().rpartition(":")[2]
            path = os.path.join(tmp, f"server_{i}.log")
            log = open(path, "w")
            self.logs.append(path)
            args = [sys.executable, os.path.join(ROOT, "launch", "rollout_server.py"), model, "--port", port,
                    "--host", "127.0.0.1", "--auth_token_env", TOKEN_ENV, "--max_model_len", str(max_model_len),
                    "--kv_cache_mb", str(kv_cache_mb)]
            # in the test process's group: a CI job stopped at its time limit ends it with the rest
            self.procs.append(subprocess.Popen(args, cwd=ROOT, env=clean_env(**{TOKEN_ENV: token}), stdout=log,
                                               stderr=subprocess.STDOUT))
            log.close()
            self.urls.append(f"http://127.0.0.1:{port}")

    def request(self, url: str, path: str, body=None, token: str | None = None, method: str | None = None):
        """(status, decoded JSON or text) of one call, `token` None = the servers' own."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data else "GET"))
        req.add_header("Content-Type", "application/json")
        if (self.token if token is None else token):
            req.add_header("Authorization", f"Bearer {self.token if token is None else token}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                raw, status = resp.read(), resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw) if raw.strip() else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        for url, proc, log in zip(self.urls, self.procs, self.logs):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"rollout server {url} exited with {proc.returncode}: "
                                       f"{open(log).read()[-3000:]}")
                try:
                    if self.request(url, "/v1/models")[0] == 200:
                        self.descendants += psutil.Process(proc.pid).children(recursive=True)
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout server {url} not up within {timeout} s: {open(log).read()[-3000:]}")
                time.sleep(0.5)

    def stop(self) -> None:
        """Every server: SIGTERM, SIGKILL after 30 s; then whatever of their engine cores is still running (a server a
        test killed is gone, its engine core is not). psutil checks each process's start time: never a reused pid."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for child in self.descendants:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(self.descendants, timeout=30)
