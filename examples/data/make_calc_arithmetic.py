"""Writes calc_arithmetic.jsonl: two-step arithmetic (a x b + c) for examples/grpo_calculator.yaml.

Run `python examples/data/make_calc_arithmetic.py` to rebuild it (deterministic). Each row holds `prompt` (the
question), `answer` (as text) and the operands. Two-digit products: SmolLM2-135M-Instruct gets almost none right by
itself (sampled at temperature 0.7: a few percent), and the calculator tool makes them easy.
"""
import json
import os
import random


def rows(n: int = 240, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(12, 49), rng.randint(12, 49), rng.randint(10, 99)
        out.append({"prompt": f"What is {a} * {b} + {c}?", "answer": str(a * b + c), "a": a, "b": b, "c": c})
    return out


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calc_arithmetic.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows())
    print(f"wrote {path}")
