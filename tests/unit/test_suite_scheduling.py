"""How scripts/test.sh spreads the default suite over two pytest-xdist processes (tests/conftest.py): whole files per
process, and every file that takes part in the shared PPO launches (SharedHarness) in one of them. A file missed by
that scan, or a scheduler that xdist stopped consulting, would run some of those files in the other process, whose
SharedHarness would start the shared launches a second time. Checked through xdist itself: a tiny suite under the
project's conftest, run with `pytest -n 2`."""
import ast
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from _support import ROOT


def _root_conftest():
    # by its path: the module name "conftest" belongs to whichever conftest.py the session imported first
    spec = importlib.util.spec_from_file_location("_root_conftest", os.path.join(ROOT, "tests", "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _declares_harness_runs(path: str) -> bool:
    with open(path) as f:
        tree = ast.parse(f.read())
    return any(isinstance(n, ast.FunctionDef) and n.name == "harness_runs" for n in tree.body)


def test_every_file_of_the_shared_launches_is_found():
    files = glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
    declared = {os.path.relpath(p, ROOT).replace(os.sep, "/") for p in files if _declares_harness_runs(p)}
    assert "tests/distributed/test_ppo_trainer.py" in declared and len(declared) >= 2
    assert _root_conftest()._shared_launch_files() == declared


# The session fixture stands for SharedHarness: each pytest process that uses it starts "the launch" once
ROOT_CONFTEST = textwrap.dedent("""
    import os
    import pytest

    @pytest.fixture(scope="session")
    def shared_launch():
        with open(os.path.join(os.path.dirname(__file__), "launches"), "a") as f:
            f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    """)

TEST_FILE = textwrap.dedent("""
    import os
    import pytest
    {harness}

    @pytest.mark.parametrize("i", range({n}))
    def test_it(request, i):
        {use}
        with open(os.path.join(str(request.config.rootpath), "ran"), "a") as f:
            f.write(f"{{request.node.nodeid}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
    """)

SHARED = ("tests/distributed/test_shared_a.py", "tests/unit/test_shared_b.py")  # the two largest: see below


def _tiny_suite(root) -> None:
    """The project's tests/conftest.py, unchanged, over 2 files of shared launches (in two folders) and 2 others.
    The shared ones are the largest, so that xdist's own scheduling (largest scope first, one per process) gives
    them one process each: only the project's scheduler keeps them together."""
    (root / "pytest.ini").write_text("[pytest]\naddopts =\n")  # not the project's (its testpaths, options)
    (root / "conftest.py").write_text(ROOT_CONFTEST)
    (root / "tests" / "distributed").mkdir(parents=True)
    (root / "tests" / "unit").mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), root / "tests" / "conftest.py")
    for path in SHARED:
        (root / path).write_text(TEST_FILE.format(harness="\n\ndef harness_runs(tiny, tmp):\n    return {}\n", n=3,
                                                  use="request.getfixturevalue('shared_launch')"))
    for path in ("tests/unit/test_other_c.py", "tests/unit/test_other_d.py"):
        (root / path).write_text(TEST_FILE.format(harness="", n=1, use="pass"))


def _run(root, dist: str) -> tuple:
    """`pytest -n 2 --dist <dist>` on the tiny suite: {test file: workers it ran in}, and the workers that started
    the launch."""
    _tiny_suite(root)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "RLHF_ENGINE_TEST_"))}  # not this session's worker, CI's running file
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])  # the conftest's own imports
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", dist, "-p", "no:cacheprovider",
                           "-q", "-c", str(root / "pytest.ini"), "--rootdir", str(root), "tests"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    workers: dict = {}
    for line in (root / "ran").read_text().splitlines():
        nodeid, worker = line.split()
        workers.setdefault(nodeid.split("::")[0], set()).add(worker)
    assert sum(1 for _ in (root / "ran").read_text().splitlines()) == 8  # every test ran, once
    return workers, (root / "launches").read_text().split()


def test_under_xdist_the_shared_files_run_in_one_process_and_the_launch_starts_once(tmp_path):
    pytest.importorskip("xdist")
    workers, launches = _run(tmp_path, "loadfile")
    assert len(launches) == 1  # one process used the shared launch
    assert workers[SHARED[0]] == workers[SHARED[1]] == set(launches)
    assert len(set().union(*workers.values())) == 2  # two processes ran tests: the other files went elsewhere


def test_without_the_project_s_scheduler_xdist_splits_them(tmp_path):
    """The negative control: under `--dist loadscope` the conftest's scheduler steps aside (it acts on loadfile
    only), xdist's own scopes are the files, and the two shared files run in two processes, each starting the
    launch."""
    pytest.importorskip("xdist")
    workers, launches = _run(tmp_path, "loadscope")
    assert sorted(launches) == ["gw0", "gw1"]
    assert workers[SHARED[0]] != workers[SHARED[1]]
