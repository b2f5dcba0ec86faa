"""The tests' fork launcher (tests/_forked.py) starts ranks the way torchrun would and ends them the way a script
ends, so that the multi-rank tests that use it check what they would check under torchrun: each rank is its own
process with the rank variables and exactly the given environment (plus what the server's imports set, as after them
in a fresh rank) and working directory, the sys.path and string-hash seed of a fresh process (one server per local
rank), the script runs as `__main__` with its argv, and it leaves through the interpreter's exit (non-daemon threads
joined, atexit handlers run, an exception or `sys.exit("...")` printed and exit 1). The first failing rank's code is
the launch's and ends the others; a timeout kills them; a rank dies with its server. A server refuses to fork with
another environment, a second thread or CUDA initialised. Elsewhere than Linux the launches run under torchrun."""
import fcntl
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import _forked
from _support import ROOT, clean_env, launch

pytestmark = pytest.mark.skipif(not _forked.AVAILABLE, reason="tests/_forked.py is Linux only")

SCRIPT = textwrap.dedent("""
    import atexit, importlib.util, json, os, sys, threading, time
    rank = int(os.environ.get("RANK", -1))
    out, mode = sys.argv[1], sys.argv[2]
    atexit.register(lambda: open(os.path.join(out, f"atexit_{rank}"), "w").close())
    with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "name": __name__, "file": __file__, "argv": sys.argv,
                   "cwd": os.getcwd(), "path": sys.path, "env": dict(os.environ), "hash": hash("rlhf_engine"),
                   "support": importlib.util.find_spec("_support") is not None}, f)
    print(f"hello from rank {rank}", flush=True)
    if mode == "thread":  # a non-daemon thread outlives the main one: the interpreter's exit joins it
        def late():
            time.sleep(0.5)
            open(os.path.join(out, f"thread_{rank}"), "w").close()
        threading.Thread(target=late).start()
    if mode == "raise":
        raise RuntimeError("boom from the script")
    if mode == "message":
        sys.exit("a message instead of a code")
    if mode == "fail" and rank == 1:
        while not os.path.exists(os.path.join(out, "rank_0.json")):  # rank 0 is up before rank 1 fails
            time.sleep(0.01)
        sys.exit(7)
    if mode in ("fail", "hang"):
        time.sleep(600)
    if mode in ("hold", "orphan"):  # hold a lock until told to go: the kernel frees it only when this process ends
        import ctypes, fcntl
        if mode == "orphan":  # the negative control: as if the launcher had not set PR_SET_PDEATHSIG
            ctypes.CDLL(None).prctl(1, 0)
        lock = open(os.path.join(out, "lock"), "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        open(os.path.join(out, "held"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
            time.sleep(0.05)
    """)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return str(path)


def _seen(tmp_path, rank):
    return json.loads((tmp_path / f"rank_{rank}.json").read_text())


def _wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, path
        time.sleep(0.02)


