"""Fields of a Hugging Face model config that architectures name differently, read in one place (the engine's
start-up checks, the packing probe and the reward inputs all ask the same question)."""
from __future__ import annotations

from typing import Any, Optional

POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def max_positions(config: Any) -> Optional[int]:
    """The longest sequence a model config allows (None: not stated)."""
    for name in POSITION_FIELDS:
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
