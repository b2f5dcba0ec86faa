"""The tests' launcher for runs whose launcher is not under test: each rank is a process forked from one that has
imported the stack once (a fork server: `python tests/_forked.py`, preloaded with tests/_fork_preload.py), given
the rank variables torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), its environment and working directory, and then running the script as `python script args` would
(runpy, as `__main__`, its folder first on sys.path).

Why: a fresh rank imports torch, transformers and DeepSpeed for 3-6 CPU-seconds, and torchrun itself imports torch (a
2-rank launch of one tiny PPO iteration: 11-14 s under torchrun, 2.2 s forked; docs/testing.md). The ranks are still
separate processes talking over gloo, as under torchrun, and each starts from the server's state after its imports,
never from another launch's. What a launcher does (its signals, its exit codes, its restarts) is tested under the
real ones (deepspeed, torchrun, plain python), never through this.

The first rank that fails ends the others (SIGTERM, then SIGKILL after `GRACE_S`), and the launch's exit code is
that rank's (negative: the signal that ended it), as under the deepspeed launcher (torchrun reports 1). A rank leaves
through the interpreter's own exit (its non-daemon threads joined, atexit handlers, finalizers, C++ teardown), and
dies with its server (PR_SET_PDEATHSIG); the server ends what it started when the test process goes away.

What forking shares that fresh interpreters do not: the state the imports left (numpy's global seed is drawn again
per rank; `random` reseeds itself at fork), environment variables read at import (the server starts with
`clean_env()`, and a launch that sets one of IMPORT_TIME_VARS otherwise is refused), and the string-hash seed (every
forked rank has the same one; the launches under the real launchers keep ranks with different seeds)."""
from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

GRACE_S = 5.0
# read once, at import, by torch, DeepSpeed, huggingface_hub or OpenMP: a rank cannot be given another value
IMPORT_TIME_VARS = ("OMP_NUM_THREADS", "DS_ACCELERATOR", "DEEPSPEED_TIMEOUT", "HF_HUB_OFFLINE", "PYTHONHASHSEED",
                    "TOKENIZERS_PARALLELISM")


def _become_script(req: dict, server_fd: int) -> None:
    """In the forked process: become `python script *argv` (in `cwd`, with exactly `env`, output appended to the two
    files), then leave through the interpreter's exit: SystemExit or an exception propagates out of `serve()` and the
    interpreter ends this process as it ends a script."""
    import runpy

    import numpy

    signal.signal(signal.SIGINT, signal.default_int_handler)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # not the server's request pipe
    os.dup2(devnull, server_fd)  # nor its answers (the server's file object on it flushes nothing at exit)
    os.close(devnull)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # the same stream objects (libraries bound them at import), now on the files, line by line as `python -u` writes
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    numpy.random.seed()  # a fresh process seeds from the OS (`random` reseeds itself at fork)
    script = req["script"]
    sys.argv = [script, *req["argv"]]
    # sys.path as a fresh `python script` builds it: the script's folder, then PYTHONPATH, then the rest
    sys.path[:0] = [os.path.dirname(os.path.abspath(script))] + \
        [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def serve() -> None:
    """The server: preload, then for each request line (JSON: id, script, argv, env, cwd, stdout, stderr) fork a
    process that runs it and answer {"id", "pid"}; answer {"id", "code"} when it ends. At the end of its input it
    ends what it started (SIGTERM, SIGKILL after GRACE_S) and exits."""
    server_fd = os.dup(1)
    out = os.fdopen(server_fd, "w")
    os.dup2(2, 1)  # what the imports print (DeepSpeed logs to stdout) must not reach the answers
    import _fork_preload  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the test's terminal is the test's to handle
    children: dict = {}
    open_input, pending, closing_since = True, b"", None
    while open_input or children:
        ready, _, _ = select.select([0] if open_input else [], [], [], 0.05)
        if ready:  # read the pipe itself: a buffered reader could hold a second request that select never reports
            data = os.read(0, 1 << 16)
            open_input = bool(data)
            pending += data
        while b"\n" in pending and open_input:
            line, pending = pending.split(b"\n", 1)
            req = json.loads(line)
            out.flush()
            pid = os.fork()
            if pid == 0:
                _become_script(req, server_fd)
            children[pid] = req["id"]
            out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
            out.flush()
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            ident = children.pop(pid, None)
            if ident is not None:
                out.write(json.dumps({"id": ident, "code": os.waitstatus_to_exitcode(status)}) + "\n")
                out.flush()
        if not open_input and children:  # the test process is gone: end what it started
            if closing_since is None:
                closing_since = time.monotonic()
            sig = signal.SIGTERM if time.monotonic() - closing_since < GRACE_S else signal.SIGKILL
            for pid in list(children):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


class _Client:
    """This test process's fork server (started at the first spawn with `clean_env()`, ended with the process)."""

    def __init__(self):
        from _support import clean_env

        self.env = clean_env()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=self.env,
                                     cwd=os.path.dirname(os.path.abspath(__file__)))
        self.lock, self.next_id = threading.Lock(), 0
        self.pids: dict = {}  # id -> pid
        self.codes: dict = {}  # id -> exit code
        self.ended: list = []  # ids in the order their exits arrived
        self.dead = False
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                if "code" in msg:
                    self.codes[msg["id"]] = msg["code"]
                    self.ended.append(msg["id"])
                else:
                    self.pids[msg["id"]] = msg["pid"]
                self.changed.notify_all()
        with self.changed:  # the server is gone, and with it (PR_SET_PDEATHSIG) what it ran
            self.dead = True
            for ident, pid in self.pids.items():
                if ident not in self.codes:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    self.codes[ident] = -signal.SIGKILL
                    self.ended.append(ident)
            self.changed.notify_all()

    def spawn(self, **request) -> "Process":
        changed = [k for k in IMPORT_TIME_VARS if request["env"].get(k) != self.env.get(k)]
        if changed:
            raise ValueError(f"tests/_forked.py: {changed} are read at import, and the fork server imported with "
                             f"{[self.env.get(k) for k in changed]}; launch this under torchrun instead")
        with self.lock:
            self.next_id += 1
            ident = self.next_id
            self.proc.stdin.write(json.dumps({"id": ident, **request}) + "\n")
            self.proc.stdin.flush()
        with self.changed:
            self.changed.wait_for(lambda: ident in self.pids or self.dead, timeout=300)
        if ident not in self.pids:
            raise RuntimeError(f"the fork server did not start the process (tests/_forked.py; server exit code "
                               f"{self.proc.poll()}, its output is on this test's stderr)")
        return Process(self, ident, self.pids[ident])


