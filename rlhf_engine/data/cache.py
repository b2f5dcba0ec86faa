"""Tokenized data cached on disk, built once per node.

Without a cache every rank reads and tokenizes the whole dataset at start-up (8 ranks on a node: 8 times the same
work, competing for the node's cores), and again at every restart. With it, local rank 0 of each node builds the
result and writes it; the node's other ranks wait at one barrier and read it; a later run with the same inputs reads
it on every rank.

The key is a SHA-256 over everything the result depends on, so a stale entry is never read:
  - the bytes of every local source file or save_to_disk folder (a hub dataset name is not hashed: such data is
    not cached);
  - the tokenizer: its serialized fast tokenizer (vocabulary, merges, normalizer, pre/post-processor: BOS/EOS
    insertion), chat template, special tokens and class (a slow, Python-only tokenizer: not cached);
  - the caller's settings (data config, lengths, seed, row-hook key);
  - the source code of the data package (`CODE_FILES`): a change of the pipeline invalidates every entry.
Entries are pickles written under a temporary name and renamed, so a crash never leaves a partial entry under the
final name; an unreadable entry is rebuilt with a warning. Entries are never pruned: delete the folder to reclaim it.
Pickle runs code when loaded: only point the cache at a folder you own.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from .. import comm
from ..pretrained import cache_root, sha256_file

log = logging.getLogger("rlhf_engine.data")
T = TypeVar("T")
CODE_FILES = ("cache.py", "columns.py", "prompts.py", "sources.py", "supervised.py")
OFF = ("none", "off")
# How long the node's other ranks wait for local rank 0 to build an entry. Not the job's collective timeout
# (dist_timeout_minutes, minutes): tokenizing a large dataset may take longer than that, and a launcher ends the
# whole job anyway when a rank dies.
BUILD_WAIT = datetime.timedelta(hours=12)


def default_cache_dir() -> str:
    return os.environ.get("RLHF_ENGINE_DATA_CACHE") or os.path.join(cache_root(), "tokenized")


def resolve_cache_dir(setting: str) -> Optional[str]:
    """The folder a `data_cache_dir` setting names: '' = the default ($RLHF_ENGINE_DATA_CACHE, else
    <RLHF_ENGINE_CACHE or ~/.cache/rlhf_engine>/tokenized), 'none' = no cache (None)."""
    if not setting:
        return default_cache_dir()
    if setting.strip().lower() in OFF:
        return None
    return os.path.expanduser(setting)


def file_digest(path: str) -> str:
    return sha256_file(path)


def folder_digest(path: str) -> str:
    """A digest of every file in a folder (relative names and bytes): a `save_to_disk` dataset."""
    h = hashlib.sha256()
    for d, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(d, name)
            h.update(os.path.relpath(full, path).encode() + b"\0" + file_digest(full).encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> Optional[str]:
    """A digest of everything that decides the tokenizer's output, or None when that cannot be serialized."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.sha256(backend.to_str().encode())
    extra = [type(tokenizer).__name__, getattr(tokenizer, "chat_template", None),
             [getattr(tokenizer, f"{t}_token_id", None) for t in ("bos", "eos", "pad", "unk")],
             sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))]
    h.update(json.dumps(extra, default=str).encode())
    return h.hexdigest()


def _code_digest(extra_code: Sequence[str] = ()) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for path in [os.path.join(here, name) for name in CODE_FILES] + list(extra_code):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def cache_key(kind: str, sources: Sequence[str], tokenizer: Any, settings: Any,
              extra_code: Sequence[str] = ()) -> Optional[str]:
    """The entry name for `kind` data built from `sources` (local files) with `tokenizer` and `settings` (anything
    JSON-serializable), or None when the result cannot be keyed safely (a hub source, a slow tokenizer).
    `extra_code`: source files outside the data package that build the result (their bytes join the key)."""
    tok = tokenizer_fingerprint(tokenizer)
    if tok is None:
        return None
    files = []
    for path in sources:
        if os.path.isdir(path):  # a save_to_disk folder
            files.append([os.path.abspath(path), folder_digest(path)])
        elif os.path.isfile(path):
            files.append([os.path.abspath(path), file_digest(path)])
        else:  # a hub dataset name (or a missing file: the load reports it)
            return None
    blob = json.dumps({"kind": kind, "files": files, "tokenizer": tok, "settings": settings,
                       "code": _code_digest(extra_code)},
                      sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


@dataclass
class CacheUse:
    """How one load used the cache: 'off' (no cache dir), 'uncacheable' (no safe key), 'built' (this rank built and
    wrote it), 'read' (this rank read an entry), 'built_unsaved' (built, but the entry could not be written or read)."""

    status: str
    path: Optional[str] = None


def _read(path: str) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _write(path: str, value: Any) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _try_read(path: str) -> tuple[bool, Any]:
    if not os.path.exists(path):
        return False, None
    try:
        return True, _read(path)
    except Exception as e:  # noqa: BLE001  (truncated, corrupt, or from an incompatible version)
        log.warning("tokenized-data cache entry %s is unreadable (%s: %s); building it again", path,
                    type(e).__name__, e)
        return False, None


def node_cached(key: Callable[[], Optional[str]], cache_dir: Optional[str], build: Callable[[], T]
                ) -> tuple[T, CacheUse]:
    """`build()`, through the cache entry named `key()` in `cache_dir` when both are set. `key` is called only with a
    cache folder: with the cache off, no file or tokenizer is hashed.

    Every rank of the job calls this at the same point. When distributed, the ranks talk over a gloo group of their
    own whose timeout is BUILD_WAIT (CPU tensors, so NCCL jobs too): first they agree whether every rank can use
    the cache (otherwise none does: a rank must never wait at a barrier that another skips); then local rank 0
    (LOCAL_RANK) reads the entry, or builds and writes it, while the node's other ranks wait at one barrier and read
    it after. A rank that finds no readable entry (local rank 0 failed, the folder is not writable) builds the data
    itself, so an invalid dataset raises the same error on every rank.
    """
    group = comm.new_cpu_group(BUILD_WAIT)
    try:
        return _node_cached(key, cache_dir, build, group)
    finally:
        comm.destroy_group(group)


def _node_cached(key_fn: Callable[[], Optional[str]], cache_dir: Optional[str], build: Callable[[], T], group: Any
                 ) -> tuple[T, CacheUse]:
    key = key_fn() if cache_dir is not None else None
    usable = key is not None
    if group is not None:
        usable = bool(comm.all_reduce(torch.tensor([int(usable)]), "min", group).item())
    if not usable:
        return build(), CacheUse("off" if cache_dir is None else "uncacheable")
    path = os.path.join(cache_dir, key + ".pkl")
    first = group is None or int(os.environ.get("LOCAL_RANK", 0)) == 0
    result, use, error = None, None, None
    if first:
        found, result = _try_read(path)
        use = CacheUse("read", path)
        if not found:
            try:
                result = build()
            except Exception as e:  # noqa: BLE001  (re-raised after the barrier: the other ranks must not hang)
                error = e
            else:
                use = CacheUse("built", path)
                try:
                    _write(path, result)
                except OSError as e:
                    log.warning("could not write the tokenized-data cache %s (%s); every rank tokenizes on its own. "
                                "Set data_cache_dir to a writable node-local folder, or 'none'", path, e)
                    use = CacheUse("built_unsaved", path)
    if group is not None:
        comm.barrier(group)
    if error is not None:
        raise error
    if not first:
        found, result = _try_read(path)
        use = CacheUse("read", path) if found else CacheUse("built_unsaved", path)
        if not found:
            result = build()
    return result, use
