"""Reading one prompt source into a `datasets` table: local .jsonl/.json/.parquet/.csv by extension, or a hub name.

Local files use the `datasets` "json", "parquet" and "csv" builders with a private temporary cache (no stale entry
for a rewritten file, no locks shared between runs, nothing left behind). A path that does not exist and has none of
those extensions is read as a hub dataset name (its "train" split, default HF cache) unless `HF_HUB_OFFLINE` is set
to a true value (1/true/yes/on): then nothing is tried on the network and the path is reported as missing.

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
    """True when HF_HUB_OFFLINE is set to a true value: hub dataset names are then never tried."""
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


def _load(builder: Optional[str], path: str, cache: Optional[str]) -> Any:
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per rank per load is noise
    try:
        if builder is None:  # a hub dataset name
            return datasets.load_dataset(path, split="train")
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
        raise ConfigError([Problem("data_path", path, f"is a directory; give a local {formats} file of prompts "
                                                      f"(cwd is {os.getcwd()})")], header)
    if not os.path.isfile(path):
        if builder is not None or not path or hub_offline() or path.startswith((".", "/", "~")):
            why = " (hub dataset names are not tried: HF_HUB_OFFLINE is set)" if builder is None and path else ""
            raise ConfigError([Problem("data_path", path, f"does not exist{why}; give a local {formats} file of "
                                                          f"prompts (cwd is {os.getcwd()})")], header)
        builder = None  # a hub dataset name
    elif builder is None:
        raise ConfigError([Problem("data_path", path, f"unknown file type {ext or '(no extension)'!r}: the format "
                                                      f"is chosen by extension, one of {', '.join(BUILDERS)}")],
                          header)
    empty = Problem("data_path", path, 'the file holds no rows; give one {"prompt": ...} object per line'
                    if builder == "json" else "the source holds no rows")
    if builder is not None and os.path.getsize(path) == 0:
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
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
            what = {"json": "JSON lines / JSON", "csv": "CSV (UTF-8)", "parquet": "Parquet",
                    None: "a hub dataset"}[builder]
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
