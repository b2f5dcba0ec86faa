"""--reward_workers: a reward function in spawned worker processes, one call per response with a timeout; the real
failure modes (a call that hangs past the timeout, a process that aborts, a function that raises); a worker's
start-up (spawn and a slow import) is never counted against a call's timeout."""
import logging
import time

import pytest

from rlhf_engine.rewards import ParallelReward, RewardFunctionError, call_reward_fn, load_reward_fn

from _reward_fns import length_and_bonus

PROMPTS = [f"prompt {i}" for i in range(7)]
RESPONSES = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g"]
BONUS = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5]


@pytest.fixture(scope="module")
def pool():
    p = ParallelReward("_reward_fns:misbehaving", workers=2, timeout_s=3.0, on_error=-1.0)
    yield p
    p.close()


def test_scores_keep_their_order_and_equal_the_serial_call(pool):
    serial = call_reward_fn(load_reward_fn("_reward_fns:length_and_bonus"), PROMPTS, RESPONSES, {"bonus": BONUS})
    assert pool(PROMPTS, RESPONSES, bonus=BONUS) == serial == length_and_bonus(PROMPTS, RESPONSES, BONUS)


def test_a_hung_a_crashed_and_a_raising_call_score_on_error_and_the_pool_recovers(pool):
    responses = ["ok", "HANG", "fine", "CRASH", "RAISE", "last"]
    t = time.monotonic()
    scores = pool(PROMPTS[:6], responses, bonus=BONUS[:6])
    took = time.monotonic() - t
    assert scores == [2.5, -1.0, 6.5, -1.0, -1.0, 9.5]
    assert took < 3.0 + 8, took  # the hung call was cut at its timeout, not after its minute
    assert pool(PROMPTS, RESPONSES, bonus=BONUS) == length_and_bonus(PROMPTS, RESPONSES, BONUS)  # fresh workers


def test_stop_names_the_row_and_why():
    p = ParallelReward("_reward_fns:misbehaving", workers=2, timeout_s=2.0)  # on_error None: stop
    try:
        with pytest.raises(RewardFunctionError, match=r"failed on 1 of 3 responses; row 1 .*'prompt 1' -> 'CRASH'.*"
                                                      r"worker process died \(exit code -6\).*--reward_on_error"):
            p(PROMPTS[:3], ["x", "CRASH", "y"], bonus=BONUS[:3])
        with pytest.raises(RewardFunctionError, match=r"row 0 .*timed out after 2 s \(--reward_timeout_s\)"):
            p(PROMPTS[:2], ["HANG", "y"], bonus=BONUS[:2])
    finally:
        p.close()


def test_the_wrapped_functions_columns_are_asked_for():
    from rlhf_engine.rewards import reward_signature

    p = ParallelReward("_reward_fns:length_and_bonus", workers=1)
    assert reward_signature(p).required == ("bonus",)
    p.close()


@pytest.fixture(scope="module")
def slow():
    """Two workers whose import takes 2 s (_slow_reward.IMPORT_S), each call limited to 1 s."""
    p = ParallelReward("_slow_reward:slow_import", workers=2, timeout_s=1.0, on_error=-1.0)
    yield p
    p.close()


def test_a_slow_import_is_not_counted_against_a_call(slow):
    # Negative control: on the code before this fix (the worker spawned at the first call, the clock started as
    # the row was sent) every row timed out during the import and scored -1.0.
    assert slow(PROMPTS, RESPONSES, bonus=BONUS) == length_and_bonus(PROMPTS, RESPONSES, BONUS)
    assert slow.take_counts() == {"worker_timeouts": 0, "worker_restarts": 0}


def test_a_hung_row_times_out_once_and_its_successor_is_warm_before_its_next_call(slow, caplog):
    slow.warm()
    slow.take_counts()  # this test's counts only
    first = {w.process.pid for w in slow._pool}
    with caplog.at_level(logging.WARNING, logger="rlhf_engine.rewards.workers"):
        scores = slow(PROMPTS[:4], ["a", "HANG", "bb", "ccc"], bonus=BONUS[:4])
    assert scores == [1.5, -1.0, 4.5, 6.5]
    assert slow.take_counts() == {"worker_timeouts": 1, "worker_restarts": 1}
    assert "row 1 of this rank's batch ('prompt 1' -> 'HANG') timed out after 1 s" in caplog.text
    # The next call hands one row to each worker at once; the successor's 2 s import would overrun the 1 s limit
    # (score -1.0, a second timeout) had it been handed a row before its handshake.
    pids = slow(PROMPTS[:2], ["PID", "PID"], bonus=BONUS[:2])
    assert -1.0 not in pids and len(set(pids)) == 2
    assert len(set(pids) - first) == 1, (pids, first)  # one of the two rows was the successor's
    assert slow.take_counts() == {"worker_timeouts": 0, "worker_restarts": 0}


def test_a_worker_that_cannot_import_the_function_is_a_start_up_error(tmp_path, monkeypatch):
    """The module imports in the trainer's process but raises in a spawned one: one error naming the function and
    the flag, before any row is scored."""
    (tmp_path / "_parent_only.py").write_text(
        "import multiprocessing\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    raise ImportError('the verifier toolchain is missing')\n"
        "def score(prompts, responses):\n"
        "    return [1.0] * len(responses)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = ParallelReward("_parent_only:score", workers=1, timeout_s=1.0, on_error=-1.0)
    try:
        with pytest.raises(RewardFunctionError, match=r"_parent_only:score: a worker process \(--reward_workers\) "
                                                      r"failed while importing it: .*ImportError: the verifier"):
            p(["p"], ["r"])
        assert p._pool == []
    finally:
        p.close()
