"""The tests' launcher for runs whose launcher is not under test: each rank is a process forked from one that has
imported the stack once (a fork server: `python tests/_forked.py`, preloaded with tests/_fork_preload.py), given
the rank variables torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), its environment and working directory, and then running the script as `python script args` would
(runpy, as `__main__`, with the sys.path a fresh interpreter builds for it).

Linux only: it needs fork() and prctl(PR_SET_PDEATHSIG). Elsewhere `AVAILABLE` is false and tests/_support.launch
runs a "fork" launch under torchrun (one rank: plain python), the launchers it stands for.

Why: a fresh rank imports torch, transformers and DeepSpeed for 3-6 CPU-seconds, and torchrun itself imports torch (a
2-rank launch of one tiny PPO iteration: 11-14 s under torchrun, 2.2 s forked; docs/testing.md). The ranks are still
separate processes talking over gloo, as under torchrun, and each starts from its server's state after its imports,
never from another launch's. What a launcher does (its signals, its exit codes, its restarts) is tested under the
real ones (deepspeed, torchrun, plain python), never through this.

The first rank that fails ends the others (SIGTERM, then SIGKILL after `GRACE_S`), and the launch's exit code is
that rank's (negative: the signal that ended it), as under the deepspeed launcher (torchrun reports 1). A rank leaves
through the interpreter's own exit (its non-daemon threads joined, atexit handlers, finalizers, C++ teardown), and
dies with its server (PR_SET_PDEATHSIG, set before the script runs); the server ends what it started when the test
process goes away. Only a server signals its ranks: their pids are its children's, which no other process can take
until the server has reaped them.

How a forked rank differs from a fresh one, and what is checked so that it does not differ further:
- Its imports are done: the modules of the preload are loaded (an import-order bug, such as importing deepspeed
  before DS_ACCELERATOR is set, cannot show), and what they set in the environment is set from the start
  (deepspeed's PYTORCH_NVML_BASED_CUDA_CHECK=1, torch's TORCHINDUCTOR_CACHE_DIR), as in a fresh rank after them.
- Its environment: what the imports read of it is the server's, so a launch's environment may differ from the
  server's only in PER_LAUNCH_VARS and the RLHF_ENGINE_TEST_* variables (read when used, never at import). Any other
  difference, a variable set, unset or changed, is refused, naming it.
- Its string-hash seed: its server's. There is one server per local rank (its own preload: ~0.5 GB and a few
  CPU-seconds, once per test process), so the ranks of a launch differ in it as fresh ones do; a rank has the same
  seed in every launch, where fresh ones draw a new one each time. numpy's global seed is drawn again per rank;
  `random` reseeds itself at fork.
- Nothing else of the server: a server forks only with one thread (/proc/self/task: a fork copies the calling
  thread only, and a lock another thread held stays locked in the child) and CUDA not initialised (a forked child
  cannot use it), and refuses the launch otherwise; sys.path is rebuilt as a fresh `python script` builds it (the
  script's folder, then what the interpreter had before its own script's folder: PYTHONPATH and the defaults)."""
from __future__ import annotations

import ctypes
import importlib
import itertools
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
PRELOAD = "_fork_preload"
PR_SET_PDEATHSIG = 1
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# May differ from the server's environment, read when used and never at import: the rank variables (read when the
# process group starts); TORCH_EXTENSIONS_DIR (read when an op is built); PYTEST_CURRENT_TEST (pytest rewrites it in
# the test process for every phase of every test, and clean_env() copies it: nothing reads it)
PER_LAUNCH_VARS = (*RANK_VARS, "TORCH_EXTENSIONS_DIR", "PYTEST_CURRENT_TEST")
PER_LAUNCH_PREFIX = "RLHF_ENGINE_TEST_"  # the package's test hooks (faults.py, hooks.py), read where they act


def _prctl():
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


AVAILABLE = _prctl() is not None


class ForkRefused(RuntimeError):
    """The server would not fork this launch (its environment, or the server's threads or CUDA)."""


def per_launch(name: str) -> bool:
    return name in PER_LAUNCH_VARS or name.startswith(PER_LAUNCH_PREFIX)


def _refusal(env: dict, server: dict) -> str:
    """Why a rank with environment `env` forked now would differ from a fresh one ('' when it would not)."""
    why = []
    start, imported = server["env"], server["import_env"]

    def differs(k: str) -> bool:
        # the server's value, or the one its imports left (they set it in a rank too; a test process that has run
        # the same imports passes it on)
        return env.get(k) != start.get(k) and (k not in imported or env.get(k) != imported[k]) and not per_launch(k)

    differ = sorted(k for k in set(env) | set(start) if differs(k))
    if differ:  # names only: values can be secrets
        how = {k: "not in the server's" if k not in start else "unset" if k not in env else "another value"
               for k in differ}
        why.append("its environment differs from the fork server's in " + ", ".join(f"{k} ({how[k]})" for k in differ)
                   + f"; only {', '.join(PER_LAUNCH_VARS)} and {PER_LAUNCH_PREFIX}* may (the server's imports read "
                   "the rest once): launch this under torchrun, or start a Server with this environment")
    threads = len(os.listdir("/proc/self/task"))  # every OS thread, also those `threading` does not know
    if threads != 1:
        why.append(f"the fork server runs {threads} threads (a fork copies only the calling one, and a lock another "
                   "holds stays locked in the rank): its preload must not start any")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        why.append("CUDA is initialised in the fork server (a forked process cannot use it): its preload must not "
                   "initialise it")
    return "; ".join(why)


