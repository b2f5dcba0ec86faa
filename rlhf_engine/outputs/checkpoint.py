"""Checkpoints on disk: layout, completion marker, discovery, rotation, run identity. Stdlib only (no torch).

Layout (one folder per checkpoint, tag = `iter_<iteration, 6 digits>`, the number of iterations completed):

    <output_dir>/checkpoints/iter_000004/
        actor/            DeepSpeed save_checkpoint(<tag dir>, tag="actor"): module, optimizer, LR scheduler
        critic/           the same for the critic
        ema/              the EMA of the actor, when the run keeps one
        state_rank0.pt    the trainer's own state of rank 0 (iteration, data position, RNG, KL controller, ...)
        state_rank1.pt    ... one file per rank: DeepSpeed keeps client_state of rank 0 only under ZeRO 0-2
        COMPLETE          the completion marker (JSON, `MARKER_FORMAT`), written last

* **The marker is the only proof of a checkpoint.** Rank 0 writes `COMPLETE` (atomically: a temporary file, then
  `os.replace`) only after a barrier that follows every rank's last write. A folder without it (a save that was cut
  short, a copy in progress) is never loaded, never chosen by `--resume auto`, and never deleted by rotation.
* DeepSpeed's `latest` pointer is not written (`save_latest=False`); checkpoints are found by tag and marker.
* **Rotation** (`keep_last` K > 0) runs after the new marker exists and deletes only marked checkpoints older than the
  K newest marked ones; it removes a marker before the files, so a half-deleted folder is never taken for complete.
* **Sizes**: the marker lists every file of the checkpoint with its size in bytes (`files`); a checkpoint whose files
  are missing or of another size (a truncated copy, a disk that filled up) is corrupt: `--resume auto` skips it (and
  says so), an explicit path is refused. A file of the right size with other bytes is not detected here (a state
  file that does not unpickle is named when it is read).
* **Run identity**: the marker holds a fingerprint (world size, model paths and placement, seed, data, batch
  arithmetic); `diff_fingerprints` names every key that differs on resume.
* Shared filesystem: every rank writes into the same folder, and rank 0 must see the other ranks' files (multi-node
  runs need a filesystem all nodes mount, as DeepSpeed's own checkpoints do).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any, Mapping, Optional, Sequence

from ..errors import ConfigError, Problem
from .run_dir import CHECKPOINTS, RECORD_FILES, RunDir

log = logging.getLogger("rlhf_engine.outputs")

MARKER = "COMPLETE"
MARKER_FORMAT = 1
TAG_PREFIX = "iter_"
_TAG_RE = re.compile(r"^iter_(\d{6,})$")


# ---- names -------------------------------------------------------------------------------------------------------
def checkpoints_root(output_dir: str) -> str:
    return RunDir(output_dir).checkpoints


def tag_for(iteration: int) -> str:
    """`iter_000004`: the checkpoint taken after `iteration` completed iterations."""
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    return f"{TAG_PREFIX}{iteration:06d}"


def iteration_of(tag: str) -> Optional[int]:
    """The iteration of a tag name (`iter_000004` -> 4); None for any other name."""
    m = _TAG_RE.match(os.path.basename(os.path.normpath(tag)))
    return int(m.group(1)) if m else None


def state_file(rank: int) -> str:
    return f"state_rank{rank}.pt"


# ---- marker ------------------------------------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_marker(ckpt_dir: str, meta: Mapping[str, Any]) -> str:
    """Write `<ckpt_dir>/COMPLETE` (JSON) atomically and durably. Call on rank 0 after every rank finished."""
    path = os.path.join(ckpt_dir, MARKER)
    tmp = path + ".tmp"
    body = {"format": MARKER_FORMAT, **meta}
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(body, indent=2, sort_keys=True, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(ckpt_dir)
    return path


def read_marker(ckpt_dir: str) -> Optional[dict]:
    """The marker of a checkpoint folder, or None when it has none (or an unreadable one: also not complete)."""
    path = os.path.join(ckpt_dir, MARKER)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_complete(ckpt_dir: str) -> bool:
    return read_marker(ckpt_dir) is not None


def file_sizes(ckpt_dir: str) -> dict[str, int]:
    """Every file under `ckpt_dir` (relative path -> bytes), the marker and temporary files excepted: what the marker
    records, after every rank finished writing."""
    out = {}
    for d, _, files in os.walk(ckpt_dir):
        for name in files:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, ckpt_dir)
            if rel in (MARKER, MARKER + ".tmp") or name.endswith(".tmp"):
                continue
            out[rel.replace(os.sep, "/")] = os.path.getsize(path)
    return dict(sorted(out.items()))


def corrupt_files(ckpt_dir: str, meta: Optional[Mapping[str, Any]] = None) -> list[str]:
    """What is wrong with a complete checkpoint's files, compared with the sizes its marker records: one line per
    missing or resized file ([] when all match, or when the marker predates the size list)."""
    meta = read_marker(ckpt_dir) if meta is None else meta
    sizes = (meta or {}).get("files")
    if not isinstance(sizes, Mapping):
        return []
    out = []
    for rel, size in sizes.items():
        path = os.path.join(ckpt_dir, *str(rel).split("/"))
        if not os.path.isfile(path):
            out.append(f"{rel} is missing")
        elif os.path.getsize(path) != size:
            out.append(f"{rel} has {os.path.getsize(path)} bytes, the marker says {size}")
    return out


# ---- discovery ---------------------------------------------------------------------------------------------------
def list_checkpoints(root: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(complete, incomplete) checkpoint folders under `root`, each as (iteration, path) sorted by iteration.
    Only folders named like a tag count (`iter_000004`); anything else (`*.abandoned-*`, temporary files) is ignored."""
    complete, incomplete = [], []
    if not os.path.isdir(root):
        return complete, incomplete
    for name in os.listdir(root):
        it = iteration_of(name)
        path = os.path.join(root, name)
        if it is None or not os.path.isdir(path):
            continue
        (complete if is_complete(path) else incomplete).append((it, path))
    return sorted(complete), sorted(incomplete)


