"""Prompt data: load and check local files (or hub datasets) once, blend and split them, sample in a deterministic
sharded order, collate.

Every rank loads the same sources and draws the same permutations (they depend on seeds only), then takes its own
slice of each global batch, so no communication is needed and a checkpoint resumes from (epoch, batch).

Pipeline of `load_prompt_data` (each step documented where it is done):
  1. read each source (`sources.read_source`: format by extension; .jsonl rows pre-scanned for bad bytes / JSON);
  2. per row: bad rows (invalid UTF-8 or JSON, missing/null/blank/non-text prompt) -> `bad_row_policy`;
  3. text = `prompt_template.format(prompt=..., **row)` if set; then the tokenizer's chat template if
     `use_chat_template` (one user message, `add_generation_prompt=True`), tokenized with `add_special_tokens=False`
     so the BOS the template already holds is not added twice; without the chat template the tokenizer's default
     special tokens are added;
  4. prompts longer than `max_prompt_seq_len` tokens -> `long_prompt_policy`;
  5. blend the sources by ratio (`blend_counts`), then hold out `eval_split` (`split_indices`).
The result is cached on disk per node (`data/cache.py`, `DataConfig.data_cache_dir`): local rank 0 builds it, the
node's other ranks and later runs with the same files, tokenizer and settings read it.

`load_prompt_data(..., row_hook=...)` lets another data kind (data/supervised.py: SFT responses, preference pairs)
reuse the whole pipeline: after step 4 the hook sees each source's kept rows, adds per-row payloads (`extra`) and may
drop rows by its own policies; blending and the split then carry the payloads along.
"""
from __future__ import annotations

import logging
import string
from dataclasses import dataclass, field
from fractions import Fraction
from math import floor
from typing import Any, Callable, Optional, Sequence

import torch

from ..config import DataConfig, parse_data_sources
from ..errors import ConfigError, Problem, Problems
from ..rollout import PromptRow, pad_prompts
from .columns import ColumnRequest
from .cache import CacheUse, cache_key, node_cached, resolve_cache_dir
from .sources import RawSource, read_source

_MAX_ROWS_NAMED = 5
log = logging.getLogger("rlhf_engine.data")


@dataclass
class SourceStats:
    """What happened to the rows of one source (counts of rows)."""

    source: str
    ratio: Optional[float] = None  # blend ratio as given (None: used in full)
    rows: int = 0  # rows in the source
    non_utf8: int = 0  # skipped: invalid UTF-8 (.jsonl)
    malformed: int = 0  # skipped: invalid JSON / not an object (.jsonl)
    not_text: int = 0  # skipped: the prompt (or a row hook's text column: response, chosen...) is not a string
    empty: int = 0  # skipped: the prompt (or a row hook's text column) is missing, null or blank
    too_long_skipped: int = 0  # skipped by long_prompt_policy=skip
    truncated: int = 0  # cut by long_prompt_policy=truncate_left (kept)
    response_too_long_skipped: int = 0  # skipped by long_response_policy=skip (SFT / preference data)
    response_truncated: int = 0  # cut by long_response_policy=truncate (kept)
    usable: int = 0  # rows left after the policies
    selected: int = 0  # rows the blend drew (= usable without ratios)

    @property
    def bad_rows(self) -> int:
        return self.non_utf8 + self.malformed + self.not_text + self.empty


@dataclass
class DataStats:
    sources: list[SourceStats]
    train: int = 0
    eval: int = 0

    def totals(self) -> dict[str, int]:
        """Counts summed over sources, as flat `data/...` keys (log them once, e.g. into the run's config)."""
        keys = ("rows", "non_utf8", "malformed", "not_text", "empty", "too_long_skipped", "truncated",
                "response_too_long_skipped", "response_truncated", "usable", "selected")
        out = {f"data/{k}": sum(getattr(s, k) for s in self.sources) for k in keys}
        out.update({"data/bad_rows_skipped": sum(s.bad_rows for s in self.sources), "data/train": self.train,
                    "data/eval": self.eval})
        return out

    def summary(self) -> str:
        lines = [f"prompt data: {self.train} train / {self.eval} eval prompts"]
        for s in self.sources:
            ratio = "" if s.ratio is None else f" ratio {s.ratio:g}"
            lost = [f"{n} {what}" for n, what in ((s.non_utf8, "invalid UTF-8"), (s.malformed, "invalid JSON"),
                                                  (s.not_text, "non-text"), (s.empty, "empty"),
                                                  (s.too_long_skipped, "too long"),
                                                  (s.response_too_long_skipped, "response too long")) if n]
            lines.append(f"  {s.source}:{ratio} {s.rows} rows, {s.usable} usable, {s.selected} selected"
                         + (f"; skipped {', '.join(lost)}" if lost else "")
                         + (f"; {s.truncated} truncated from the left" if s.truncated else "")
                         + (f"; {s.response_truncated} responses truncated" if s.response_truncated else ""))
        return "\n".join(lines)


