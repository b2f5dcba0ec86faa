"""The tests' fork launcher (tests/_forked.py) starts ranks the way torchrun would, so that the multi-rank tests
that use it check what they would check under torchrun: each rank is its own process with the rank variables, the
given environment and working directory, the script run as `__main__` with its argv, its folder first on sys.path,
its atexit handlers run; the first failing rank's code is the launch's and ends the others; a timeout kills them."""
import json
import os
import subprocess
import textwrap
import time

import pytest

import _forked
from _support import clean_env

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, time
    rank = int(os.environ.get("RANK", -1))
    out, mode = sys.argv[1], sys.argv[2]
    atexit.register(lambda: open(os.path.join(out, f"atexit_{rank}"), "w").close())
    with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "name": __name__, "file": __file__, "argv": sys.argv, "cwd": os.getcwd(),
                   "path0": sys.path[0], "marker": os.environ.get("FORKED_TEST_MARKER"),
                   "leaked": os.environ.get("FORKED_TEST_NOT_GIVEN"),
                   "vars": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                           "MASTER_ADDR", "MASTER_PORT")}}, f)
    print(f"hello from rank {rank}", flush=True)
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


def test_ranks_start_as_torchrun_would_start_them(script, tmp_path, monkeypatch):
    monkeypatch.setenv("FORKED_TEST_NOT_GIVEN", "1")  # in this process, not in the environment the ranks get
    env = {k: v for k, v in clean_env(FORKED_TEST_MARKER="m").items() if k != "FORKED_TEST_NOT_GIVEN"}
    proc = _forked.run(script, [str(tmp_path), "ok"], 2, env, str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["hello from rank 0", "hello from rank 1"]
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["pid"] != ranks[1]["pid"] and os.getpid() not in (ranks[0]["pid"], ranks[1]["pid"])
    port = ranks[0]["vars"]["MASTER_PORT"]
    for r, seen in enumerate(ranks):
        assert seen["vars"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        assert (seen["name"], seen["file"], seen["argv"]) == ("__main__", script, [script, str(tmp_path), "ok"])
        assert (seen["cwd"], seen["path0"]) == (str(tmp_path), os.path.dirname(script))
        assert (seen["marker"], seen["leaked"]) == ("m", None)
        assert (tmp_path / f"atexit_{r}").exists()


def test_one_rank_gets_no_rank_variables_as_under_plain_python(script, tmp_path):
    proc = _forked.run(script, [str(tmp_path), "ok"], 1, clean_env(), str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((tmp_path / "rank_-1.json").read_text())
    assert set(seen["vars"].values()) == {None}


def test_the_first_failing_rank_ends_the_launch_with_its_code(script, tmp_path):
    t0 = time.monotonic()
    proc = _forked.run(script, [str(tmp_path), "fail"], 2, clean_env(), str(tmp_path), timeout=120)
    assert proc.returncode == 7
    assert time.monotonic() - t0 < 60  # rank 0 (asleep for 600 s) was ended, not waited for
    pid = json.loads((tmp_path / "rank_0.json").read_text())["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_timeout_kills_every_rank_and_raises_as_subprocess_run_does(script, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as err:
        _forked.run(script, [str(tmp_path), "hang"], 2, clean_env(), str(tmp_path), timeout=5)
    assert "hello from rank" in err.value.output
    for r in (0, 1):
        with pytest.raises(ProcessLookupError):
            os.kill(json.loads((tmp_path / f"rank_{r}.json").read_text())["pid"], 0)


def test_a_spawned_process_can_be_signalled_and_reports_the_signal(script, tmp_path):
    log = str(tmp_path / "one.log")
    p = _forked.spawn(script, [str(tmp_path), "hang"], clean_env(), str(tmp_path), log, log)
    deadline = time.monotonic() + 60
    while not (tmp_path / "rank_-1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.wait(timeout=0.1) is None
    p.send_signal(9)
    assert p.wait(timeout=30) == -9


def test_requests_from_several_threads_at_once_all_start(script, tmp_path):
    """Ranks and rollout workers are spawned from different threads: requests that reach the server together are
    each served."""
    import threading

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