def latest_complete(root: str) -> Optional[str]:
    complete, _ = list_checkpoints(root)
    return complete[-1][1] if complete else None


def resolve_resume(resume: str, output_dir: str) -> tuple[Optional[str], str]:
    """The checkpoint a run resumes from -> (path or None, a sentence saying why, for the log).

    * `''`: no resume (None).
    * `'auto'`: the newest complete checkpoint under `<output_dir>/checkpoints`; None (start at iteration 0) when
      there is none. Incomplete folders are skipped and named in the sentence.
    * a path: a checkpoint folder, which must hold the marker; or a run folder / checkpoints folder, whose newest
      complete checkpoint is taken. Anything else is a `ConfigError` naming what was found.
    """
    if not resume:
        return None, "no resume requested"
    if resume == "auto":
        root = checkpoints_root(output_dir)
        complete, incomplete = list_checkpoints(root)
        if not complete:
            skipped = _skipped(incomplete, -1)
            return None, (f"--resume auto: no complete checkpoint under {root}{skipped}; starting at iteration 0")
        it, path, skipped = _newest_sound(complete, incomplete, "resume", resume)
        return path, f"--resume auto: resuming from {path} (iteration {it}), the newest complete checkpoint{skipped}"
    path = os.path.abspath(os.path.expanduser(resume))
    if not os.path.isdir(path):
        raise ConfigError([Problem("resume", resume, "no such folder; give 'auto', a checkpoint folder "
                                   f"(<output_dir>/{CHECKPOINTS}/iter_NNNNNN) or a run folder")],
                          "cannot resume")
    if is_complete(path):
        bad = corrupt_files(path)
        if bad:
            raise ConfigError([Problem("resume", resume, f"the checkpoint is corrupt: {'; '.join(bad[:5])}"
                                       f"{' ...' if len(bad) > 5 else ''}; resume from an earlier one (or 'auto', "
                                       "which skips corrupt checkpoints)" + _complete_hint(os.path.dirname(path)))],
                              "cannot resume")
        return path, f"--resume {resume}: resuming from {path} (iteration {read_marker(path).get('iteration')})"
    if iteration_of(path) is not None:
        raise ConfigError([Problem("resume", resume, f"is not a complete checkpoint: it has no {MARKER} marker (its "
                                   "save did not finish); give a complete one or 'auto'"
                                   + _complete_hint(os.path.dirname(path)))], "cannot resume")
    for root in (path, checkpoints_root(path)):
        complete, incomplete = list_checkpoints(root)
        if complete:
            it, found, skipped = _newest_sound(complete, incomplete, "resume", resume)
            return found, (f"--resume {resume}: resuming from {found} (iteration {it}), the newest complete "
                           f"checkpoint there{skipped}")
    raise ConfigError([Problem("resume", resume, "holds no complete checkpoint (no iter_NNNNNN folder with a "
                               f"{MARKER} marker here or in {CHECKPOINTS}/)")], "cannot resume")