@dataclass
class PromptDataset:
    """Tokenized prompts: unpadded `input_ids` and the `attention_mask` the tokenizer returned, one list per row.

    `texts` holds the raw prompt of each row as read (before templates and truncation). `extra` holds per-row
    payloads added by a row hook (e.g. `extra["response"]`: the response token ids of each row), one list per key.
    `columns` holds the data columns a reward function asked for (`ColumnRequest`), one list per column.
    """

    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    texts: list[str]
    stats: Optional[DataStats] = None  # counts of the load this dataset came from
    extra: dict[str, list] = field(default_factory=dict)
    columns: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    def subset(self, indices: Sequence[int]) -> "PromptDataset":
        return PromptDataset([self.input_ids[i] for i in indices], [self.attention_mask[i] for i in indices],
                             [self.texts[i] for i in indices], self.stats,
                             {k: [v[i] for i in indices] for k, v in self.extra.items()},
                             {k: [v[i] for i in indices] for k, v in self.columns.items()})

    def rows(self, indices: Sequence[int], repeat: int = 1) -> list[PromptRow]:
        """What rows `indices` hold beside their tokens, each `repeat` times in a row (a prompt's N samples)."""
        return [PromptRow(self.texts[i], {k: v[i] for k, v in self.columns.items()})
                for i in indices for _ in range(repeat)]


@dataclass
class PromptData:
    """`load_prompt_data`'s result: the train prompts, the held-out eval prompts (None when eval_split is 0)."""

    train: PromptDataset
    eval: Optional[PromptDataset]
    stats: DataStats
    cache: Optional[CacheUse] = None  # how this load used the tokenized-data cache


def _rows(rows: Sequence[int]) -> str:
    shown = ", ".join(map(str, rows[:_MAX_ROWS_NAMED]))
    return shown + (f" and {len(rows) - _MAX_ROWS_NAMED} more" if len(rows) > _MAX_ROWS_NAMED else "")


def blend_counts(sizes: Sequence[int], ratios: Sequence[Any]) -> list[int]:
    """Rows drawn from each source for a blend with `ratios` (any positive numbers; normalised to weights w_i).

    The blend is as large as it can be without drawing any source twice: N = min_i floor(n_i / w_i), and source i
    gives round_half_up(w_i * N) rows (never more than n_i). Ratios are exact fractions of their decimal text, so
    `0.7, 0.3` over sizes (7, 100) gives exactly (7, 3).
    """
    fr = [Fraction(str(r)) if not isinstance(r, Fraction) else r for r in ratios]
    total = sum(fr)
    weights = [r / total for r in fr]
    n = min(floor(Fraction(s) / w) for s, w in zip(sizes, weights))
    return [floor(w * n + Fraction(1, 2)) for w in weights]


def blend_indices(sizes: Sequence[int], ratios: Sequence[Any], seed: int) -> list[list[int]]:
    """Per source, the rows the blend draws: source i (0-based, in the order given) draws its `blend_counts` share
    without replacement as `torch.randperm(n_i, generator=torch.Generator().manual_seed(seed + 1 + i))[:count_i]`,
    returned in file order."""
    out = []
    for i, (size, count) in enumerate(zip(sizes, blend_counts(sizes, ratios))):
        g = torch.Generator().manual_seed(seed + 1 + i)
        out.append(sorted(torch.randperm(size, generator=g)[:count].tolist()))
    return out


