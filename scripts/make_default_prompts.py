"""Regenerate rlhf_engine/data/builtin/review_openings.jsonl: the embedded default prompts.

Openings of short reviews and messages, written for this project: hand-written subjects x hand-written openers,
in a fixed shuffled order. Deterministic; run `python scripts/make_default_prompts.py` after editing the lists.
"""
import json
import os
import random

SUBJECTS = [
    "the new coffee shop on the corner", "the hotel we stayed at last weekend", "this pair of running shoes",
    "the pizza place near the station", "the museum's new exhibition", "my first week at the new job",
    "the bus service in our town", "the camping trip to the lake", "this budget laptop", "the concert last night",
    "the customer support team", "the hiking trail behind the school", "this cookbook", "the local library",
    "our neighbourhood bakery", "the train ride to the coast", "the noise-cancelling headphones",
    "the yoga class on Thursdays", "the sci-fi novel I just finished", "the hardware store on Main Street",
    "the city's summer festival", "this electric kettle", "the dentist's office", "the farmers market",
    "the board game we bought", "the online course on statistics", "the family-run Italian restaurant",
    "the new phone update", "the swimming pool downtown", "the winter jacket I ordered", "the animated film",
    "the bicycle repair shop", "the garden centre", "this week's team meeting", "the airport lounge",
    "the cheap hotel breakfast", "the language exchange evening", "the old cinema on the square",
]
OPENERS = [
    "My honest review of {s}:", "I have to tell you about {s}.", "A few words about {s}:",
    "Quick update on {s}:", "So, about {s},", "Here is what I think of {s}:", "Dear friends, {s} was",
    "Review: {s}.", "Let me describe {s}.", "After trying {s}, I would say",
]


def main() -> None:
    rng = random.Random(20261130)
    rows = [o.format(s=s) for s in SUBJECTS for o in OPENERS]
    rng.shuffle(rows)
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rlhf_engine", "data", "builtin",
                       "review_openings.jsonl")
    with open(out, "w") as f:
        for r in rows[:320]:
            f.write(json.dumps({"prompt": r}) + "\n")
    print(f"wrote {min(len(rows), 320)} prompts to {out}")


if __name__ == "__main__":
    main()
