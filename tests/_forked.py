"""The tests' launcher for runs whose launcher is not under test: each rank is a process forked from one that has
imported the stack once (a fork server: `python tests/_forked.py`, preloaded with tests/_fork_preload.py), given the rank
variables torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), its
environment and working directory, and then running the script as `python script args` would (runpy, as
`__main__`, its folder first on sys.path, the atexit handlers at its end).

Why: a fresh rank imports torch, transformers and DeepSpeed for 3-6 CPU-seconds, and torchrun itself imports torch (a
2-rank launch of one tiny PPO iteration: 11-14 s under torchrun, 2.2 s forked; docs/testing.md). The ranks are still
separate processes talking over gloo, as under torchrun, and each starts from the server's state after its imports,
never from another launch's. What a launcher does (its signals, its exit codes, its restarts) is tested under the real ones
(deepspeed, torchrun, plain python), never through this.

As torchrun does, the first rank that fails ends the others (SIGTERM, then SIGKILL after `GRACE_S`), and the launch's
exit code is that rank's (negative: the signal that ended it)."""
from __future__ import annotations

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


def _run_script(script: str, argv: list, env: dict, cwd: str, stdout: str, stderr: str, server_fd: int) -> None:
    """In the forked process: become `python script *argv` (in `cwd`, with exactly `env`, output appended to the two
    files) and exit with the script's code."""
    import atexit
    import runpy
    import traceback

    import numpy

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.close(server_fd)  # the server's answers are not this process's to hold open
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # not the server's request pipe
    os.close(devnull)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # the same stream objects (libraries bound them at import), now on the files, line by line as `python -u` writes
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    numpy.random.seed()  # a fresh process seeds from the OS (`random` reseeds itself at fork)
    sys.argv = [script, *argv]
    # sys.path as a fresh `python script` builds it: the script's folder, then PYTHONPATH, then the rest
    extra = [os.path.dirname(os.path.abspath(script))] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = extra
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"), as the interpreter does
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what interpreter shutdown runs (os._exit below runs none)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The server: preload, then for each request line (JSON: id, script, argv, env, cwd, stdout, stderr) fork a
    process that runs it and answer {"id", "pid"}; answer {"id", "code"} when it ends. Ends at the end of its input."""
    server_fd = os.dup(1)
    out = os.fdopen(server_fd, "w")
    os.dup2(2, 1)  # what the imports print (DeepSpeed logs to stdout) must not reach the answers
    import _fork_preload  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the test's terminal is the test's to handle
    children: dict = {}
    open_input, pending = True, b""
    while open_input or children:
        ready, _, _ = select.select([0] if open_input else [], [], [], 0.05)
        if ready:  # read the pipe itself: a buffered reader could hold a second request that select never reports
            data = os.read(0, 1 << 16)
            open_input = bool(data)
            pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            req = json.loads(line)
            out.flush()
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                _run_script(req["script"], req["argv"], req["env"], req["cwd"], req["stdout"], req["stderr"],
                            server_fd)
            children[pid] = req["id"]
            out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
            out.flush()
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            out.write(json.dumps({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)}) + "\n")
            out.flush()


class _Client:
    """This test process's fork server (started at the first spawn, ended with the process)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
        self.lock, self.next_id = threading.Lock(), 0
        self.pids: dict = {}  # id -> pid
        self.codes: dict = {}  # id -> exit code
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                (self.codes if "code" in msg else self.pids)[msg["id"]] = msg.get("code", msg.get("pid"))
                self.changed.notify_all()
        with self.changed:  # the server is gone: nothing it ran will report
            self.codes.update({i: -signal.SIGKILL for i in self.pids if i not in self.codes})
            self.changed.notify_all()

    def spawn(self, **request) -> "Process":
        with self.lock:
            self.next_id += 1
            ident = self.next_id
            self.proc.stdin.write(json.dumps({"id": ident, **request}) + "\n")
            self.proc.stdin.flush()
        with self.changed:
            self.changed.wait_for(lambda: ident in self.pids, timeout=120)
        if ident not in self.pids:
            raise RuntimeError("the fork server did not start the process (tests/_forked.py)")
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
    `kill()`; exit codes as subprocess gives them (negative: the signal that ended it)."""

    def __init__(self, owner: _Client, ident: int, pid: int):
        self.owner, self.ident, self.pid = owner, ident, pid

    def poll(self):
        return self.owner.codes.get(self.ident)

    def wait(self, timeout: float | None = None):
        with self.owner.changed:
            self.owner.changed.wait_for(lambda: self.ident in self.owner.codes, timeout=timeout)
        return self.poll()

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    send_signal = _signal


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

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        code = 0
        owner = self.procs[0].owner
        while True:
            with owner.changed:
                owner.changed.wait_for(lambda: not self.alive() or any(p.poll() for p in self.procs),
                                       timeout=max(0.0, deadline - time.monotonic()))
            failed = [p.poll() for p in self.procs if p.poll()]
            if failed and not code:
                code = failed[0]
                self.kill(GRACE_S)  # the first failure ends the launch, as under torchrun
            if not self.alive():
                return code
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
