"""Sentiment rewards from the VADER lexicon (package `vaderSentiment`, shipped offline in its wheel)."""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence


@lru_cache(maxsize=1)
def _analyzer():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as e:
        raise ImportError("vader rewards need the package vaderSentiment: pip install --no-deps "
                          "vaderSentiment==3.3.2 (scripts/install.sh --demo installs it)") from e
    return SentimentIntensityAnalyzer()


def vader_positive(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """VADER compound score of each response alone, in [-1, 1]: positive sentiment scores high."""
    analyzer = _analyzer()
    return [analyzer.polarity_scores(r)["compound"] for r in responses]
