"""A calculator tool environment: a turn that ends in a tool call gets the value back as the next message; a turn
without one is the final answer, scored against the row's `answer` column.

    --environment rlhf_engine.envs.calculator:make_env   (data rows with an `answer` column)

Two ways to call it, both ending the model's turn (`stop_strings`): `<calc>12*7</calc>`, or an expression followed
by `=` ("12 * 7 =", the way a small model writes a calculation anyway). The answer is the value alone ("84").
Reward: 1 when the final answer equals the row's answer (`rewards.math_answer.exact_answer` reads it: the last number,
or a marked one), else 0, and 0 for an episode that runs out of turns while still calling the tool. There is no bonus
for calling the tool: calls become more frequent only because they are the way to be right.
"""
from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Any, Optional

from ..rewards.math_answer import exact_answer
from .base import Step

_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_ARITHMETIC = set("0123456789 \t\n.+-*/×÷()")
_OPERATOR = re.compile(r"\d\s*[+\-*/×÷]\s*[\d(]")
MAX_EXPRESSION = 200  # characters: a longer one is not a calculator call (and would nest deeply)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_DIGITS = 30  # a result longer than this is refused (no 9**9**9)


def evaluate(expression: str) -> Fraction:
    """+ - * / and parentheses over integers and decimals, exactly (Fractions). Raises ValueError otherwise."""
    expression = expression.replace("×", "*").replace("÷", "/").replace(",", "")

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            out = _OPS[type(node.op)](left, right)
            if len(str(abs(out.numerator))) > MAX_DIGITS:
                raise ValueError("result too large")
            return out
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"longer than {MAX_EXPRESSION} characters")
    try:
        return ev(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"cannot evaluate {expression[:40]!r}") from e


def show(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


def tool_call(response: str) -> Optional[str]:
    """The expression of the turn's tool call, None for a final answer."""
    call = _CALL.search(response)
    if call is not None:
        return call.group(1).strip()
    text = response.rstrip()
    if not text.endswith("="):
        return None
    start = len(text) - 1  # the expression: the arithmetic characters right before the '=' (a linear scan back)
    while start > 0 and text[start - 1] in _ARITHMETIC and len(text) - start <= MAX_EXPRESSION:
        start -= 1
    expression = text[start:-1].strip()
    return expression if _OPERATOR.search(expression) else None


class Calculator:
    stop_strings = ("</calc>", "=")  # a tool call ends the model's turn: the value comes back as the next message

    def __init__(self, answer: Any):
        self.answer = str(answer)

    def reset(self) -> Optional[str]:
        return None  # the row's prompt

    def step(self, response: str) -> Step:
        expression = tool_call(response)
        if expression is None:  # no tool call: this is the final answer
            return Step(None, float(exact_answer([""], [response], answer=[self.answer])[0]), True)
        try:
            result = show(evaluate(expression))
        except ValueError as e:
            result = f"error: {e}"
        return Step(result, 0.0, False)


def make_env(row: dict) -> Calculator:
    if "answer" not in row:
        raise KeyError("the calculator environment needs an 'answer' column in the data")
    return Calculator(row["answer"])
