"""A verifiable reward: is the response's final answer equal to the data row's ground truth?

Use with a data column `answer` (any name works through a wrapper of your own):

    --reward_fn rlhf_engine.rewards.math_answer:exact_answer            # 1 right, 0 wrong or no answer
    --reward_fn rlhf_engine.rewards.math_answer:exact_answer_formatted  # + FORMAT_BONUS for a marked answer

The final answer of a response is, in order of precedence, the last `\\boxed{...}`, the line after the last
`####`, the line after the last "answer is" / "answer:" (from such a line, what follows its last `=`, and of that
the first number when it holds one: "the answer is 3 + 4 = 7" reads 7, "the answer is 12, since 3 x 4" reads 12),
else the last number anywhere. A ground truth in GSM8K form (a worked solution ending in
`#### 72`) is reduced to its final answer first. Two answers match when both
read as exact rational numbers and are equal (`1,000` = `1000` = `1000.0`, `0.5` = `1/2` = `\\frac{1}{2}`, `-3` =
`−3`), else when their normalised texts are equal (case, spaces, `$`, a trailing period ignored). Exact arithmetic,
no floats: 0.1 + 0.2 style answers compare exactly. `math-verify` (symbolic LaTeX equivalence) is not used: this
checker needs nothing beyond the standard library and is exact for the numeric answers it is meant for.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Optional, Sequence

FORMAT_BONUS = 0.1  # exact_answer_formatted: added when the answer is marked (boxed, ####, "answer is")

_NUMBER = r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?"
# a marked answer: the rest of the line after the LAST `####`, else after the last "answer is" / "answer:"
_MARKS = (re.compile(r"####\s*"), re.compile(r"answer\s*(?:is|:|=)[ \t]*", re.I))


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} (nested braces allowed), None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> tuple[Optional[str], bool]:
    """(the final answer of `text` or None, whether it was marked: boxed, `####` or "answer is")."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip(), True
    for mark in _MARKS:
        hits = list(mark.finditer(text))
        marked = text[hits[-1].end():].split("\n", 1)[0].strip() if hits else ""
        if marked:  # the last marked answer wins ("#### 5 ... Actually #### 7" reads 7)
            result = marked.rsplit("=", 1)[-1].strip()  # "The answer is 3 + 4 = 7": what follows the last =
            number = re.findall(_NUMBER, result)
            # its first number ("the answer is 12, since 3 x 4" reads 12)
            return (number[0] if number else result.rstrip(".")), True
    numbers = re.findall(_NUMBER, text)
    return (numbers[-1] if numbers else None), False


def parse_number(text: str) -> Optional[Fraction]:
    """An exact number from `1,234`, `-0.5`, `3/4`, `\\frac{3}{4}`, `$12`, `12.`; None when it is not one."""
    t = text.strip().replace("−", "-").replace("$", "").replace("\\!", "").replace(" ", "").rstrip(".")
    frac = re.fullmatch(r"([-+]?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", t)
    if frac:
        sign, a, b = frac.groups()
        return None if int(b) == 0 else Fraction(int(a), int(b)) * (-1 if sign == "-" else 1)
    if re.fullmatch(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?", t):
        return Fraction(t.replace(",", ""))
    ratio = re.fullmatch(r"([-+]?\d+)/(\d+)", t)
    if ratio:
        return None if int(ratio.group(2)) == 0 else Fraction(int(ratio.group(1)), int(ratio.group(2)))
    return None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.replace("$", "")).rstrip(".").lower()


def reference_answer(truth: Any) -> Optional[str]:
    """The final answer of a ground truth: a GSM8K-style solution (`... <<48/2=24>>24 ... #### 72`) reduces to the
    text after its last `####` (72); anything else is taken as it is."""
    if truth is None:
        return None
    truth = str(truth)
    if "####" in truth:
        return truth.rsplit("####", 1)[1].strip()
    return truth


def answers_match(predicted: Optional[str], truth: Any) -> bool:
    """Whether a predicted answer equals the ground truth (`reference_answer`: numbers exactly, else normalised
    text)."""
    truth = reference_answer(truth)
    if predicted is None or truth is None:
        return False
    a, b = parse_number(predicted), parse_number(truth)
    if a is not None and b is not None:
        return a == b
    return _normalise(predicted) == _normalise(truth) and bool(_normalise(truth))


def exact_answer(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any]) -> list[float]:
    """1.0 when the response's final answer equals the row's `answer`, else 0.0 (no answer counts as wrong)."""
    return [float(answers_match(extract_answer(r)[0], a)) for r, a in zip(responses, answer)]


def exact_answer_formatted(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any]) -> list[float]:
    """`exact_answer` + FORMAT_BONUS when the final answer is marked (boxed, `####`, "the answer is ...")."""
    out = []
    for r, a in zip(responses, answer):
        predicted, marked = extract_answer(r)
        out.append(float(answers_match(predicted, a)) + (FORMAT_BONUS if marked else 0.0))
    return out


def verified_answer(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any]) -> list[float]:
    """1.0 when Hugging Face's `math-verify` finds the response's answer equivalent to the row's `answer` (symbolic:
    `\\\\sqrt{2}/2` = `\\\\frac{\\\\sqrt{2}}{2}`, `x+1` = `1+x`, sets, percentages), else 0.0. The ground truth is
    reduced like `exact_answer`'s (`reference_answer`) and read as LaTeX. Needs the extra: `pip install .[math]`.
    docs/rewards.md lists where it and `exact_answer` disagree."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ImportError("verified_answer needs math-verify: pip install '.[math]' (or pip install math-verify); "
                          "exact_answer needs nothing") from e
    out = []
    for response, truth in zip(responses, answer):
        truth = reference_answer(truth)
        gold = (parse(f"${truth}$") or parse(truth)) if truth else []
        out.append(float(bool(gold) and bool(verify(gold, parse(response)))))
    return out
