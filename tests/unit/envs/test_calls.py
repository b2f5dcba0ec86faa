"""Environment calls in threads: results in order, errors named, a hung call abandoned after its timeout; abandoned
threads counted, and bounded by --env_max_abandoned_calls."""
import threading
import time

import pytest

from rlhf_engine.envs.calls import EnvCalls, TooManyAbandonedCalls


def test_results_errors_and_a_timeout():
    calls = EnvCalls(workers=2, timeout_s=0.5, max_abandoned=16)
    release = threading.Event()

    def boom():
        raise KeyError("no tool")

    t0 = time.monotonic()
    out = calls.run([lambda: 1, boom, lambda: release.wait(10) and 3, lambda: 4])
    took = time.monotonic() - t0
    assert out[0].value == 1 and out[0].error is None
    assert out[1].error.startswith("KeyError")
    assert "timed out after 0.5 s" in out[2].error
    assert out[3].value == 4
    assert took < 3.0, took  # not the hung call's 10 s
    # the pool keeps its width: a fresh thread replaced the abandoned one
    out = calls.run([lambda: 5, lambda: 6])
    assert [o.value for o in out] == [5, 6]
    release.set()


def test_calls_run_in_parallel():
    calls = EnvCalls(workers=4, timeout_s=5, max_abandoned=16)
    t0 = time.monotonic()
    out = calls.run([lambda: time.sleep(0.4) or i for i in range(4)])
    assert [o.error for o in out] == [None] * 4
    assert time.monotonic() - t0 < 1.2  # 4 x 0.4 s in sequence would be 1.6 s


def test_abandoned_calls_are_counted_and_leave_when_their_call_returns():
    calls = EnvCalls(workers=2, timeout_s=0.2, max_abandoned=4)
    release = threading.Event()
    out = calls.run([lambda: release.wait(10) and 1, lambda: release.wait(10) and 2, lambda: 3])
    assert [o.error is not None for o in out] == [True, True, False] and out[2].value == 3
    assert calls.abandoned == 2 and calls.abandoned_alive == 2
    threads = threading.active_count()
    release.set()  # the hung calls return: their threads leave, the pool stays at its width of 2
    deadline = time.monotonic() + 10
    while calls.abandoned_alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.abandoned_alive == 0 and calls.abandoned == 2  # `abandoned` is cumulative
    while threading.active_count() > threads - 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == threads - 2
    assert [o.value for o in calls.run([lambda: 5, lambda: 6])] == [5, 6]


def test_past_the_limit_of_abandoned_threads_run_stops_naming_both_flags():
    calls = EnvCalls(workers=2, timeout_s=0.2, max_abandoned=2)
    release = threading.Event()
    try:
        out = calls.run([lambda: release.wait(10)] * 2)  # two left running: at the limit, not past it
        assert all("timed out" in o.error for o in out) and calls.abandoned_alive == 2
        with pytest.raises(TooManyAbandonedCalls, match=r"3 environment calls that ran past --env_timeout_s "
                                                        r"\(0.2 s\) are still running.*--env_max_abandoned_calls "
                                                        r"\(2\)"):
            calls.run([lambda: release.wait(10), lambda: 7])
        assert calls.abandoned == 3
        with pytest.raises(TooManyAbandonedCalls):  # and at the next call, before anything runs
            calls.run([lambda: 8])
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while calls.abandoned_alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [o.value for o in calls.run([lambda: 9])] == [9]  # they came back: under the limit again


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_env_max_abandoned_calls_must_be_a_whole_number(value):
    from rlhf_engine.config.env import EnvConfig
    from rlhf_engine.errors import Problems

    p = Problems()
    EnvConfig(environment="m:f", env_max_abandoned_calls=value).validate(p)
    assert [x.field for x in p] == ["env_max_abandoned_calls"] and "whole number >= 0" in p[0].fix
    ok = Problems()
    EnvConfig(environment="m:f", env_max_abandoned_calls=0).validate(ok)
    assert not ok  # 0 is allowed: stop at the first call left running
