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


class RankVarying(Varying):
    """Varying, by rank (the RANK variable): on rank 0 1 or 2 turns by the prompt's length, on the other ranks 3, so
    in every generation batch the ranks' longest episodes differ and rank 0 makes throw-away calls."""

    def __init__(self, row):
        import os

        super().__init__(row)
        self.turns = 1 + len(row["prompt"]) % 2 if os.environ.get("RANK", "0") == "0" else 3


def rank_varying(row):
    return RankVarying(row)


class BadStopStrings(Counting):
    stop_strings = 5  # not a sequence of strings: the episode runner's own step fails on it


def bad_stop_strings(row):
    return BadStopStrings(row)


class RoomHungry(Counting):
    """Two turns; turn 1's observation is long (LONG_OBSERVATION words) for prompts of an even length in
    characters, short for the others: with max_episode_tokens just above turn 1 + the long observation, the
    long-observation rows have a few tokens of room for turn 2 and the others a whole turn. Turn 2 ends with a
    reward of a tenth of the response's length in characters (mod 7)."""

    LONG_OBSERVATION = 6

    def __init__(self, row):
        super().__init__(row)
        self.long = len(row["prompt"]) % 2 == 0

    def step(self, response):
        self.turn += 1
        if self.turn == 1:
            return Step(" x" * self.LONG_OBSERVATION if self.long else " ok", 0.25, False)
        return Step(None, 0.1 * (len(response) % 7), True)


def room_hungry(row):
    return RoomHungry(row)


class RankSplit(Counting):
    """On rank 0 (the RANK variable) the episode fills its budget: turn 1 gets an observation as long as a turn
    (FILL words, one token each for the tiny tokenizer), so turn 2 ends exactly at max_episode_tokens = 2 turns +
    FILL; on the other ranks observations are one word and episodes play on to turn 3. Under ZeRO-3 rank 0 then keeps
    its peer company while its contexts sit at the end of the positions checked at start-up."""

    FILL = 4

    def __init__(self, row):
        import os

        super().__init__(row)
        self.fills = int(os.environ.get("RANK", "0")) == 0

    def step(self, response):
        self.turn += 1
        if self.turn >= 3:
            return Step(None, 1.0, True)
        return Step(" x" * self.FILL if self.fills else " ok", 0.25, False)


def rank_split(row):
    return RankSplit(row)


class Recording(Counting):
    """Two turns, as Counting, and every response it is sent kept in SENT[prompt] (the tests read what the
    environment saw); its stop strings come from the row's `stop` column when the row has one."""

    SENT: dict = {}

    def __init__(self, row):
        super().__init__(row)
        self.stop_strings = tuple(row.get("stop") or ())

    def step(self, response):
        self.SENT.setdefault(self.row["prompt"], []).append(response)
        return super().step(response)


def recording(row):
    return Recording(row)


def raising_on_rank_one(row):
    """Raising on rank 1 (the RANK variable), Counting elsewhere: an environment failure one rank alone sees."""
    import os

    return Raising(row) if os.environ.get("RANK", "0") == "1" else Counting(row)
