"""A reward function whose module is slow to import in a worker process (a verifier loading its toolchain), for the
--reward_workers start-up tests; the trainer's own process imports it at once."""
import multiprocessing
import os
import time

from _reward_fns import length_and_bonus

IMPORT_S = 2.0
if multiprocessing.parent_process() is not None:  # only in a spawned worker: the parent checks the spec quickly
    time.sleep(IMPORT_S)


def slow_import(prompts, responses, bonus):
    """`length_and_bonus`, except a response saying HANG sleeps for a minute and one saying PID scores the process
    id of the worker that scored it."""
    for r in responses:
        if "HANG" in r:
            time.sleep(60)
    if responses == ["PID"]:
        return [float(os.getpid())]
    return length_and_bonus(prompts, responses, bonus)
