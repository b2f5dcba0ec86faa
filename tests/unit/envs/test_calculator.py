"""The calculator environment of the multi-turn example: tool calls, exact arithmetic, the final answer's reward."""
from fractions import Fraction

import pytest

from rlhf_engine.envs import Step
from rlhf_engine.envs.calculator import evaluate, make_env, tool_call


@pytest.mark.parametrize("response, expression", [
    ("First, 20 * 48 + 18 =", "20 * 48 + 18"),
    ("(20 * 48) + 18 =", "(20 * 48) + 18"),
    ("I use <calc>20*48+18</calc>", "20*48+18"),
    ("The answer is 978.", None),
    ("so x =", None),  # no expression before the =
    ("so 20 =", None),  # a number is not a calculation
])
def test_tool_calls(response, expression):
    assert tool_call(response) == expression


def test_exact_arithmetic_and_refusals():
    assert evaluate("37 * 24 + 19") == 907
    assert evaluate("(1 + 2) / 4") == Fraction(3, 4)
    assert evaluate("0.1 + 0.2") == Fraction(3, 10)
    for bad in ("__import__('os')", "2 ** 8", "1 / 0", "9" * 20 + " * " + "9" * 20):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_an_episode_by_hand():
    env = make_env({"answer": "978", "prompt": "What is 20 * 48 + 18?"})
    assert env.reset() is None
    assert env.step("20 * 48 + 18 =") == Step("978", 0.0, False)
    assert env.step("The answer is 978.") == Step(None, 1.0, True)
    assert make_env({"answer": "978"}).step("It is 977") == Step(None, 0.0, True)
    assert make_env({"answer": "1"}).step("<calc>1/0</calc>").observation == "error: division by zero"
    with pytest.raises(KeyError, match="answer"):
        make_env({"prompt": "no answer column"})
