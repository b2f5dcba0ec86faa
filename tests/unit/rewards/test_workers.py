"""--reward_workers: a reward function in spawned worker processes, one call per response with a timeout; the real
failure modes (a call that hangs past the timeout, a process that aborts, a function that raises)."""
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
