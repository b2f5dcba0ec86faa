"""PPO-ptx's unsupervised documents: loading, collation and the sharded, resumable stream of one rank.

Data (`--unsupervised_dataset_name`): a local `.txt` file (one document per line, blank lines skipped), a
`.jsonl`/`.json`/`.parquet`/`.csv` file or a `save_to_disk` folder with a text column (`--unsup_text_column`, default
`text`), or a hub dataset name (its `train` split; with HF_HUB_OFFLINE, from the local datasets cache only). Each
document is tokenized with the actor's tokenizer (its default special tokens) and cut to its first
`max_prompt_seq_len + max_answer_seq_len` tokens (truncations are counted in the start-up log); rows that are not
text, blank, or shorter than 2 tokens are skipped (counted).

Sampling: a `PromptSampler` over the documents (order from `seed` and the epoch, rank r takes slice r of each global
mini-batch of `per_device_training_batch_size x gradient_accumulation_steps x world_size` documents, the short last
one dropped) behind a `DataCursor`, registered as the checkpoint state provider "ptx_data": a resumed run continues
with the same documents, on another world size too (the global mini-batch is what a resume keeps). The loss is the
trainer's (trainer/ptx.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, Problem
from ..rollout import position_ids_from_mask
from .sampler import DataCursor, PromptSampler

log = logging.getLogger(__name__)

TEXT_EXTENSIONS = (".txt", ".text")


@dataclass
class PtxDataset:
    """Tokenized documents (unpadded id lists) and what was dropped or cut while loading them."""

    input_ids: list[list[int]]
    source: str = ""
    rows: int = 0
    skipped: int = 0  # not text, blank, or fewer than 2 tokens
    truncated: int = 0
    cache: Any = None  # data.cache.CacheUse: how the load used the tokenized-data cache

    def __len__(self) -> int:
        return len(self.input_ids)


def _read_texts(path: str, text_column: str) -> list:
    """The raw documents of a source: lines of a text file, or the text column of a table (data/sources.py)."""
    if os.path.splitext(path)[1].lower() in TEXT_EXTENSIONS:
        if not os.path.isfile(path):
            raise ConfigError([Problem("unsupervised_dataset_name", path, f"no such file (cwd is {os.getcwd()})")],
                              "invalid unsupervised (ptx) data")
        with open(path, encoding="utf-8", errors="strict") as f:
            try:
                return [line.rstrip("\n") for line in f]
            except UnicodeDecodeError as e:
                raise ConfigError([Problem("unsupervised_dataset_name", path, f"is not valid UTF-8 ({e})")],
                                  "invalid unsupervised (ptx) data") from e
    from .sources import read_source

    try:
        raw = read_source(path, "invalid unsupervised (ptx) data")
    except ConfigError as e:
        raise ConfigError([Problem("unsupervised_dataset_name", q.value, q.fix) for q in e.problems],
                          "invalid unsupervised (ptx) data") from e
    if text_column not in raw.table.column_names:
        raise ConfigError([Problem("unsup_text_column", text_column, f"no such column in {path}; its columns are "
                                   f"{raw.table.column_names}")], "invalid unsupervised (ptx) data")
    return list(raw.table[text_column])


def load_ptx_data(path: str, tokenizer: Any, max_len: int, text_column: str = "text",
                  verbose: bool = True, data_cache_dir: str = "none") -> PtxDataset:
    """Read, tokenize and cut the unsupervised documents (module docstring), through the tokenized-data cache
    (`data/cache.py`; every rank calls this together). Raises ConfigError when none is usable."""
    from .cache import cache_key, node_cached, resolve_cache_dir

    def key():
        return cache_key("ptx", [path], tokenizer, {"max_len": max_len, "text_column": text_column},
                         extra_code=[os.path.abspath(__file__)])

    out, use = node_cached(key, resolve_cache_dir(data_cache_dir),
                           lambda: _build_ptx_data(path, tokenizer, max_len, text_column))
    out.cache = use
    if verbose and (out.skipped or out.truncated):
        log.warning("ptx data %s: %d documents, %d skipped (not text, blank or < 2 tokens), %d cut to %d tokens",
                    path, len(out), out.skipped, out.truncated, max_len)
    elif verbose:
        log.info("ptx data %s: %d documents", path, len(out))
    if verbose and use.status in ("read", "built"):
        log.info("tokenized ptx data %s cache %s", "read from" if use.status == "read" else "written to", use.path)
    return out


def _build_ptx_data(path: str, tokenizer: Any, max_len: int, text_column: str) -> PtxDataset:
    texts = _read_texts(path, text_column)
    good = [t for t in texts if isinstance(t, str) and t.strip()]
    ids = tokenizer(good, add_special_tokens=True, truncation=False)["input_ids"] if good else []
    out = PtxDataset([], source=path, rows=len(texts))
    for x in ids:
        if len(x) < 2:
            continue
        if len(x) > max_len:
            out.truncated += 1
            x = x[:max_len]
        out.input_ids.append(list(x))
    out.skipped = out.rows - len(out.input_ids)
    if not out.input_ids:
        raise ConfigError([Problem("unsupervised_dataset_name", path, f"no usable document: {out.rows} rows, none "
                                   "with text of at least 2 tokens")], "invalid unsupervised (ptx) data")
    return out


@dataclass
class PtxBatch:
    """Right-padded documents: ids, mask and position ids [B, L]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor

    @property
    def num_tokens(self) -> torch.Tensor:
        """Tokens the loss trains: every real token but the first of each row."""
        return self.attention_mask[:, 1:].sum()

    def to(self, device: Any) -> "PtxBatch":
        return PtxBatch(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device))


