"""CI stops itself at its time limit naming the tests running then (.ci/run, scripts/ci_job.sh, tests/_running.py):
the pytest process that holds the reports keeps the running tests in a file; the job past its time is stopped, its
whole process group with it, and the file's tests are named."""
import json
import os
import subprocess
import sys
import time

from _running import RUNNING_FILE, describe
from _support import ROOT


def test_a_pytest_session_keeps_its_running_tests_in_the_file(tmp_path):
    running = tmp_path / "running.json"
    (tmp_path / "test_probe.py").write_text(
        "import json, os\n"
        "def test_sees_itself():\n"
        f"    assert list(json.load(open({str(running)!r}))) == ['test_probe.py::test_sees_itself']\n")
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n"
        "from _running import started, finished\n"
        "def pytest_runtest_logstart(nodeid, location):\n    started(nodeid)\n"
        "def pytest_runtest_logfinish(nodeid, location):\n    finished(nodeid)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
                          cwd=tmp_path, env={**env, RUNNING_FILE: str(running)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    assert json.loads(running.read_text()) == {}  # finished: nothing running at the end


def test_a_job_past_its_time_is_stopped_naming_the_running_tests(tmp_path):
    running = tmp_path / "running.json"
    running.write_text(json.dumps({"tests/distributed/test_x.py::test_hangs": time.time() - 100}))
    env = {**os.environ, RUNNING_FILE: str(running)}
    # the command leaves a child of its own: the stop must take the whole group
    done = subprocess.run(["bash", "scripts/ci_job.sh", "demo job", "1", "bash", "-c",
                           "sleep 61 & sleep 62; echo never"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 124 and "never" not in done.stdout, (done.returncode, done.stdout)
    assert "stopped the demo job after 1 s" in done.stderr, done.stderr
    assert "tests/distributed/test_x.py::test_hangs (running for 10" in done.stderr, done.stderr
    assert subprocess.run(["pgrep", "-f", "sleep 61"], capture_output=True).returncode == 1  # the child is gone too
    # the control: a job within its time exits as its command did, naming nothing
    ok = subprocess.run(["bash", "scripts/ci_job.sh", "demo job", "30", "bash", "-c", "exit 3"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 3 and "stopped" not in ok.stderr
    assert describe(str(tmp_path / "missing"), time.time()) == ""
