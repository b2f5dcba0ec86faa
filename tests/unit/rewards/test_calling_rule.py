"""The calling rule of reward functions: which data columns a function declares, and how it is called."""
import math
import sys
import types

import pytest

from rlhf_engine.rewards import RewardFunctionError, call_reward_fn, load_reward_fn, reward_signature


def plain(prompts, responses):
    return [1.0] * len(responses)


def needs_answer(prompts, responses, answer, level=None):
    return [float(r == a) for r, a in zip(responses, answer)]


def takes_all(prompts, responses, **columns):
    return [float(len(columns))] * len(responses)


def keyword_only(prompts, responses, *, answer):
    return [0.0] * len(responses)


def test_signatures():
    assert reward_signature(plain).legacy
    s = reward_signature(needs_answer)
    assert (s.required, s.optional, s.all_columns, s.legacy) == (("answer",), ("level",), False, False)
    s = reward_signature(takes_all)
    assert (s.required, s.optional, s.all_columns, s.legacy) == ((), (), True, False)
    assert reward_signature(keyword_only).required == ("answer",)
    assert reward_signature(lambda prompts, responses: []).legacy


@pytest.fixture
def module(monkeypatch):
    mod = types.ModuleType("calling_rule_rewards")
    mod.one_arg = lambda responses: [0.0]
    mod.needs_answer = needs_answer

    def positional_only(prompts, responses, answer, /):
        return [0.0]
    mod.positional_only = positional_only
    monkeypatch.setitem(sys.modules, "calling_rule_rewards", mod)
    return mod


@pytest.mark.parametrize("name, words", [("one_arg", "takes 1 positional parameter"),
                                         ("positional_only", "positional-only")])
def test_unusable_signatures_are_load_errors(module, name, words):
    with pytest.raises(ValueError, match=words) as e:
        load_reward_fn(f"calling_rule_rewards:{name}")
    assert f"calling_rule_rewards:{name}" in str(e.value)


def test_columns_are_passed_by_name(module):
    fn = load_reward_fn("calling_rule_rewards:needs_answer")
    assert call_reward_fn(fn, ["p", "q", "r"], ["4", "5", "x"], {"answer": ["4", "6", "x"]}) == [1.0, 0.0, 1.0]
    assert call_reward_fn(takes_all, ["p"], ["a"], {"answer": ["1"], "level": [2]}) == [2.0]
    assert call_reward_fn(plain, ["p"], ["a"]) == [1.0]  # two arguments: called as before


def test_failures_name_the_function_and_the_call():
    def boom(prompts, responses, answer):
        raise KeyError("gold")

    with pytest.raises(RewardFunctionError, match=r"boom raised KeyError.*fn\(prompts, responses, answer=\[\.\.\.\]\)"):
        call_reward_fn(boom, ["p"], ["a"], {"answer": ["1"]})
    with pytest.raises(RewardFunctionError, match="returned 1 values for 2 samples"):
        call_reward_fn(lambda p, r, answer: [0.0], ["p", "q"], ["a", "b"], {"answer": ["1", "2"]})
    with pytest.raises(RewardFunctionError, match=r"non-finite values for samples \[1\]"):
        call_reward_fn(lambda p, r, answer: [0.0, math.nan], ["p", "q"], ["a", "b"], {"answer": ["1", "2"]})
    with pytest.raises(RewardFunctionError, match="missing 1 required"):  # a column it needs was not given
        call_reward_fn(needs_answer, ["p"], ["a"], {})