def collate_ptx(dataset: PtxDataset, indices: list[int], pad_token_id: int) -> PtxBatch:
    rows = [dataset.input_ids[i] for i in indices]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return PtxBatch(ids, mask, position_ids_from_mask(mask))


def check_fits(dataset: PtxDataset, mini_batch_size: int, world_size: int) -> None:
    """A `ConfigError` unless the documents fill one global ptx mini-batch (checked when the run is planned)."""
    if len(dataset) < mini_batch_size * world_size:
        raise ConfigError([Problem("unsupervised_dataset_name", dataset.source,
                                   f"{len(dataset)} usable documents cannot fill one global ptx mini-batch of "
                                   f"{mini_batch_size} (per_device_training_batch_size x "
                                   f"gradient_accumulation_steps) x {world_size} ranks; add documents")],
                          "invalid unsupervised (ptx) data")


class PtxData:
    """The sharded, resumable stream of ptx micro-batches of one rank (module docstring).

    The order is one of global mini-batches: `mini_batch_size x world_size` documents (the global PPO mini-batch,
    which a resume on another world size keeps), rank r taking slice r and cutting it into micro-batches of
    `micro_batch_size`. So every global mini-batch holds the same documents on any number of ranks, and a data
    position saved by one world size continues on another with the same global order."""

    def __init__(self, dataset: PtxDataset, micro_batch_size: int, accumulation_steps: int, rank: int,
                 world_size: int, seed: int, pad_token_id: int):
        self.dataset, self.pad_token_id = dataset, pad_token_id
        self.micro_batch_size = micro_batch_size
        mini = micro_batch_size * accumulation_steps
        check_fits(dataset, mini, world_size)
        self.sampler = PromptSampler(len(dataset), mini, rank, world_size, seed,
                                     batch_field="per_device_training_batch_size")
        self.cursor = DataCursor(self.sampler)  # the "ptx_data" state provider

    def next_mini_batch(self, device: Any) -> list[PtxBatch]:
        """This rank's share of the next global mini-batch, as gradient_accumulation_steps micro-batches."""
        idx = next(self.cursor)[2]
        n = self.micro_batch_size
        return [collate_ptx(self.dataset, idx[i:i + n], self.pad_token_id).to(device) for i in range(0, len(idx), n)]