def _become_script(req: dict, server: dict) -> None:
    """In the forked process: become `python script *argv` (in `cwd`, with `env`, output appended to the two files),
    then leave through the interpreter's exit: SystemExit or an exception propagates out of `serve()` and the
    interpreter ends this process as it ends a script."""
    import runpy

    import numpy

    if _prctl()(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed: a rank would outlive its server")
    if os.getppid() != server["pid"]:  # the server died before the call above: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # not the server's request pipe
    os.dup2(devnull, server["fd"])  # nor its answers (the server's file object on it flushes nothing at exit)
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
    for k, v in server["import_env"].items():  # what the imports set, as a fresh rank has it after them
        if req["env"].get(k) == server["env"].get(k):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    numpy.random.seed()  # a fresh process seeds from the OS (`random` reseeds itself at fork)
    script = req["script"]
    sys.argv = [script, *req["argv"]]
    # as the interpreter builds it for `python script`: the script's real folder, then the rest; nothing of the
    # server's own folder (tests/), unless PYTHONPATH names it
    sys.path[:] = ([] if sys.flags.safe_path else [os.path.dirname(os.path.realpath(script))]) + server["path"]
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def serve(preload: str) -> None:
    """The server: import `preload`, answer {"ready", "import_env"}, then for each request line fork a process that
    runs it (JSON: id, script, argv, env, cwd, stdout, stderr) and answer {"id", "pid"}, or {"id", "refused"}, and
    {"id", "code"} when it ends; a line {"id", "signal"} sends that signal to that process if it has not been
    reaped. At the end of its input it ends what it started (SIGTERM, SIGKILL after GRACE_S) and exits."""
    server = {"pid": os.getpid(), "env": dict(os.environ),
              # the path before this script's folder was put first (a fresh interpreter's, for any script)
              "path": list(sys.path if sys.flags.safe_path else sys.path[1:])}
    server["fd"] = os.dup(1)
    out = os.fdopen(server["fd"], "w")
    os.dup2(2, 1)  # what the imports print (DeepSpeed logs to stdout) must not reach the answers
    importlib.import_module(preload)
    server["import_env"] = {k: os.environ.get(k) for k in set(os.environ) | set(server["env"])
                            if os.environ.get(k) != server["env"].get(k)}

    def answer(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the test's terminal is the test's to handle
    answer({"ready": True, "import_env": server["import_env"]})
    children: dict = {}  # pid -> id, until reaped
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
            if "signal" in req:  # only while unreaped: its pid is still this process's child, not a reused one
                pid = next((p for p, i in children.items() if i == req["id"]), None)
                if pid is not None:
                    os.kill(pid, req["signal"])
                continue
            why = _refusal(req["env"], server)
            if why:
                answer({"id": req["id"], "refused": why})
                continue
            out.flush()
            pid = os.fork()
            if pid == 0:
                _become_script(req, server)
            children[pid] = req["id"]
            answer({"id": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            ident = children.pop(pid, None)
            if ident is not None:
                answer({"id": ident, "code": os.waitstatus_to_exitcode(status)})
        if not open_input and children:  # the test process is gone: end what it started
            if closing_since is None:
                closing_since = time.monotonic()
            sig = signal.SIGTERM if time.monotonic() - closing_since < GRACE_S else signal.SIGKILL
            for pid in list(children):
                os.kill(pid, sig)  # unreaped: still this process's child
            time.sleep(0.2)


# Every server's reports: one condition (a launch waits on ranks of several servers) and one order of arrival (which
# rank failed first)
_changed = threading.Condition()
_arrivals = itertools.count()


class Server:
    """A fork server, started now with `env` and importing `preload` (found on its path: tests/ or PYTHONPATH). The
    launches use one per local rank (`server(r)`); a test may start its own and `close()` it."""

    def __init__(self, env: dict, preload: str = PRELOAD):
        if not AVAILABLE:
            raise RuntimeError("tests/_forked.py is Linux only (fork and prctl(PR_SET_PDEATHSIG)): launch under "
                               "torchrun (tests/_support.launch does)")
        self.env, self.preload = env, preload
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=os.path.dirname(os.path.abspath(__file__)))
        self.lock, self.next_id = threading.Lock(), 0
        self.import_env = None  # what the preload set in the environment, once ready
        self.pids: dict = {}  # id -> pid
        self.codes: dict = {}  # id -> exit code
        self.arrived: dict = {}  # id -> when its exit arrived (_arrivals)
        self.refused: dict = {}  # id -> why
        self.dead = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with _changed:
                if "ready" in msg:
                    self.import_env = msg["import_env"]
                elif "code" in msg:
                    self.codes[msg["id"]] = msg["code"]
                    self.arrived[msg["id"]] = next(_arrivals)
                elif "refused" in msg:
                    self.refused[msg["id"]] = msg["refused"]
                else:
                    self.pids[msg["id"]] = msg["pid"]
                _changed.notify_all()
        with _changed:
            # The server is gone, and the kernel ends what it ran with SIGKILL (PR_SET_PDEATHSIG, set in each before
            # its script): reported as such, never sent from here (they are not this process's children)
            self.dead = True
            for ident in self.pids:
                if ident not in self.codes:
                    self.codes[ident] = -signal.SIGKILL
                    self.arrived[ident] = next(_arrivals)
            _changed.notify_all()

    def _send(self, msg: dict) -> None:
        with self.lock:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()

    def spawn(self, **request) -> "Process":
        with self.lock:
            self.next_id += 1
            ident = self.next_id
        self._send({"id": ident, **request})
        with _changed:
            _changed.wait_for(lambda: ident in self.pids or ident in self.refused or self.dead, timeout=300)
        if ident in self.refused:
            raise ForkRefused(f"tests/_forked.py refused to fork {request['script']}: {self.refused[ident]}")
        if ident not in self.pids:
            raise RuntimeError(f"the fork server did not start the process (tests/_forked.py; server exit code "
                               f"{self.proc.poll()}, its output is on this test's stderr)")
        return Process(self, ident, self.pids[ident])

    def signal(self, ident: int, sig: int) -> None:
        try:
            self._send({"id": ident, "signal": int(sig)})
        except (BrokenPipeError, ValueError):  # the server is gone, and its processes with it
            pass

    def close(self, timeout: float = 30.0) -> None:
        """End the server (it ends what it started: SIGTERM, SIGKILL after GRACE_S)."""
        with self.lock:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self.proc.wait(timeout)


_servers: dict = {}  # local rank -> this test process's server for it
_servers_lock = threading.Lock()


def server(local_rank: int = 0) -> Server:
    """This test process's fork server for `local_rank` (started with `clean_env()` at its first use, again if it
    died, ended with the process)."""
    with _servers_lock:
        srv = _servers.get(local_rank)
        if srv is None or srv.proc.poll() is not None:
            from _support import clean_env

            srv = _servers[local_rank] = Server(clean_env())
        return srv


class Process:
    """A process a fork server started: `poll()`, `wait(timeout)` (None if still running), `terminate()`,
    `kill()`, `send_signal(sig)` (sent by its server); exit codes as subprocess gives them (negative: the signal
    that ended it)."""

    def __init__(self, owner: Server, ident: int, pid: int):
        self.owner, self.ident, self.pid = owner, ident, pid

    def poll(self):
        return self.owner.codes.get(self.ident)

    def wait(self, timeout: float | None = None):
        with _changed:
            _changed.wait_for(lambda: self.ident in self.owner.codes, timeout=timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.owner.signal(self.ident, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(script: str, args: list, env: dict, cwd: str, stdout: str, stderr: str, local_rank: int = 0) -> Process:
    """One process running `python script *args`, forked from the server of `local_rank`."""
    for path in (stdout, stderr):
        open(path, "a").close()
    return server(local_rank).spawn(script=script, argv=list(args), env=env, cwd=cwd, stdout=stdout, stderr=stderr)


class Forked:
    """One process per rank, started now, each from its local rank's server; `wait()` returns their joint exit
    code, or raises TimeoutExpired."""

    def __init__(self, script: str, args: list, nproc: int, env: dict, cwd: str, stdout: str, stderr: str,
                 rank_vars: bool = True):
        from rlhf_engine.engine.distributed import free_port

        self.cmd = ["<forked>", script, *args]
        self.stdout, self.stderr = stdout, stderr
        port = str(free_port())
        for rank in range(nproc):  # the servers not yet running start together (their imports overlap)
            server(rank)
        self.procs = []
        try:
            for rank in range(nproc):
                rank_env = dict(env)
                if rank_vars:
                    rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                    LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                self.procs.append(spawn(script, args, rank_env, cwd, stdout, stderr, local_rank=rank))
        except BaseException:  # a rank refused: the ones started would wait for it forever
            self.kill()
            raise

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
        with _changed:
            failed = [p for p in self.procs if p.poll()]
            return min(failed, key=lambda p: p.owner.arrived[p.ident]).poll() if failed else None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            with _changed:
                _changed.wait_for(lambda: not self.alive() or self.first_failure() is not None,
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
    serve(sys.argv[1] if len(sys.argv) > 1 else PRELOAD)
