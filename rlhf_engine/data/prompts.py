"""Prompt data: load and check a local .jsonl/.json once, sample it in a deterministic sharded order, collate.

Every rank loads the same file and draws the same permutation (it depends on seed and epoch only), then takes its own
slice of each global batch, so no communication is needed and a checkpoint resumes from (epoch, batch).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from ..errors import ConfigError, Problem, Problems
from ..rollout import pad_prompts

_MAX_ROWS_NAMED = 5


@dataclass
class PromptDataset:
    """Tokenized prompts: unpadded `input_ids` and the `attention_mask` the tokenizer returned, one list per row."""

    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.input_ids)


def _rows(rows: Sequence[int]) -> str:
    shown = ", ".join(map(str, rows[:_MAX_ROWS_NAMED]))
    return shown + (f" and {len(rows) - _MAX_ROWS_NAMED} more" if len(rows) > _MAX_ROWS_NAMED else "")


def _read_json(data_path: str) -> Any:
    """The `datasets` table of a local json/jsonl file; raises ConfigError for a missing, empty or unreadable file."""
    import datasets

    header = f"invalid prompt data {data_path!r}"
    if not os.path.isfile(data_path):
        what = "is a directory" if os.path.isdir(data_path) else "does not exist"
        raise ConfigError([Problem("data_path", data_path, f"{what}; give a local .jsonl (or .json) file of prompts "
                                                           f"(cwd is {os.getcwd()})")], header)
    empty = Problem("data_path", data_path, 'the file holds no rows; give one {"prompt": ...} object per line')
    if os.path.getsize(data_path) == 0:
        raise ConfigError([empty], header)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per rank per load is noise
    # A private cache dir: no stale cache entry for a rewritten file, no locks shared between runs, nothing left over.
    with tempfile.TemporaryDirectory(prefix="rlhf_prompts_") as cache:
        try:
            return datasets.load_dataset("json", data_files=data_path, split="train", keep_in_memory=True,
                                         cache_dir=cache)
        except Exception as e:  # datasets wraps parse errors; the cause says which line
            if isinstance(e, StopIteration) or "corresponds to no data" in str(e):  # blank lines only, or []
                raise ConfigError([empty], header) from e
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
            raise ConfigError([Problem("data_path", data_path, f"could not be read as JSON lines / JSON: "
                                                               f"{type(e).__name__}: {e}{cause}")], header) from e
        finally:
            if bars:
                datasets.enable_progress_bars()


def load_prompt_dataset(data_path: str, tokenizer: Any, max_prompt_seq_len: int,
                        prompt_column: str = "prompt") -> PromptDataset:
    """Load `data_path` (local .jsonl/.json), tokenize every prompt once (no padding, no truncation, the tokenizer's
    default special tokens) and check it.

    Raises one `ConfigError` listing every problem: missing/empty/unreadable file, missing column, empty prompts
    (rows are 0-based), prompts longer than `max_prompt_seq_len` tokens.
    """
    table = _read_json(data_path)
    header = f"invalid prompt data {data_path!r}"
    if prompt_column not in table.column_names:
        raise ConfigError([Problem("prompt_column", prompt_column,
                                   f"no such column in {data_path}; its columns are {table.column_names}: set "
                                   f"prompt_column to select another")], header)
    p = Problems()
    texts = list(table[prompt_column])  # a list, not the lazy Column datasets returns
    if not texts:
        p.add("data_path", data_path, "the file holds no rows")
    not_text = [i for i, t in enumerate(texts) if t is not None and not isinstance(t, str)]
    empty = [i for i, t in enumerate(texts) if t is None or (isinstance(t, str) and not t.strip())]
    if not_text:
        p.add("data_path", data_path, f"{prompt_column!r} in rows (0-based) {_rows(not_text)} is not a string; every "
                                      f"prompt must be text")
    if empty:
        p.add("data_path", data_path, f"rows (0-based) {_rows(empty)} hold an empty prompt (missing, null or blank "
                                      f"{prompt_column!r}); remove them")
    good = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
    enc = {"input_ids": [], "attention_mask": []}
    if good:
        enc = tokenizer([texts[i] for i in good], padding=False, truncation=False, return_attention_mask=True)
    too_long = [(i, len(ids)) for i, ids in zip(good, enc["input_ids"]) if len(ids) > max_prompt_seq_len]
    if too_long:
        named = ", ".join(f"row {i} ({n} tokens)" for i, n in too_long[:_MAX_ROWS_NAMED])
        more = f" and {len(too_long) - _MAX_ROWS_NAMED} more" if len(too_long) > _MAX_ROWS_NAMED else ""
        p.add("max_prompt_seq_len", max_prompt_seq_len,
              f"{len(too_long)} prompt(s) are longer than {max_prompt_seq_len} tokens (longest "
              f"{max(n for _, n in too_long)}; rows 0-based): {named}{more}; raise max_prompt_seq_len or "
              f"shorten/remove those prompts")
    p.raise_if_any(header)
    return PromptDataset(input_ids=[list(x) for x in enc["input_ids"]],
                         attention_mask=[list(x) for x in enc["attention_mask"]], texts=list(texts))


class PromptSampler:
    """Deterministic sharded order over `num_prompts` prompts.

    Epoch e is a permutation of range(num_prompts) drawn from `torch.Generator().manual_seed(seed + e)`: identical on
    every rank, it depends on seed and epoch only. A global batch is batch_size * world_size prompts; rank r of global
    batch k gets perm[k*G + r*batch_size : k*G + (r+1)*batch_size]. With drop_last (the default) the short last batch
    is dropped, and counted: `dropped_per_epoch` prompts per epoch are not seen in that epoch (another epoch's
    permutation puts them elsewhere). With drop_last=False the short last batch is filled from the start of the same
    permutation, so a few prompts repeat in that epoch.
    """

    def __init__(self, num_prompts: int, batch_size: int, rank: int, world_size: int, seed: int,
                 drop_last: bool = True):
        if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size > 0 and 0 <= rank < world_size; got batch_size={batch_size}, "
                             f"rank={rank}, world_size={world_size}")
        G = batch_size * world_size
        if num_prompts < G:
            fit = num_prompts // world_size
            hint = f"lower it to {fit} or below, or add prompts" if fit else "add prompts"
            raise ConfigError([Problem("per_device_generation_batch_size", batch_size,
                                        f"{num_prompts} prompts cannot fill one global batch of {batch_size} x "
                                        f"{world_size} ranks = {G} prompts; {hint}")], "not enough prompts")
        self.num_prompts, self.batch_size, self.rank, self.world_size = num_prompts, batch_size, rank, world_size
        self.seed, self.drop_last, self.global_batch_size = seed, drop_last, G
        self.dropped_per_epoch = num_prompts % G if drop_last else 0
        self._cache: tuple[int, list[int]] | None = None  # (epoch, permutation): recomputed once per epoch

    @property
    def batches_per_epoch(self) -> int:
        G = self.global_batch_size
        return self.num_prompts // G if self.drop_last else -(-self.num_prompts // G)

    def permutation(self, epoch: int) -> list[int]:
        if self._cache is None or self._cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_prompts, generator=g).tolist()
            if not self.drop_last:  # num_prompts >= G, so one wrap fills the last batch
                perm += perm[: self.batches_per_epoch * self.global_batch_size - self.num_prompts]
            self._cache = (epoch, perm)
        return self._cache[1]

    def indices(self, epoch: int, k: int) -> list[int]:
        """This rank's prompt indices in global batch `k` of `epoch`."""
        if not 0 <= k < self.batches_per_epoch:
            raise IndexError(f"batch {k} out of range: an epoch holds {self.batches_per_epoch} batches")
        start = k * self.global_batch_size + self.rank * self.batch_size
        return self.permutation(epoch)[start: start + self.batch_size]

    def iter_from(self, epoch: int = 0, batch: int = 0) -> Iterator[tuple[int, int, list[int]]]:
        """Yield (epoch, k, indices) forever, starting at (epoch, batch): resume a checkpoint from where it stopped."""
        if not 0 <= batch < self.batches_per_epoch:
            raise IndexError(f"batch {batch} out of range: an epoch holds {self.batches_per_epoch} batches")
        while True:
            for k in range(batch, self.batches_per_epoch):
                yield epoch, k, self.indices(epoch, k)
            epoch, batch = epoch + 1, 0


def collate_prompts(dataset: PromptDataset, indices: Sequence[int],
                    pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `indices` -> (ids [B, P] long, attention_mask [B, P] long): left-padded to the batch's longest prompt,
    the mask as the tokenizer returned it (never derived from ids != pad, which breaks when BOS == pad)."""
    return pad_prompts([dataset.input_ids[i] for i in indices], pad_token_id,
                       [dataset.attention_mask[i] for i in indices])
