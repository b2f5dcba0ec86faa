"""The tests' fork launcher (tests/_forked.py) starts ranks the way torchrun would and ends them the way a script
ends, so that the multi-rank tests that use it check what they would check under torchrun: each rank is its own
process with the rank variables and exactly the given environment and working directory, the script runs as
`__main__` with its argv and its folder first on sys.path, and it leaves through the interpreter's exit (non-daemon
threads joined, atexit handlers run, an exception or `sys.exit("...")` printed and exit 1). The first failing rank's
code is the launch's and ends the others; a timeout kills them; a rank dies with its server."""
import json
import os
import subprocess
import textwrap
import threading
import time

import pytest

import _forked
from _support import clean_env

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    rank = int(os.environ.get("RANK", -1))
    out, mode = sys.argv[1], sys.argv[2]
    atexit.register(lambda: open(os.path.join(out, f"atexit_{rank}"), "w").close())
    with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "name": __name__, "file": __file__, "argv": sys.argv, "cwd": os.getcwd(),
                   "path0": sys.path[0], "env": dict(os.environ)}, f)
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


def test_ranks_start_as_torchrun_would_start_them(script, tmp_path, monkeypatch):
    monkeypatch.setenv("FORKED_TEST_NOT_GIVEN", "1")
    env = {k: v for k, v in clean_env(FORKED_TEST_MARKER="m").items() if k != "FORKED_TEST_NOT_GIVEN"}
    proc = _forked.run(script, [str(tmp_path), "ok"], 2, env, str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["hello from rank 0", "hello from rank 1"]
    ranks = [_seen(tmp_path, r) for r in (0, 1)]
    assert ranks[0]["pid"] != ranks[1]["pid"] and os.getpid() not in (ranks[0]["pid"], ranks[1]["pid"])
    port = ranks[0]["env"]["MASTER_PORT"]
    for r, seen in enumerate(ranks):
        # exactly the given environment and torchrun's rank variables: nothing of the server's or this process's
        assert seen["env"] == {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        assert (seen["name"], seen["file"], seen["argv"]) == ("__main__", script, [script, str(tmp_path), "ok"])
        assert (seen["cwd"], seen["path0"]) == (str(tmp_path), os.path.dirname(script))
        assert (tmp_path / f"atexit_{r}").exists()


def test_one_rank_gets_no_rank_variables_as_under_plain_python(script, tmp_path):
    env = clean_env()
    proc = _forked.run(script, [str(tmp_path), "ok"], 1, env, str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _seen(tmp_path, -1)["env"] == env


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


def test_a_variable_read_at_import_cannot_differ_from_the_server_s(script, tmp_path):
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        _forked.run(script, [str(tmp_path), "ok"], 2, clean_env(OMP_NUM_THREADS="2"), str(tmp_path), timeout=120)


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
    assert [p.wait(timeout=60) for p in procs] == [0] * 8


def test_a_rank_dies_with_its_server_and_the_next_launch_gets_a_new_server(script, tmp_path):
    log = str(tmp_path / "one.log")
    p = _forked.spawn(script, [str(tmp_path), "hang"], clean_env(), str(tmp_path), log, log)
    _wait_for(tmp_path / "rank_-1.json")
    server = _forked.client()
    server.proc.kill()
    assert p.wait(timeout=30) == -9
    deadline = time.monotonic() + 30
    while not _gone(p.pid) and time.monotonic() < deadline:  # PR_SET_PDEATHSIG, not an orphan left running
        time.sleep(0.05)
    assert _gone(p.pid)
    proc = _forked.run(script, [str(tmp_path), "ok"], 1, clean_env(), str(tmp_path), timeout=120)
    assert proc.returncode == 0 and _forked.client() is not server