def _gone(pid):
    """Ended: no such process, or a zombie no one has reaped yet (reparented after its server died)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _fresh(script, args, env, cwd):
    """What `python script args` sees, run fresh with `env` (the probe's record, rank -1)."""
    subprocess.run([sys.executable, script, *args], env=env, cwd=cwd, check=True, capture_output=True, timeout=120)
    return json.loads((cwd / "rank_-1.json").read_text())


def _lock_free(path) -> bool:
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def _freed_within(path, seconds) -> bool:
    deadline = time.monotonic() + seconds
    while not _lock_free(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _without_import_env(env: dict, srv) -> dict:
    return {k: v for k, v in env.items() if k not in srv.import_env}


def test_ranks_start_as_torchrun_would_start_them(script, tmp_path, monkeypatch):
    env = clean_env()
    for r in (0, 1):
        _forked.server(r)  # started before this process's environment gains a variable the launch is not given
    monkeypatch.setenv("FORKED_TEST_NOT_GIVEN", "1")
    proc = _forked.run(script, [str(tmp_path), "ok"], 2, env, str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["hello from rank 0", "hello from rank 1"]
    ranks = [_seen(tmp_path, r) for r in (0, 1)]
    fresh = _fresh(script, [str(tmp_path), "ok"], env, tmp_path)
    port = ranks[0]["env"]["MASTER_PORT"]
    for r, seen in enumerate(ranks):
        srv = _forked.server(r)
        assert seen["ppid"] == srv.proc.pid  # one server per local rank
        # exactly the given environment and torchrun's rank variables, and what the server's imports set (as after
        # them in a fresh rank): nothing else of the server's or this process's
        assert _without_import_env(seen["env"], srv) == _without_import_env(
            {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}, srv)
        assert all(seen["env"].get(k) == v for k, v in srv.import_env.items())
        assert (seen["name"], seen["file"], seen["argv"]) == ("__main__", script, [script, str(tmp_path), "ok"])
        assert seen["cwd"] == str(tmp_path)
        assert seen["path"] == fresh["path"] and seen["path"][0] == os.path.dirname(os.path.realpath(script))
        assert (tmp_path / f"atexit_{r}").exists()
    assert ranks[0]["pid"] != ranks[1]["pid"] and os.getpid() not in (ranks[0]["pid"], ranks[1]["pid"])
    if os.environ.get("PYTHONHASHSEED", "random") == "random":  # each server drew its own, as fresh ranks do
        assert ranks[0]["hash"] != ranks[1]["hash"]


def test_one_rank_gets_no_rank_variables_as_under_plain_python(script, tmp_path):
    env = clean_env()
    proc = _forked.run(script, [str(tmp_path), "ok"], 1, env, str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    srv = _forked.server(0)
    assert _without_import_env(_seen(tmp_path, -1)["env"], srv) == _without_import_env(env, srv)


def test_a_rank_leaves_through_the_interpreter_s_exit(script, tmp_path):
    proc = _forked.run(script, [str(tmp_path), "thread"], 2, clean_env(), str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "thread_0").exists() and (tmp_path / "thread_1").exists()  # joined, not cut off


@pytest.mark.parametrize("mode,text", [("raise", "RuntimeError: boom from the script"),
                                       ("message", "a message instead of a code")])
def test_an_exception_or_an_exit_message_is_printed_and_exits_1(script, tmp_path, mode, text):
    proc = _forked.run(script, [str(tmp_path), mode], 1, clean_env(), str(tmp_path), timeout=120)
    assert proc.returncode == 1 and text in proc.stderr, proc.stderr


def test_the_first_failing_rank_ends_the_launch_with_its_code(script, tmp_path):
    t0 = time.monotonic()
    proc = _forked.run(script, [str(tmp_path), "fail"], 2, clean_env(), str(tmp_path), timeout=120)
    assert proc.returncode == 7
    assert time.monotonic() - t0 < 60  # rank 0 (asleep for 600 s) was ended, not waited for
    assert _gone(_seen(tmp_path, 0)["pid"])


def test_a_timeout_kills_every_rank_and_raises_as_subprocess_run_does(script, tmp_path):
    ranks = _forked.Forked(script, [str(tmp_path), "hang"], 2, clean_env(), str(tmp_path),
                           str(tmp_path / "out"), str(tmp_path / "err"))
    for r in (0, 1):
        _wait_for(tmp_path / f"rank_{r}.json")
    with pytest.raises(subprocess.TimeoutExpired) as err:
        ranks.wait(timeout=0.5)
    assert "hello from rank" in err.value.output
    assert all(_gone(_seen(tmp_path, r)["pid"]) for r in (0, 1))


@pytest.mark.parametrize("change,named", [
    (dict(OMP_NUM_THREADS="2"), "OMP_NUM_THREADS (another value)"),  # read at import by torch
    (dict(FORKED_TEST_EXTRA="1"), "FORKED_TEST_EXTRA (not in the server's)"),  # any variable, not a list of them
    (dict(HF_HUB_OFFLINE=None), "HF_HUB_OFFLINE (unset)"),
])
def test_an_environment_other_than_the_server_s_is_refused_naming_the_variable(script, tmp_path, change, named):
    env = clean_env(**{k: v for k, v in change.items() if v is not None})
    for k in [k for k, v in change.items() if v is None]:
        del env[k]
    with pytest.raises(_forked.ForkRefused, match=re.escape(named)):
        _forked.run(script, [str(tmp_path), "ok"], 2, env, str(tmp_path), timeout=120)
    assert not (tmp_path / "rank_0.json").exists()  # refused before a fork


def test_the_rank_variables_the_test_hooks_and_the_extensions_dir_may_differ(script, tmp_path):
    extra = dict(RLHF_ENGINE_TEST_FORKED="x", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    proc = _forked.run(script, [str(tmp_path), "ok"], 1, clean_env(**extra), str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert extra.items() <= _seen(tmp_path, -1)["env"].items()


def test_sys_path_is_a_fresh_interpreter_s_and_the_server_s_folder_is_not_on_it(script, tmp_path):
    """A server whose own folder (tests/, which holds _support.py) is not on PYTHONPATH: a module found there only
    through the server's sys.path[0] must not be found by a rank, whose sys.path is the one `python script` gets."""
    env = clean_env(PYTHONPATH=ROOT)
    srv = _forked.Server(env, preload="json")  # the path does not depend on what it preloads
    try:
        p = srv.spawn(script=script, argv=[str(tmp_path), "ok"], env=env, cwd=str(tmp_path),
                      stdout=str(tmp_path / "log"), stderr=str(tmp_path / "log"))
        assert p.wait(timeout=60) == 0, (tmp_path / "log").read_text()
    finally:
        srv.close()
    seen = _seen(tmp_path, -1)
    os.remove(tmp_path / "rank_-1.json")
    fresh = _fresh(script, [str(tmp_path), "ok"], env, tmp_path)
    assert os.path.exists(os.path.join(ROOT, "tests", "_support.py"))  # on the server's path: its script's folder
    assert not seen["support"] and not fresh["support"]
    assert seen["path"] == fresh["path"] and os.path.join(ROOT, "tests") not in seen["path"]


def _assert_refused(script, tmp_path, preload: str, why: str) -> None:
    """A server importing `preload` (a module in tmp_path) refuses to fork `script`, saying `why`."""
    env = clean_env(PYTHONPATH=os.pathsep.join([clean_env()["PYTHONPATH"], str(tmp_path)]))
    srv = _forked.Server(env, preload=preload)
    try:
        with pytest.raises(_forked.ForkRefused, match=why):
            srv.spawn(script=script, argv=[str(tmp_path), "ok"], env=env, cwd=str(tmp_path),
                      stdout=str(tmp_path / "log"), stderr=str(tmp_path / "log"))
    finally:
        srv.close()


def test_a_server_with_a_second_thread_refuses_to_fork(script, tmp_path):
    """A thread `threading` does not know (started by C code, here _thread) counts: /proc/self/task, not
    threading.active_count()."""
    (tmp_path / "threaded_preload.py").write_text(textwrap.dedent(f"""
        import _thread, threading, time
        _thread.start_new_thread(time.sleep, (600,))
        time.sleep(0.2)
        open({str(tmp_path / "active_count")!r}, "w").write(str(threading.active_count()))
        """))
    _assert_refused(script, tmp_path, "threaded_preload", "runs 2 threads")
    assert (tmp_path / "active_count").read_text() == "1"  # what a check through `threading` would have seen
    assert not (tmp_path / "rank_-1.json").exists()


def test_a_server_with_cuda_initialised_refuses_to_fork(script, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.init() in the server's preload)")
    (tmp_path / "cuda_preload.py").write_text("import torch\ntorch.cuda.init()\n")
    _assert_refused(script, tmp_path, "cuda_preload", "CUDA is initialised")


def test_a_spawned_process_can_be_signalled_and_reports_the_signal(script, tmp_path):
    log = str(tmp_path / "one.log")
    p = _forked.spawn(script, [str(tmp_path), "hang"], clean_env(), str(tmp_path), log, log)
    _wait_for(tmp_path / "rank_-1.json")
    assert p.wait(timeout=0.1) is None
    p.send_signal(9)
    assert p.wait(timeout=30) == -9


def test_requests_from_several_threads_at_once_all_start(script, tmp_path):
    """Processes spawned from different threads at once: requests that reach the server together are each
    served."""
    procs, errors = [], []

    def one(i):
        try:
            log = str(tmp_path / f"{i}.log")
            procs.append(_forked.spawn(script, [str(tmp_path), "ok"], clean_env(), str(tmp_path), log, log))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(procs) == 8
    # a hang guard, not a speed check: 8 ranks' exits took over a minute on a loaded 2-core machine
    assert [p.wait(timeout=300) for p in procs] == [0] * 8


def test_a_rank_outlives_its_server_without_pdeathsig(script, tmp_path):
    """The negative control of the next test: its check (the rank's lock freed) fails for a rank that cleared the
    death signal the launcher set, as it would for a launcher that set none."""
    env = clean_env()
    srv = _forked.Server(env, preload="json")
    log = str(tmp_path / "one.log")
    try:
        srv.spawn(script=script, argv=[str(tmp_path), "orphan"], env=env, cwd=str(tmp_path), stdout=log, stderr=log)
        _wait_for(tmp_path / "held")
        srv.proc.kill()
        srv.proc.wait()
        assert not _freed_within(tmp_path / "lock", 2.0)  # alive, its server gone
    finally:
        (tmp_path / "go").touch()  # it leaves by itself: nothing here signals a process it did not start
        srv.close()
    assert _freed_within(tmp_path / "lock", 60)


def test_a_rank_dies_with_its_server_and_the_next_launch_gets_a_new_server(script, tmp_path):
    log = str(tmp_path / "one.log")
    p = _forked.spawn(script, [str(tmp_path), "hold"], clean_env(), str(tmp_path), log, log)
    _wait_for(tmp_path / "held")
    server = _forked.server(0)
    assert not _lock_free(tmp_path / "lock")
    try:
        server.proc.kill()
        # the kernel ended the rank (PR_SET_PDEATHSIG): its lock is freed though no one was told to let it go
        assert _freed_within(tmp_path / "lock", 30)
    finally:
        (tmp_path / "go").touch()
    assert p.wait(timeout=30) == -9  # reported as the death signal, which the client never sends
    proc = _forked.run(script, [str(tmp_path), "ok"], 1, clean_env(), str(tmp_path), timeout=120)
    assert proc.returncode == 0 and _forked.server(0) is not server


def test_the_fork_server_is_used_on_linux_and_elsewhere_a_launch_runs_under_torchrun(script, tmp_path,
                                                                                     monkeypatch):
    assert _forked.AVAILABLE == sys.platform.startswith("linux")
    monkeypatch.setattr(_forked, "AVAILABLE", False)  # as on macOS: tests/_support.launch's choice
    for nproc, ranks in ((2, (0, 1)), (1, (-1,))):
        proc = launch(script, [str(tmp_path), "ok"], nproc, "fork", timeout=300)
        assert proc.returncode == 0, proc.stderr
        for r in ranks:
            seen = _seen(tmp_path, r)
            assert ("TORCHELASTIC_RUN_ID" in seen["env"]) == (nproc > 1)  # torchrun's ranks; one: plain python
            assert seen["ppid"] not in {srv.proc.pid for srv in _forked._servers.values()}
            os.remove(tmp_path / f"rank_{r}.json")
