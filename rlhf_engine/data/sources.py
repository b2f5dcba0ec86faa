"""Reading one prompt source into a `datasets` table: local .jsonl/.json/.parquet/.csv by extension, a folder written
by `datasets`' `save_to_disk`, or a hub dataset name.

Local files use the `datasets` "json", "parquet" and "csv" builders with a private temporary cache (no stale entry
for a rewritten file, no locks shared between runs, nothing left behind). A `save_to_disk` folder (a Dataset, or a
DatasetDict whose "train" split is used) is read with `load_from_disk`. A path that does not exist, has none of the
file extensions and does not start with '.', '/' or '~' is read as a hub dataset name: `load_dataset(name,
split="train")` with the default HF cache. With `HF_HUB_OFFLINE` set to a true value (1/true/yes/on) `datasets` does
not touch the network and reads the newest copy in its cache (HF_DATASETS_CACHE): prepare it on a machine with
network, e.g. a cluster's login node; a name missing from that cache is reported as such.

`.jsonl` files are pre-scanned byte by byte, line by line, before `datasets` sees them: pyarrow stops at the first
invalid UTF-8 byte or invalid JSON line without saying which row, so the scan finds and numbers every such row. When
there are any, the good lines are copied to a temporary file and that is loaded, so the caller can skip them and go on
(`bad_row_policy="skip"`) or name all of them in one error. Rows are numbered 0-based over non-blank lines (blank
lines are not rows, as for `datasets`). Other formats get no row-level byte check: a .csv/.json that is not valid
UTF-8 is a read error naming the file.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import ConfigError, Problem

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE is set to a true value: hub dataset names are then read from the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


@dataclass
class RawSource:
    """One source as read: the table, the original row number of each table row, and the rows lost before it."""

    path: str
    table: Any  # datasets.Dataset
    row_ids: list[int]  # table row j is row row_ids[j] of the source (0-based)
    rows: int  # rows in the source, bad ones included
    non_utf8: list[int] = field(default_factory=list)  # .jsonl rows that are not valid UTF-8
    malformed: list[tuple[int, str]] = field(default_factory=list)  # .jsonl rows that are no JSON object: (row, why)


def _scan_jsonl(path: str) -> tuple[int, list[int], list[tuple[int, str]], set[int]]:
    """(rows, non-UTF-8 rows, malformed rows, line numbers of bad and of blank lines) of a JSON-lines file."""
    rows, non_utf8, malformed, bad_lines = 0, [], [], set()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f):
            if lineno == 0 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (datasets accepts it)
                raw = raw[3:]
            if not raw.strip():  # no row; dropped from a cleaned copy (pandas, datasets' fallback, fails on them)
                bad_lines.add(lineno)
                continue
            row = rows
            rows += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                non_utf8.append(row)
                bad_lines.add(lineno)
                continue
            try:
                obj = json.loads(text)
            except ValueError as e:
                malformed.append((row, str(e)))
                bad_lines.add(lineno)
                continue
            if not isinstance(obj, dict):
                malformed.append((row, f"a JSON {type(obj).__name__}, not an object"))
                bad_lines.add(lineno)
    return rows, non_utf8, malformed, bad_lines


def _copy_lines(src: str, dst: str, drop: set[int]) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for lineno, raw in enumerate(fin):
            if lineno not in drop:
                fout.write(raw if raw.endswith(b"\n") else raw + b"\n")


SAVED = "save_to_disk"  # the pseudo-builder of a save_to_disk folder


def saved_dataset_kind(path: str) -> Optional[str]:
    """'dataset' or 'dict' for a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, else None."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return "dict"
    if all(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "state.json")):
        return "dataset"
    return None


def _load(builder: Optional[str], path: str, cache: Optional[str]) -> Any:
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per rank per load is noise
    try:
        if builder is None:  # a hub dataset name
            return datasets.load_dataset(path, split="train")
        if builder == SAVED:
            table = datasets.load_from_disk(path, keep_in_memory=True)
            if isinstance(table, datasets.DatasetDict):
                if "train" not in table:
                    raise KeyError(f"the DatasetDict has no 'train' split (its splits: {sorted(table)})")
                table = table["train"]
            return table
        return datasets.load_dataset(builder, data_files=path, split="train", keep_in_memory=True, cache_dir=cache)
    finally:
        if bars:
            datasets.enable_progress_bars()


