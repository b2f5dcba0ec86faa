"""Environment calls in threads: results in order, errors named, a hung call abandoned after its timeout."""
import threading
import time

from rlhf_engine.envs.calls import EnvCalls


def test_results_errors_and_a_timeout():
    calls = EnvCalls(workers=2, timeout_s=0.5)
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
    calls = EnvCalls(workers=4, timeout_s=5)
    t0 = time.monotonic()
    out = calls.run([lambda: time.sleep(0.4) or i for i in range(4)])
    assert [o.error for o in out] == [None] * 4
    assert time.monotonic() - t0 < 1.2  # 4 x 0.4 s in sequence would be 1.6 s