_client = None
_client_lock = threading.Lock()


def client() -> _Client:
    global _client
    with _client_lock:
        if _client is None or _client.proc.poll() is not None:
            _client = _Client()
        return _client


class Process:
    """A process the fork server started: `poll()`, `wait(timeout)` (None if still running), `terminate()`,
    `kill()`, `send_signal(sig)`; exit codes as subprocess gives them (negative: the signal that ended it)."""

    def __init__(self, owner: _Client, ident: int, pid: int):
        self.owner, self.ident, self.pid = owner, ident, pid

    def poll(self):
        return self.owner.codes.get(self.ident)

    def wait(self, timeout: float | None = None):
        with self.owner.changed:
            self.owner.changed.wait_for(lambda: self.ident in self.owner.codes, timeout=timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(script: str, args: list, env: dict, cwd: str, stdout: str, stderr: str) -> Process:
    """One process running `python script *args`, forked from the fork server."""
    for path in (stdout, stderr):
        open(path, "a").close()
    return client().spawn(script=script, argv=list(args), env=env, cwd=cwd, stdout=stdout, stderr=stderr)


class Forked:
    """One process per rank, started now; `wait()` returns their joint exit code, or raises TimeoutExpired."""

    def __init__(self, script: str, args: list, nproc: int, env: dict, cwd: str, stdout: str, stderr: str,
                 rank_vars: bool = True):
        from rlhf_engine.engine.distributed import free_port

        self.cmd = ["<forked>", script, *args]
        self.stdout, self.stderr = stdout, stderr
        port = str(free_port())
        self.procs = []
        for rank in range(nproc):
            rank_env = dict(env)
            if rank_vars:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            self.procs.append(spawn(script, args, rank_env, cwd, stdout, stderr))

    def alive(self) -> list:
        return [p for p in self.procs if p.poll() is None]

    def kill(self, grace: float = 0.0) -> None:
        """End every rank still running: SIGTERM, then SIGKILL after `grace` seconds."""
        for p in self.alive():
            p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.wait(max(0.0, deadline - time.monotonic()))
        for p in self.alive():
            p.kill()
            p.wait()

    def first_failure(self):
        """The exit code of the rank whose failure arrived first (a peer that dies of the broken link after it is
        not the cause), or None."""
        owner = self.procs[0].owner
        mine = {p.ident: p for p in self.procs}
        with owner.changed:
            for ident in owner.ended:
                if ident in mine and mine[ident].poll():
                    return mine[ident].poll()
        return None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        owner = self.procs[0].owner
        while True:
            with owner.changed:
                owner.changed.wait_for(lambda: not self.alive() or self.first_failure() is not None,
                                       timeout=max(0.0, deadline - time.monotonic()))
            code = self.first_failure()
            if code is not None:
                self.kill(GRACE_S)  # the first failure ends the launch
                return code
            if not self.alive():
                return 0
            if time.monotonic() >= deadline:
                self.kill()
                raise subprocess.TimeoutExpired(self.cmd, timeout, *self.output())

    def output(self) -> tuple:
        out = []
        for path in (self.stdout, self.stderr):
            with open(path, errors="replace") as f:
                out.append(f.read())
        return tuple(out)


def run(script: str, args: list, nproc: int, env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run` of `script` on `nproc` forked ranks, its output captured (both ranks into one stream each,
    as torchrun passes them through). One rank alone gets no rank variables, as under plain python."""
    tmp = tempfile.mkdtemp(prefix="forked-")
    try:
        ranks = Forked(script, args, nproc, env, cwd, os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr"),
                       rank_vars=nproc > 1)
        code = ranks.wait(timeout)
        return subprocess.CompletedProcess(ranks.cmd, code, *ranks.output())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    serve()