def read_source(path: str, header: Optional[str] = None) -> RawSource:
    """Read one source; raises ConfigError (field `data_path`) for a missing, empty, unknown or unreadable source.

    Bad .jsonl rows (invalid UTF-8 or JSON) do not raise here: they are left out of the table and listed in the
    result, for the caller's `bad_row_policy`.
    """
    header = header or f"invalid prompt data {path!r}"
    ext = os.path.splitext(path)[1].lower()
    builder = BUILDERS.get(ext)
    formats = "/".join(BUILDERS)
    if os.path.isdir(path):
        if saved_dataset_kind(path) is None:
            raise ConfigError([Problem("data_path", path, f"is a directory but not one written by datasets' "
                                                          f"save_to_disk (no dataset_dict.json, or dataset_info.json "
                                                          f"+ state.json); give a local {formats} file or such a "
                                                          f"folder (cwd is {os.getcwd()})")], header)
        builder = SAVED
    elif not os.path.isfile(path):
        if builder is not None or not path or path.startswith((".", "/", "~")):
            raise ConfigError([Problem("data_path", path, f"does not exist; give a local {formats} file of "
                                                          f"prompts (cwd is {os.getcwd()})")], header)
        builder = None  # a hub dataset name
    elif builder is None:
        raise ConfigError([Problem("data_path", path, f"unknown file type {ext or '(no extension)'!r}: the format "
                                                      f"is chosen by extension, one of {', '.join(BUILDERS)}")],
                          header)
    empty = Problem("data_path", path, 'the file holds no rows; give one {"prompt": ...} object per line'
                    if builder == "json" else "the source holds no rows")
    if builder not in (None, SAVED) and os.path.getsize(path) == 0:
        raise ConfigError([empty], header)
    rows, non_utf8, malformed, bad_lines = 0, [], [], set()
    if ext == ".jsonl":
        rows, non_utf8, malformed, bad_lines = _scan_jsonl(path)
        if rows == 0:  # blank lines only
            raise ConfigError([empty], header)
    with tempfile.TemporaryDirectory(prefix="rlhf_prompts_") as cache:
        load_path = path
        if bad_lines:
            if rows == len(non_utf8) + len(malformed):  # every row is bad: nothing left to load
                import datasets

                return RawSource(path, datasets.Dataset.from_dict({}), [], rows, non_utf8, malformed)
            load_path = os.path.join(cache, "clean.jsonl")
            _copy_lines(path, load_path, bad_lines)
        try:
            table = _load(builder, load_path, cache if builder else None)
        except Exception as e:  # datasets wraps parse errors; the cause says which line
            if isinstance(e, StopIteration) or "corresponds to no data" in str(e):  # blank lines only, or []
                raise ConfigError([empty], header) from e
            if builder is None and hub_offline():
                raise ConfigError([Problem("data_path", path, f"is no local file and not in the Hugging Face datasets "
                                                              f"cache, and HF_HUB_OFFLINE is set so the hub is not "
                                                              f"tried ({type(e).__name__}: {e}); run "
                                                              f"datasets.load_dataset({path!r}) where there is network "
                                                              f"with the same HF_DATASETS_CACHE, or give a local "
                                                              f"{formats} file (cwd is {os.getcwd()})")], header) from e
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
            what = {"json": "JSON lines / JSON", "csv": "CSV (UTF-8)", "parquet": "Parquet",
                    SAVED: "a save_to_disk folder", None: "a hub dataset"}[builder]
            raise ConfigError([Problem("data_path", path, f"could not be read as {what}: "
                                                          f"{type(e).__name__}: {e}{cause}")], header) from e
    bad = set(non_utf8) | {r for r, _ in malformed}
    row_ids = [r for r in range(rows) if r not in bad] if ext == ".jsonl" else list(range(len(table)))
    if ext != ".jsonl":
        rows = len(table)
    if len(row_ids) != len(table):  # the scan and pyarrow disagree on what a row is: number rows as loaded
        row_ids, rows = list(range(len(table))), len(table) + len(bad)
    if rows == 0:
        raise ConfigError([empty], header)
    return RawSource(path, table, row_ids, rows, non_utf8, malformed)
