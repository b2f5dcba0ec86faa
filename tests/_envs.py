"""Environments for the tests (importable as `_envs:<factory>` with tests/ on the path, as the tests run)."""
from __future__ import annotations

import time

from rlhf_engine.envs import Step


class Counting:
    """Two turns whatever the model says: turn 1 answers "ok" with reward 0.25, turn 2 ends with reward 1 plus a
    tenth of the response's length in characters (so rewards differ between samples)."""

    stop_strings = ()

    def __init__(self, row):
        self.row, self.turn = row, 0

    def reset(self):
        return None

    def step(self, response):
        self.turn += 1
        if self.turn == 1:
            return Step(" ok", 0.25, False)
        return Step(None, 1.0 + 0.1 * (len(response) % 7), True)


def counting(row):
    return Counting(row)


class Raising(Counting):
    def step(self, response):
        raise RuntimeError("the tool is broken")


def raising(row):
    return Raising(row)


class Hanging(Counting):
    def step(self, response):
        time.sleep(30)
        return Step(None, 0.0, True)


def hanging(row):
    return Hanging(row)


class Varying(Counting):
    """1 to 3 turns, by the prompt's length in characters: ranks and batches play different numbers of turns.
    Rewards depend on the responses."""

    def __init__(self, row):
        super().__init__(row)
        self.turns = 1 + len(row["prompt"]) % 3

    def step(self, response):
        self.turn += 1
        reward = 0.1 * (len(response) % 5)
        if self.turn >= self.turns:
            return Step(None, reward, True)
        return Step(f" obs{self.turn}", reward, False)


def varying(row):
    return Varying(row)


class BadStopStrings(Counting):
    stop_strings = 5  # not a sequence of strings: the episode runner's own step fails on it


def bad_stop_strings(row):
    return BadStopStrings(row)
