"""The verifiable answer checker on hand-written cases: equivalent forms, wrong answers, no answer, the format term."""
import pytest

from rlhf_engine.rewards.math_answer import (FORMAT_BONUS, answers_match, exact_answer, exact_answer_formatted,
                                             extract_answer, parse_number)


@pytest.mark.parametrize("text, answer, marked", [
    ("3 + 4 = 7", "7", False),
    ("First 2, then 5. The answer is 12.", "12", True),
    ("so the result is \\boxed{\\frac{1}{2}} and 9 later", "\\frac{1}{2}", True),
    ("work...\n#### 1,000", "1,000", True),
    ("Answer: -3", "-3", True),
    ("I do not know", None, False),
    # the last marked answer wins, and a marked line reads its final number
    ("#### 5\nActually #### 7", "7", True),
    ("The answer is 3 + 4 = 7", "7", True),
    ("The answer is 5. Wait, no: the answer is 6.", "6", True),
    ("answer: 2\nanswer: 3 apples", "3", True),
    ("#### 72\n", "72", True),
    ("####\n72", "72", True),
    ("The answer is 12, since 3 x 4 = 12 and 4 more", "12", True),
    ("The answer is 12, because of 3 and 4", "12", True),
    ("The answer is x + y", "x + y", True),  # no number: the marked text (symbolic answers belong in \\boxed{})
])
def test_extracts_the_final_answer(text, answer, marked):
    assert extract_answer(text) == (answer, marked)


@pytest.mark.parametrize("predicted, truth", [
    ("1,000", 1000), ("1000.0", "1000"), ("0.5", "1/2"), ("\\frac{1}{2}", "0.50"), ("−3", "-3"), ("$12", "12"),
    ("12.", 12), ("x + 1", "X+1"),
])
def test_equivalent_forms_match(predicted, truth):
    assert answers_match(predicted, truth)


@pytest.mark.parametrize("predicted, truth", [
    ("13", "12"), ("0.3", "1/3"), ("-3", "3"), (None, "1"), ("12", None), ("", ""), ("1/0", "0"),
])
def test_wrong_or_missing_answers_do_not(predicted, truth):
    assert not answers_match(predicted, truth)


def test_parse_number_is_exact():
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")
    assert parse_number("twelve") is None and parse_number("1/0") is None


def test_rewards():
    responses = ["7 + 5 = 12", "The answer is 12", "It is 13", "no number here"]
    assert exact_answer([""] * 4, responses, ["12"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert exact_answer_formatted([""] * 4, responses, [12] * 4) == [1.0, 1.0 + FORMAT_BONUS, 0.0, 0.0]


GSM8K_TRUTH = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72")


@pytest.mark.parametrize("response, truth, score", [
    ("She sold 72 clips in all.", GSM8K_TRUTH, 1.0),  # a GSM8K solution reduces to its final answer, 72
    ("#### 72", GSM8K_TRUTH, 1.0),
    ("She sold 24 clips in May.", GSM8K_TRUTH, 0.0),
    ("#### 5\nActually #### 7", "7", 1.0),
    ("#### 5\nActually #### 7", "5", 0.0),
    ("The answer is 3 + 4 = 7", "7", 1.0),
    ("The answer is 3 + 4 = 7", "3", 0.0),
])
def test_the_found_bugs(response, truth, score):
    assert exact_answer([""], [response], [truth]) == [score]


# where math-verify (0.9.0) and exact_answer agree and where they do not: the table of docs/rewards.md
VERIFY_CASES = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("The answer is 3 + 4 = 7", "7", 1.0, 1.0),
    ("#### 5\nActually #### 7", "7", 1.0, 1.0),
    ("She sold 72 clips.", GSM8K_TRUTH, 1.0, 1.0),
    ("\\boxed{0.333}", "1/3", 0.0, 0.0),
    ("I do not know", "7", 0.0, 0.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 0.0, 1.0),
    ("\\boxed{x+1}", "1+x", 0.0, 1.0),
    ("\\boxed{50\\%}", "0.5", 0.0, 1.0),
    ("The answer is 10%", "0.1", 0.0, 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 0.0, 1.0),
    ("The result: 1 000 people", "1000", 0.0, 1.0),
    ("The answer is −3", "-3", 1.0, 0.0),
    ("The answer is x + y", "x+y", 1.0, 0.0),
]


@pytest.mark.parametrize("response, truth, exact, verified", VERIFY_CASES)
def test_verified_answer_against_exact_answer(response, truth, exact, verified):
    from rlhf_engine.rewards.math_answer import verified_answer

    assert exact_answer([""], [response], [truth]) == [exact]
    assert verified_answer([""], [response], [truth]) == [verified]
