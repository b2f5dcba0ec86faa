"""Data of steps 1 and 2: (prompt, response) rows for SFT and (prompt, chosen, rejected) rows for the reward model.

Both ride on the prompt pipeline of `prompts.load_prompt_data` (formats, blends, the split, bad-row and long-prompt
policies, `prompt_template` and the chat template), so a prompt is tokenized exactly as PPO tokenizes it. A row hook
then adds the responses:

* each response text is tokenized with `add_special_tokens=False` (it continues the prompt; no BOS in the middle) and
  the tokenizer's EOS is appended (unless the text already ends with it): PPO responses end at that EOS, and the
  reward model reads its score there;
* a missing / null / blank / non-text response is a bad row (`bad_row_policy`);
* a response longer than `max_answer_seq_len` tokens, its EOS included, follows `long_response_policy`: 'error' names
  the rows, 'skip' drops and counts them, 'truncate' keeps the first `max_answer_seq_len` tokens without EOS (like a
  PPO response cut at the length limit). For a pair, a row is skipped when either response is too long.

Collation gives the canonical rollout layout (`Rollout.from_responses`: prompt left-padded as the tokenizer returned
it, response right-padded, position ids from the mask), so SFT and reward-model batches are exactly what PPO's
forwards see for the same token ids. Row numbers in errors are 0-based.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..config import DataConfig
from ..errors import Problems
from ..rollout import Rollout, pad_prompts
from .prompts import PromptData, PromptDataset, _Prepared, _rows, load_prompt_data
from .sources import RawSource

RESPONSE, CHOSEN, REJECTED = "response", "chosen", "rejected"


def _response_hook(columns: dict[str, str], tokenizer: Any, max_answer_seq_len: int, long_response_policy: str,
                   bad_row_policy: str):
    """A `prompts.RowHook` adding `extra[key]` = response token ids (EOS appended) for each `key -> column`."""
    eos = tokenizer.eos_token_id
    skip_bad = bad_row_policy == "skip"
    fix = "; or set bad_row_policy=skip to drop and count them"

    def hook(raw: RawSource, prep: _Prepared, stats, p: Problems) -> _Prepared:
        table, path = raw.table, raw.path
        missing = [(k, c) for k, c in columns.items() if c not in table.column_names]
        for key, col in missing:
            p.add(f"{key}_column", col, f"no such column in {path}; its columns are {table.column_names}: set "
                                        f"{key}_column to select another")
        if missing:
            return _Prepared()
        keep = set(range(len(prep.rows)))
        values = {key: list(table[col]) for key, col in columns.items()}
        for key, col in columns.items():
            not_text = [i for i in sorted(keep) if values[key][prep.rows[i]] is not None
                        and not isinstance(values[key][prep.rows[i]], str)]
            empty = [i for i in sorted(keep) if values[key][prep.rows[i]] is None
                     or (isinstance(values[key][prep.rows[i]], str) and not values[key][prep.rows[i]].strip())]
            stats.not_text += len(not_text)
            stats.empty += len(empty)
            named = lambda idx: _rows([raw.row_ids[prep.rows[i]] for i in idx])  # noqa: E731
            if not_text and not skip_bad:
                p.add("data_path", path, f"{col!r} in rows (0-based) {named(not_text)} is not a string; every "
                                         f"{key} must be text{fix}")
            if empty and not skip_bad:
                p.add("data_path", path, f"rows (0-based) {named(empty)} hold an empty {key} (missing, null or blank "
                                         f"{col!r}); remove them{fix}")
            keep -= set(not_text) | set(empty)
        order = sorted(keep)
        ids: dict[str, list[list[int]]] = {}
        for key in columns:
            texts = [values[key][prep.rows[i]] for i in order]
            enc = tokenizer(texts, add_special_tokens=False, padding=False, truncation=False)["input_ids"] if texts \
                else []
            ids[key] = [list(x) if x and x[-1] == eos else list(x) + [eos] for x in enc]
        too_long: list[tuple[int, str, int]] = []  # (position in `order`, column, tokens)
        for pos in range(len(order)):
            for key, col in columns.items():
                if len(ids[key][pos]) > max_answer_seq_len:
                    too_long.append((pos, col, len(ids[key][pos])))
        long_rows = sorted({pos for pos, _, _ in too_long})
        if too_long and long_response_policy == "error":
            shown = ", ".join(f"row {raw.row_ids[prep.rows[order[pos]]]} {col!r} ({n} tokens)"
                              for pos, col, n in too_long[:5])
            more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
            p.add("max_answer_seq_len", max_answer_seq_len,
                  f"{len(too_long)} response(s) in {path} are longer than {max_answer_seq_len} tokens with their EOS "
                  f"(longest {max(n for _, _, n in too_long)}; rows 0-based): {shown}{more}; raise "
                  f"max_answer_seq_len or shorten/remove them, or set long_response_policy to skip or truncate")
        elif long_response_policy == "skip":
            stats.response_too_long_skipped += len(long_rows)
            dropped = set(long_rows)
            kept_pos = [pos for pos in range(len(order)) if pos not in dropped]
            order = [order[pos] for pos in kept_pos]
            ids = {key: [v[pos] for pos in kept_pos] for key, v in ids.items()}
        elif long_response_policy == "truncate":
            stats.response_truncated += len(long_rows)
            ids = {key: [x[:max_answer_seq_len] for x in v] for key, v in ids.items()}
        out = prep.keep(order)
        out.extra.update(ids)
        return out

    # what the hook's result depends on besides the rows and the tokenizer (the tokenized-data cache's key)
    hook.cache_key = {"columns": columns, "max_answer_seq_len": max_answer_seq_len,
                      "long_response_policy": long_response_policy, "bad_row_policy": bad_row_policy}
    return hook


def load_sft_data(data: DataConfig, tokenizer: Any, max_prompt_seq_len: int, max_answer_seq_len: int,
                  response_column: str = "response", long_response_policy: str = "error", seed: int = 0,
                  verbose: bool = True) -> PromptData:
    """(prompt, response) rows -> `PromptData` whose datasets hold the prompts (tokenized as PPO does) and
    `extra["response"]`: the response ids with EOS appended. One `ConfigError` lists every problem (file, column,
    rows)."""
    hook = _response_hook({RESPONSE: response_column}, tokenizer, max_answer_seq_len, long_response_policy,
                          data.bad_row_policy)
    return load_prompt_data(data, tokenizer, max_prompt_seq_len, seed=seed, verbose=verbose, row_hook=hook)


def load_preference_data(data: DataConfig, tokenizer: Any, max_prompt_seq_len: int, max_answer_seq_len: int,
                         chosen_column: str = "chosen", rejected_column: str = "rejected",
                         long_response_policy: str = "error", seed: int = 0, verbose: bool = True) -> PromptData:
    """(prompt, chosen, rejected) rows -> `PromptData` with `extra["chosen"]` and `extra["rejected"]` (ids, EOS
    appended), prompts tokenized as PPO does. One `ConfigError` lists every problem."""
    hook = _response_hook({CHOSEN: chosen_column, REJECTED: rejected_column}, tokenizer, max_answer_seq_len,
                          long_response_policy, data.bad_row_policy)
    return load_prompt_data(data, tokenizer, max_prompt_seq_len, seed=seed, verbose=verbose, row_hook=hook)


# ---- collation -----------------------------------------------------------------------------------------------------
def rollout_of(prompt_ids: Sequence[Sequence[int]], prompt_masks: Sequence[Sequence[int]],
               responses: Sequence[Sequence[int]], pad_token_id: int, eos_token_id: int) -> Rollout:
    """Token-id lists -> the canonical layout (a response ended with EOS iff its last id is EOS)."""
    ids, mask = pad_prompts(list(prompt_ids), pad_token_id, list(prompt_masks))
    return Rollout.from_responses(ids, mask, responses, pad_token_id,
                                  ended_with_eos=[bool(r) and r[-1] == eos_token_id for r in responses])


@dataclass
class SFTBatch:
    """An SFT micro-batch: the layout, `labels` [B, L] (the token ids; `labels[:, t + 1]` is what the logits at t
    predict) and `loss_mask` [B, L] (1 on response tokens, their EOS included; exactly 0 on every prompt token and
    on padding)."""

    rollout: Rollout
    labels: torch.Tensor
    loss_mask: torch.Tensor

    @property
    def num_tokens(self) -> torch.Tensor:
        """Tokens the loss trains (what `ppo_math.sft_loss` counts)."""
        return self.loss_mask[:, 1:].sum()


def collate_sft(dataset: PromptDataset, indices: Sequence[int], pad_token_id: int, eos_token_id: int,
                row_mask: Optional[Sequence[bool]] = None) -> SFTBatch:
    """Rows `indices` of an SFT dataset -> `SFTBatch`. `row_mask[i] = False` zeroes row i's loss mask (a padding row
    that keeps the ranks' forward counts equal in evaluation)."""
    r = rollout_of([dataset.input_ids[i] for i in indices], [dataset.attention_mask[i] for i in indices],
                   [dataset.extra[RESPONSE][i] for i in indices], pad_token_id, eos_token_id)
    loss_mask = torch.cat([torch.zeros_like(r.prompts), r.action_mask], dim=1)
    if row_mask is not None:
        loss_mask = loss_mask * torch.as_tensor(list(row_mask), dtype=loss_mask.dtype).unsqueeze(1)
    return SFTBatch(r, r.sequences.clone(), loss_mask)


