"""How scripts/test.sh spreads the default suite over two pytest-xdist processes (tests/conftest.py): whole files per
process, and every file that takes part in the shared PPO launches (SharedHarness) in one of them. A file missed by
that scan would run in the other process, whose SharedHarness would start the shared launches a second time."""
import ast
import glob
import os

import importlib.util

import pytest

from _support import ROOT


def _root_conftest():
    # by its path: the module name "conftest" belongs to whichever conftest.py the session imported first
    spec = importlib.util.spec_from_file_location("_root_conftest", os.path.join(ROOT, "tests", "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


conftest = _root_conftest()


def _declares_harness_runs(path: str) -> bool:
    with open(path) as f:
        tree = ast.parse(f.read())
    return any(isinstance(n, ast.FunctionDef) and n.name == "harness_runs" for n in tree.body)


def test_every_file_of_the_shared_launches_is_found():
    files = glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
    declared = {os.path.relpath(p, ROOT).replace(os.sep, "/") for p in files if _declares_harness_runs(p)}
    assert "tests/distributed/test_ppo_trainer.py" in declared and len(declared) >= 2
    assert conftest._shared_launch_files() == declared


def test_the_shared_files_share_one_scope_and_the_others_keep_their_own():
    pytest.importorskip("xdist")

    class Config:  # what the scheduler reads of pytest's config under `-n 2 --dist loadfile`
        def getvalue(self, name):
            return {"dist": "loadfile", "tx": ["2*popen"]}[name]

    sched = conftest.pytest_xdist_make_scheduler(Config(), log=None)
    assert sched is not None
    shared = sorted(conftest._shared_launch_files())
    scopes = {sched._split_scope(f"{path}::test_x[a]") for path in shared}
    assert len(scopes) == 1
    assert sched._split_scope("tests/unit/test_rollout.py::test_y") == "tests/unit/test_rollout.py"
