"""The tests running now, in a file CI reads when it stops a run at its time limit (.ci/run): the pytest process
that holds every report (the xdist controller, or the only process) keeps `RUNNING_FILE` as JSON,
{node id: start time}, rewritten as each test starts and finishes (a test's module fixtures, a launch, set up inside
its start)."""
from __future__ import annotations

import json
import os
import time

RUNNING_FILE = "RLHF_ENGINE_TEST_RUNNING_FILE"  # .ci/run sets it

_running: dict = {}


def _write(path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_running, f)
    os.replace(tmp, path)  # a reader never sees half a file


def started(nodeid: str) -> None:
    path = os.environ.get(RUNNING_FILE)
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        _running[nodeid] = time.time()
        _write(path)


def finished(nodeid: str) -> None:
    path = os.environ.get(RUNNING_FILE)
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        _running.pop(nodeid, None)
        _write(path)


def describe(path: str, now: float) -> str:
    """The tests running as `path` records them, each with how long it has run ('' when none or no file)."""
    try:
        with open(path) as f:
            running = json.load(f)
    except (OSError, ValueError):
        return ""
    return "\n".join(f"  {nodeid} (running for {now - t:.0f} s)" for nodeid, t in sorted(running.items(),
                                                                                    key=lambda kv: kv[1]))


if __name__ == "__main__":  # .ci/run: python tests/_running.py FILE
    import sys

    print(describe(sys.argv[1], time.time()) or "  (no test was running)")