def split_indices(n: int, eval_split: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) row indices of `n` prompts, disjoint, each in order: n_eval = round_half_up(eval_split * n), at
    least 1 when eval_split > 0; eval = the first n_eval of `torch.randperm(n, generator=manual_seed(seed))`."""
    if not eval_split:
        return list(range(n)), []
    n_eval = max(1, floor(Fraction(str(eval_split)) * n + Fraction(1, 2)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


@dataclass
class _Prepared:
    """The kept rows of one source: tokenized prompts, raw texts, the table row `rows[i]` each came from (index into
    `RawSource.table`; `RawSource.row_ids[rows[i]]` is its 0-based row number in the file) and row-hook payloads."""

    input_ids: list[list[int]] = field(default_factory=list)
    attention_mask: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    extra: dict[str, list] = field(default_factory=dict)
    columns: dict[str, list] = field(default_factory=dict)  # requested data columns this source has

    def keep(self, positions: Sequence[int]) -> "_Prepared":
        """The entries at `positions` (in that order), payloads included."""
        return _Prepared([self.input_ids[i] for i in positions], [self.attention_mask[i] for i in positions],
                         [self.texts[i] for i in positions], [self.rows[i] for i in positions],
                         {k: [v[i] for i in positions] for k, v in self.extra.items()},
                         {k: [v[i] for i in positions] for k, v in self.columns.items()})


# A row hook: (source as read, its kept rows, its stats, the problems list) -> the rows to keep, with `extra` filled
# (one list per key, aligned with the rows). It reports problems into the list (error policies) and counts what it
# drops in the stats. See data/supervised.py.
RowHook = Callable[[RawSource, _Prepared, SourceStats, Problems], _Prepared]


def _template_fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name} - {"prompt"} if template else set()


def _prepare(raw: RawSource, stats: SourceStats, tokenizer: Any, max_len: int, data: DataConfig,
             p: Problems, columns: Optional[ColumnRequest] = None) -> _Prepared:
    """Steps 2-4 of the module docstring for one source; problems go to `p` (error policies)."""
    path, table, col, skip_bad = raw.path, raw.table, data.prompt_column, data.bad_row_policy == "skip"
    stats.rows = raw.rows
    stats.non_utf8, stats.malformed = len(raw.non_utf8), len(raw.malformed)
    fix = "; or set bad_row_policy=skip to drop and count them"
    if raw.non_utf8 and not skip_bad:
        p.add("data_path", path, f"rows (0-based, blank lines not counted) {_rows(raw.non_utf8)} are not valid UTF-8; "
                                 f"re-encode the file (e.g. iconv -f latin1 -t utf-8){fix}")
    if raw.malformed and not skip_bad:
        row, why = raw.malformed[0]
        p.add("data_path", path, f"could not be read as JSON lines: rows (0-based, blank lines not counted) "
                                 f"{_rows([r for r, _ in raw.malformed])} are not JSON objects (row {row}: {why}); "
                                 f"fix them{fix}")
    if len(table) == 0:  # every row was bad
        return _Prepared()
    if col not in table.column_names:
        p.add("prompt_column", col, f"no such column in {path}; its columns are {table.column_names}: set "
                                    f"prompt_column to select another")
        return _Prepared()
    extra = sorted(_template_fields(data.prompt_template))
    missing = [c for c in extra if c not in table.column_names]
    if missing:
        p.add("prompt_template", data.prompt_template, f"fields {missing} are no columns of {path} (its columns are "
                                                       f"{table.column_names}); use {{prompt}} or existing columns")
        return _Prepared()
    carried = columns.wanted(table.column_names, col) if columns else []
    if columns:
        absent = [c for c in columns.required if c not in table.column_names]
        if absent:
            p.add(columns.field, ", ".join(absent), f"the reward function takes the data column(s) {absent}, which "
                                                   f"{path} does not have (its columns are {table.column_names}); add "
                                                   f"them, or give the parameter a default to make it optional")
            return _Prepared()
    texts = list(table[col])  # a list, not the lazy Column datasets returns
    ids = raw.row_ids
    not_text = [j for j, t in enumerate(texts) if t is not None and not isinstance(t, str)]
    empty = [j for j, t in enumerate(texts) if t is None or (isinstance(t, str) and not t.strip())]
    stats.not_text, stats.empty = len(not_text), len(empty)
    if not_text and not skip_bad:
        p.add("data_path", path, f"{col!r} in rows (0-based) {_rows([ids[j] for j in not_text])} is not a string; "
                                 f"every prompt must be text{fix}")
    if empty and not skip_bad:
        p.add("data_path", path, f"rows (0-based) {_rows([ids[j] for j in empty])} hold an empty prompt (missing, "
                                 f"null or blank {col!r}); remove them{fix}")
    good = [j for j, t in enumerate(texts) if isinstance(t, str) and t.strip()]
    rendered = [texts[j] for j in good]
    if data.prompt_template:
        columns = {c: list(table[c]) for c in extra}
        rendered = [data.prompt_template.format(**{c: columns[c][j] for c in extra}, prompt=texts[j]) for j in good]
    if data.use_chat_template:
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                  add_generation_prompt=True) for t in rendered]
    enc = {"input_ids": [], "attention_mask": []}
    if good:
        # the chat template already holds its special tokens (BOS): adding them again would double them
        enc = tokenizer(rendered, padding=False, truncation=False, return_attention_mask=True,
                        add_special_tokens=not data.use_chat_template)
    out = _Prepared()
    too_long: list[tuple[int, int]] = []
    bos = getattr(tokenizer, "bos_token_id", None)
    for j, x, m in zip(good, enc["input_ids"], enc["attention_mask"]):
        x, m = list(x), list(m)
        if len(x) > max_len:
            too_long.append((ids[j], len(x)))
            if data.long_prompt_policy == "skip":
                continue
            if data.long_prompt_policy == "truncate_left":  # keep the end (the question, the generation prompt)
                keep = 1 if bos is not None and x[0] == bos else 0  # and a leading BOS
                tail = max_len - keep
                x, m = x[:keep] + (x[-tail:] if tail else []), m[:keep] + (m[-tail:] if tail else [])
        out.input_ids.append(x)
        out.attention_mask.append(m)
        out.texts.append(texts[j])
        out.rows.append(j)
    if carried:
        values = {c: list(table[c]) for c in carried}
        out.columns = {c: [values[c][j] for j in out.rows] for c in carried}
    if data.long_prompt_policy == "skip":
        stats.too_long_skipped = len(too_long)
    elif data.long_prompt_policy == "truncate_left":
        stats.truncated = len(too_long)
    elif too_long:
        named = ", ".join(f"row {i} ({n} tokens)" for i, n in too_long[:_MAX_ROWS_NAMED])
        more = f" and {len(too_long) - _MAX_ROWS_NAMED} more" if len(too_long) > _MAX_ROWS_NAMED else ""
        p.add("max_prompt_seq_len", max_len,
              f"{len(too_long)} prompt(s) in {path} are longer than {max_len} tokens (longest "
              f"{max(n for _, n in too_long)}; rows 0-based): {named}{more}; raise max_prompt_seq_len or "
              f"shorten/remove those prompts, or set long_prompt_policy to skip or truncate_left")
    stats.usable = len(out.input_ids)
    return out


def load_prompt_data(data: DataConfig, tokenizer: Any, max_prompt_seq_len: int, seed: int = 0,
                     verbose: bool = True, row_hook: Optional[RowHook] = None,
                     columns: Optional[ColumnRequest] = None) -> PromptData:
    """Load, check, tokenize, blend and split the prompt data described by `data` (see the module docstring).

    `columns`: data columns to keep beside the prompts (`PromptDataset.columns`), e.g. a reward function's ground
    truth; part of the cache key. A required column a source lacks is a `ConfigError` naming it; of the others,
    those every source has are kept.

    `row_hook` (see `RowHook`) runs on each source's kept rows after the prompt policies; its per-row payloads end up
    in `PromptDataset.extra`. A hook with a `cache_key` attribute (JSON-able, naming everything it depends on besides
    the tokenizer) lets the result be cached; one without it turns the cache off for this load.

    `seed` is the run's seed, used when `data.data_seed` is None. Raises one `ConfigError` listing every problem of
    every source (the error policies). Skipped and truncated rows are counted in `stats` and, with `verbose` (rank 0),
    logged as one warning. Every rank must call this together when distributed (the cache's one barrier).
    """
    p = Problems()
    data.validate(p)
    if data.use_chat_template and not getattr(tokenizer, "chat_template", None):
        p.add("use_chat_template", True, "the tokenizer has no chat_template; give a tokenizer with one or set "
                                         "use_chat_template false (prompt_template still applies)")
    header = f"invalid prompt data {data.data_path!r}"
    p.raise_if_any(header)
    sources = parse_data_sources(data.data_path) if data.data_path else [("", None)]
    seed = seed if data.data_seed is None else data.data_seed

    def key() -> Optional[str]:
        if row_hook is not None and not hasattr(row_hook, "cache_key"):
            return None
        settings = {k: v for k, v in vars(data).items() if k != "data_cache_dir"}
        settings.update(max_prompt_seq_len=max_prompt_seq_len, seed=seed,
                        row_hook=getattr(row_hook, "cache_key", None),
                        columns=columns.cache_key() if columns else None)
        return cache_key("prompts", [path for path, _ in sources], tokenizer, settings)

    result, use = node_cached(key, resolve_cache_dir(data.data_cache_dir),
                              lambda: _build_prompt_data(data, sources, tokenizer, max_prompt_seq_len, seed, row_hook,
                                                         header, columns))
    result.cache = use
    if verbose:
        stats = result.stats
        lost = any(s.bad_rows or s.too_long_skipped or s.truncated or s.response_too_long_skipped
                   or s.response_truncated for s in stats.sources)
        if lost:
            log.warning(stats.summary())
        elif len(sources) > 1 or result.eval is not None:
            log.info(stats.summary())
        if use.status in ("read", "built"):
            log.info("tokenized data %s cache %s", "read from" if use.status == "read" else "written to", use.path)
    return result


def _build_prompt_data(data: DataConfig, sources: list, tokenizer: Any, max_prompt_seq_len: int, seed: int,
                       row_hook: Optional[RowHook], header: str,
                       columns: Optional[ColumnRequest] = None) -> PromptData:
    """Steps 1-5 of the module docstring (no cache, no logging)."""
    p = Problems()
    stats = DataStats([SourceStats(path, None if r is None else float(r)) for path, r in sources])
    prepared = []
    for (path, _), st in zip(sources, stats.sources):
        try:
            raw = read_source(path, header)
        except ConfigError as e:  # missing/unreadable: keep going to report the other sources too
            p.extend(e.problems)
            prepared.append(_Prepared())
            continue
        pr = _prepare(raw, st, tokenizer, max_prompt_seq_len, data, p, columns)
        if row_hook is not None and pr.input_ids:
            pr = row_hook(raw, pr, st, p)
            st.usable = len(pr.input_ids)
        prepared.append(pr)
    for pr, st in zip(prepared, stats.sources):
        if not p and not pr.input_ids:
            p.add("data_path", st.source, f"no usable {'rows' if row_hook else 'prompts'}: {st.rows} rows, "
                                          f"{st.bad_rows} bad and "
                                          f"{st.too_long_skipped + st.response_too_long_skipped} too long were "
                                          f"skipped")
    p.raise_if_any(header)
    if sources[0][1] is None:
        chosen = [list(range(len(pr.input_ids))) for pr in prepared]
    else:
        chosen = blend_indices([len(pr.input_ids) for pr in prepared], [r for _, r in sources], seed)
    merged = PromptDataset([], [], [], stats)
    shared = set.intersection(*(set(pr.columns) for pr in prepared)) if columns else set()
    merged.columns = {c: [] for c in prepared[0].columns if c in shared}  # in the first source's column order
    for pr, rows, st in zip(prepared, chosen, stats.sources):
        st.selected = len(rows)
        merged.input_ids += [pr.input_ids[i] for i in rows]
        merged.attention_mask += [pr.attention_mask[i] for i in rows]
        merged.texts += [pr.texts[i] for i in rows]
        for key, values in pr.extra.items():
            merged.extra.setdefault(key, []).extend(values[i] for i in rows)
        for c in merged.columns:
            merged.columns[c].extend(pr.columns[c][i] for i in rows)
    if data.eval_split and len(merged) < 2:
        raise ConfigError([Problem("eval_split", data.eval_split, f"{len(merged)} prompt(s) cannot be split into "
                                                                  f"train and eval; add prompts or set 0")], header)
    train_idx, eval_idx = split_indices(len(merged), data.eval_split, seed)
    stats.train, stats.eval = len(train_idx), len(eval_idx)
    train = merged.subset(train_idx) if eval_idx else merged
    evals = merged.subset(eval_idx) if eval_idx else None
    return PromptData(train, evals, stats)


def load_prompt_dataset(data_path: Any, tokenizer: Any, max_prompt_seq_len: int, prompt_column: str = "prompt", *,
                        prompt_template: str = "", use_chat_template: bool = False,
                        long_prompt_policy: str = "error", bad_row_policy: str = "error", seed: int = 0,
                        verbose: bool = True, data_cache_dir: str = "none") -> PromptDataset:
    """All usable prompts of `data_path` (a source or a blend spec, see `DataConfig.data_path`), no eval split.

    Defaults keep the original behaviour: every prompt tokenized once (no padding, no truncation, the tokenizer's
    default special tokens), and one `ConfigError` listing every problem: missing/empty/unreadable file, missing
    column, bad or empty prompts (rows are 0-based), prompts longer than `max_prompt_seq_len` tokens. Counts of
    skipped/truncated rows are in `.stats`.
    """
    data = DataConfig(data_path=data_path, prompt_column=prompt_column, prompt_template=prompt_template,
                      use_chat_template=use_chat_template, long_prompt_policy=long_prompt_policy,
                      bad_row_policy=bad_row_policy, data_cache_dir=data_cache_dir)
    return load_prompt_data(data, tokenizer, max_prompt_seq_len, seed=seed, verbose=verbose).train


def collate_prompts(dataset: PromptDataset, indices: Sequence[int],
                    pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `indices` -> (ids [B, P] long, attention_mask [B, P] long): left-padded to the batch's longest prompt,
    the mask as the tokenizer returned it (never derived from ids != pad, which breaks when BOS == pad)."""
    return pad_prompts([dataset.input_ids[i] for i in indices], pad_token_id,
                       [dataset.attention_mask[i] for i in indices])
