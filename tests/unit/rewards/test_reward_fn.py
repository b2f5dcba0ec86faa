import math
import sys
import types

import pytest

from rlhf_engine.rewards import RewardFunctionError, call_reward_fn, load_reward_fn


@pytest.fixture
def fake_module(monkeypatch):
    mod = types.ModuleType("fake_rewards")
    mod.length = lambda prompts, responses: [float(len(r)) for r in responses]
    mod.raises = lambda prompts, responses: 1 / 0
    mod.short = lambda prompts, responses: [1.0]
    mod.nan = lambda prompts, responses: [math.nan for _ in responses]
    mod.text = lambda prompts, responses: "abc"
    mod.not_callable = 3
    monkeypatch.setitem(sys.modules, "fake_rewards", mod)
    return mod


def test_loads_and_calls(fake_module):
    fn = load_reward_fn("fake_rewards:length")
    assert call_reward_fn(fn, ["p", "q"], ["abc", "hello"]) == [3.0, 5.0]


@pytest.mark.parametrize("spec, words", [
    ("no_colon", "expected 'module:function'"),
    ("missing_module_xyz:f", "cannot import 'missing_module_xyz'"),
    ("fake_rewards:absent", "no callable 'absent'"),
    ("fake_rewards:not_callable", "no callable 'not_callable'"),
])
def test_bad_specs_name_the_problem(fake_module, spec, words):
    with pytest.raises(ValueError, match="reward_fn") as e:
        load_reward_fn(spec)
    assert words in str(e.value)


@pytest.mark.parametrize("name, words", [
    ("raises", "fake_rewards:raises raised ZeroDivisionError"),
    ("short", "returned 1 values for 2 samples"),
    ("nan", "non-finite values for samples [0, 1]"),
    ("text", "must return a sequence of numbers, got str"),
])
def test_bad_answers_name_the_function(fake_module, name, words):
    fn = load_reward_fn(f"fake_rewards:{name}")
    with pytest.raises(RewardFunctionError) as e:
        call_reward_fn(fn, ["p", "q"], ["a", "b"])
    assert words in str(e.value)


def test_vader_ranks_sentiment():
    pytest.importorskip("vaderSentiment")
    fn = load_reward_fn("rlhf_engine.rewards.sentiment:vader_positive")
    pos, neg, neutral = call_reward_fn(fn, ["", "", ""], ["I loved it, wonderful!", "Terrible and awful.",
                                                          "It is a chair."])
    assert pos > 0.5 and neg < -0.5 and neutral == 0.0