def _skipped(incomplete: Sequence[tuple[int, str]], newest: int) -> str:
    newer = [os.path.basename(p) for it, p in incomplete if it > newest]
    return f" (skipped incomplete, no {MARKER} marker: {', '.join(newer)})" if newer else ""


def _newest_sound(complete: Sequence[tuple[int, str]], incomplete: Sequence[tuple[int, str]], field: str,
                  value: str) -> tuple[int, str, str]:
    """The newest complete checkpoint whose files match its marker -> (iteration, path, what was skipped, for the
    log). Newer incomplete and corrupt ones are skipped and named; a `ConfigError` when every complete one is
    corrupt."""
    corrupt = []
    for it, path in reversed(complete):
        bad = corrupt_files(path)
        if not bad:
            skipped = _skipped(incomplete, it)
            if corrupt:
                skipped += f" (skipped corrupt: {'; '.join(corrupt)})"
            return it, path, skipped
        corrupt.append(f"{os.path.basename(path)}: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""))
    raise ConfigError([Problem(field, value, f"every complete checkpoint is corrupt ({'; '.join(corrupt)}); restore "
                               "the files, or start a new run (--overwrite_output_dir or another --output_dir)")],
                      "cannot resume")


def _complete_hint(root: str) -> str:
    complete, _ = list_checkpoints(root)
    return f"; complete ones there: {', '.join(os.path.basename(p) for _, p in complete)}" if complete else ""


# ---- writing and rotation ----------------------------------------------------------------------------------------
def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _aside(path: str, why: str) -> str:
    dst, k = f"{path}.{why}-{_stamp()}", 1
    while os.path.exists(dst):
        dst, k = f"{path}.{why}-{_stamp()}-{k}", k + 1
    os.rename(path, dst)
    return dst


def prepare_tag_dir(root: str, tag: str) -> str:
    """Make `<root>/<tag>` ready for a new save (rank 0, before a barrier): debris of an earlier save of the same
    tag that never completed is deleted; a COMPLETE checkpoint of that tag (a run resumed from an older checkpoint
    that reaches it again) is moved aside as `<tag>.replaced-<time>`, never overwritten in place."""
    path = os.path.join(root, tag)
    if os.path.isdir(path):
        if is_complete(path):
            log.warning("checkpoint %s exists from an earlier run: kept as %s", path, _aside(path, "replaced"))
        else:
            shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    return path


def abandon_newer(root: str, iteration: int) -> list[str]:
    """On resume from `iteration` (rank 0): move complete checkpoints of LATER iterations aside
    (`<tag>.abandoned-<time>`), so `--resume auto` never jumps back to the timeline that was left. Returns the new
    paths. Nothing is deleted."""
    complete, _ = list_checkpoints(root)
    moved = [_aside(p, "abandoned") for it, p in complete if it > iteration]
    if moved:
        log.warning("resumed from iteration %d: later checkpoints of the previous timeline kept as %s", iteration,
                    ", ".join(moved))
    return moved


def rotate(root: str, keep_last: int) -> list[str]:
    """Delete complete checkpoints older than the `keep_last` newest complete ones (0 = keep all); returns the
    deleted paths. Incomplete folders are never touched. Call on rank 0 after the newest marker was written."""
    if keep_last <= 0:
        return []
    complete, _ = list_checkpoints(root)
    deleted = []
    for _, path in complete[:-keep_last]:
        os.remove(os.path.join(path, MARKER))  # first: a half-deleted folder is incomplete, never loaded
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


# ---- run identity ------------------------------------------------------------------------------------------------
def diff_fingerprints(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every key whose value differs (or exists on one side only) as (key, saved, current), sorted by key."""
    missing = object()
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, missing), current.get(key, missing)
        a = _jsonish(a) if a is not missing else None
        b = _jsonish(b) if b is not missing else None
        if a != b:
            out.append((key, a, b))
    return out


def _jsonish(v: Any) -> Any:
    """The value as it reads back from the marker JSON (tuples become lists), so both sides compare alike."""
    return json.loads(json.dumps(v, default=str))


def check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], ckpt_dir: str,
                      force: bool = False) -> list[tuple[str, Any, Any]]:
    """Refuse to resume a checkpoint of another run: a `ConfigError` with one problem per differing key, unless
    `force` (then a warning naming them). Returns the differences."""
    diffs = diff_fingerprints(saved, current)
    if not diffs:
        return diffs
    if force:
        log.warning("--resume_force: resuming %s although the run differs: %s", ckpt_dir,
                    "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, a, b in diffs))
        return diffs
    problems = [Problem(k, b, f"the checkpoint's run had {k} = {a!r}") for k, a, b in diffs]
    n = len(diffs)
    raise ConfigError(problems, f"cannot resume {ckpt_dir}: this run differs from the checkpoint's in {n} "
                      f"key{'s' if n != 1 else ''} ({', '.join(k for k, _, _ in diffs)}); use the checkpoint's "
                      "values, or pass --resume_force to resume anyway (not an exact continuation)")


# ---- run files after a resume ------------------------------------------------------------------------------------
def trim_after_resume(output_dir: str, iteration: int,
                      names: Sequence[str] = RECORD_FILES) -> list[str]:
    """Keep only the records of iterations before `iteration` in metrics.jsonl / samples.jsonl (rank 0, on resume):
    iterations logged after the checkpoint by the interrupted run are run again. The dropped lines are kept in
    `<name>.dropped-<time>.bak`; returns those backup paths. A last line cut short by a crash is dropped too."""
    backups = []
    for name in names:
        path = os.path.join(output_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f.read().split("\n") if ln.strip()]
        keep, drop = [], []
        for ln in lines:
            try:
                it = json.loads(ln).get("iteration")
            except (ValueError, AttributeError):
                it = None
            (keep if isinstance(it, int) and it < iteration else drop).append(ln)
        if not drop:
            continue
        bak, k = f"{path}.dropped-{_stamp()}.bak", 1
        while os.path.exists(bak):
            bak, k = f"{path}.dropped-{_stamp()}-{k}.bak", k + 1
        with open(bak, "w", encoding="utf-8") as f:
            f.write("\n".join(drop) + "\n")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(ln + "\n" for ln in keep))
        os.replace(tmp, path)
        backups.append(bak)
        log.info("resume at iteration %d: %d records of %s logged after the checkpoint moved to %s", iteration,
                 len(drop), name, bak)
    return backups
