"""Writes arithmetic.jsonl: small addition questions with their answers, for examples/grpo_arithmetic.yaml.

Run `python examples/data/make_arithmetic.py` to rebuild it (deterministic: the same file every time). Each row holds
`prompt` (the question), `answer` (the sum, as text) and `a`, `b` (the operands): every sum of two digits 1-9, each
asked in two phrasings (162 rows). Calibrated on SmolLM2-135M-Instruct sampling at temperature 0.7 with 32 new
tokens: 32% right at the start (two-digit first operands: 16%, too few right answers per group; temperature 1.0:
11%). Easier and every group of samples is all right, harder and every group is all wrong: GRPO then learns nothing.
"""
import json
import os
import random

PHRASES = ("What is {a} + {b}?", "What is {a} plus {b}?")


def rows(seed: int = 0) -> list[dict]:
    out = [{"prompt": phrase.format(a=a, b=b), "answer": str(a + b), "a": a, "b": b}
           for a in range(1, 10) for b in range(1, 10) for phrase in PHRASES]
    random.Random(seed).shuffle(out)
    return out


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows())
    print(f"wrote {path}")
