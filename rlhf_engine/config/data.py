"""Where the prompts (or training rows) come from and how they are read."""
from __future__ import annotations

import string
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

from ..errors import Problems
from .fields import check_choice, is_number, opt


LONG_PROMPT_POLICIES = ("error", "skip", "truncate_left")
BAD_ROW_POLICIES = ("error", "skip")


def parse_data_sources(spec: Any) -> list[tuple[str, Optional[Fraction]]]:
    """`data_path` -> [(path or hub name, ratio or None)].

    `spec` is a string `"a.jsonl"`, `"a.jsonl,b.jsonl"` or `"a.jsonl:0.7,b.parquet:0.3"` (a trailing `:number` is a
    ratio; a path may not contain ','), or a list of such strings or of `[path, ratio]` pairs. Ratios are exact
    fractions of their decimal text (`0.7` is 7/10). Either every source has a ratio or none has. Raises ValueError.
    """
    items = spec if isinstance(spec, (list, tuple)) else ([] if spec is None else str(spec).split(","))
    out: list[tuple[str, Optional[Fraction]]] = []
    for item in items:
        ratio: Any = None
        if isinstance(item, (list, tuple)):
            if len(item) != 2:
                raise ValueError(f"{item!r}: a list entry is 'path', 'path:ratio' or [path, ratio]")
            path, ratio = str(item[0]).strip(), item[1]
        else:
            path = str(item).strip()
            head, sep, tail = path.rpartition(":")
            if sep and head:
                try:
                    ratio = Fraction(tail.strip())
                    path = head.strip()
                except ValueError:  # not a number: the ':' belongs to the path
                    ratio = None
        if not path:
            raise ValueError("an empty entry; separate sources with ',' and give each a path")
        if ratio is not None:
            try:
                ratio = Fraction(str(ratio))
            except (ValueError, TypeError):
                raise ValueError(f"{path}: ratio {ratio!r} is not a number") from None
            if ratio <= 0:
                raise ValueError(f"{path}: ratio {float(ratio):g} must be > 0")
        out.append((path, ratio))
    if not out:
        raise ValueError("no data source given")
    if len({r is None for _, r in out}) > 1:
        raise ValueError("give a ratio for every source (a.jsonl:0.7,b.jsonl:0.3) or for none (each used in full)")
    return out


@dataclass
class DataConfig:
    """Prompt data: sources and blending, columns, templates, split, and what to do with bad or long rows."""

    data_path: Any = opt("", "Prompt data: one source, several joined with ',' (each used in full), or a blend "
                         "'a.jsonl:0.7,b.parquet:0.3' (str, or a list in a config file). A source is a local "
                         ".jsonl/.json/.parquet/.csv file (format by extension), a folder written by datasets' "
                         "save_to_disk, or a hub dataset name (its 'train' split; with HF_HUB_OFFLINE set, read "
                         "from the local HF datasets cache only).")
    prompt_column: str = opt("prompt", "Column holding the prompt text (every source).")
    prompt_template: str = opt("", "Python format string applied to each prompt before tokenization, e.g. "
                               "'Question: {prompt}\\nAnswer:'; must contain {prompt}; other {column} fields are "
                               "filled from the row; write literal braces as {{ }}. '' = the prompt as is.")
    use_chat_template: bool = opt(False, "Wrap each prompt (after prompt_template) in the tokenizer's chat template as "
                                  "one user message with the generation prompt; the result is tokenized without "
                                  "adding special tokens again (no double BOS).")
    eval_split: float = opt(0.0, "Fraction of the prompts held out for evaluation (deterministic on data_seed).")
    long_prompt_policy: str = opt("error", "Prompts longer than max_prompt_seq_len tokens: 'error' (stop, naming "
                                  "them), 'skip' (drop and count) or 'truncate_left' (keep the last tokens, and a "
                                  "leading BOS).")
    bad_row_policy: str = opt("error", "Rows with an empty/missing/non-text prompt, or (.jsonl) invalid UTF-8 or "
                              "invalid JSON: 'error' (stop, naming them) or 'skip' (drop and count).")
    data_seed: Optional[int] = opt(None, "Seed of blending and the eval split (None = the run's seed).")
    data_cache_dir: str = opt("", "Folder of the tokenized-data cache, on node-local disk: local rank 0 of each node "
                              "tokenizes once, the node's other ranks and later runs with the same files, tokenizer "
                              "and data settings read the result. '' = $RLHF_ENGINE_DATA_CACHE, else "
                              "<RLHF_ENGINE_CACHE or ~/.cache/rlhf_engine>/tokenized; 'none' = off (every rank "
                              "tokenizes). Hub datasets and slow tokenizers are never cached.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        if not isinstance(self.data_path, (str, list, tuple)):
            p.add(prefix + "data_path", self.data_path, "must be a string or a list of sources")
        elif self.data_path:  # '' is caught where the data is loaded
            try:
                parse_data_sources(self.data_path)
            except ValueError as e:
                p.add(prefix + "data_path", self.data_path, str(e))
        if not isinstance(self.prompt_column, str) or not self.prompt_column:
            p.add(prefix + "prompt_column", self.prompt_column, "must name a column")
        if self.prompt_template:
            try:
                names = {name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name is not None}
            except ValueError as e:
                p.add(prefix + "prompt_template", self.prompt_template,
                      f"not a valid format string ({e}); write literal braces as {{{{ and }}}}")
            else:
                if "prompt" not in names:
                    p.add(prefix + "prompt_template", self.prompt_template, "must contain {prompt}")
                if any(not n or n.isdigit() for n in names):
                    p.add(prefix + "prompt_template", self.prompt_template,
                          "positional fields ({} or {0}) are not allowed; name them ({prompt} or a column)")
        if not is_number(self.eval_split) or not 0.0 <= self.eval_split < 1.0:
            p.add(prefix + "eval_split", self.eval_split, "must lie in [0, 1)")
        check_choice(p, prefix, self, "long_prompt_policy", LONG_PROMPT_POLICIES)
        check_choice(p, prefix, self, "bad_row_policy", BAD_ROW_POLICIES)
        if self.data_seed is not None and (not isinstance(self.data_seed, int) or isinstance(self.data_seed, bool)):
            p.add(prefix + "data_seed", self.data_seed, "must be an integer or None")
        if not isinstance(self.data_cache_dir, str):
            p.add(prefix + "data_cache_dir", self.data_cache_dir, "must be a folder path, '' (the default) or 'none'")
