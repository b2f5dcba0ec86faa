"""Reward functions for the reward-source tests, importable by 'module:function' in worker processes (spawned
workers get this test session's sys.path)."""
import os
import time


def length_and_bonus(prompts, responses, bonus):
    """Scores each response on its own: its length in characters plus the row's `bonus` column."""
    return [len(r) + float(b) for r, b in zip(responses, bonus)]


def misbehaving(prompts, responses, bonus):
    """`length_and_bonus`, except a response saying HANG sleeps for a minute, CRASH aborts the process (SIGABRT, as
    a segfaulting verifier would die) and RAISE raises."""
    for r in responses:
        if "HANG" in r:
            time.sleep(60)
        if "CRASH" in r:
            os.abort()
        if "RAISE" in r:
            raise ValueError("the verifier could not parse this one")
    return length_and_bonus(prompts, responses, bonus)