@dataclass
class PairBatch:
    """A reward-model micro-batch of B pairs as ONE layout of 2B rows: rows 0..B-1 the chosen responses, rows B..2B-1
    the rejected ones (same prompts). `pair_mask` [B] is 0 for padding pairs."""

    rollout: Rollout
    pair_mask: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return self.pair_mask.shape[0]


def collate_pairs(dataset: PromptDataset, indices: Sequence[int], pad_token_id: int, eos_token_id: int,
                  row_mask: Optional[Sequence[bool]] = None) -> PairBatch:
    """Rows `indices` of a preference dataset -> `PairBatch` (chosen rows first, then rejected)."""
    prompts = [dataset.input_ids[i] for i in indices]
    masks = [dataset.attention_mask[i] for i in indices]
    responses = [dataset.extra[CHOSEN][i] for i in indices] + [dataset.extra[REJECTED][i] for i in indices]
    r = rollout_of(prompts + prompts, masks + masks, responses, pad_token_id, eos_token_id)
    pm = torch.ones(len(indices), dtype=torch.long) if row_mask is None else torch.as_tensor(
        [int(bool(v)) for v in row_mask], dtype=torch.long)
    return PairBatch(r, pm)


def eval_shards(n: int, batch_size: int, rank: int, world_size: int) -> list[tuple[list[int], list[bool]]]:
    """This rank's evaluation micro-batches over `n` rows: rank r takes rows r, r + W, r + 2W, ... in order, in
    batches of `batch_size`; every rank gets the SAME number of batches (ZeRO-3 forwards are collective), a rank with
    fewer rows fills them with row 0 marked False (to be masked out). Each row is counted exactly once overall."""
    mine = list(range(rank, n, world_size))
    per_rank = -(-n // world_size) if n else 0
    batches = -(-per_rank // batch_size) if per_rank else 0
    out = []
    for k in range(batches):
        idx = mine[k * batch_size:(k + 1) * batch_size]
        valid = [True] * len(idx)
        if not idx:  # this rank has run out of rows: one masked row keeps the forward count equal
            idx, valid = [0], [False]
        out.append((idx, valid))
    return out
