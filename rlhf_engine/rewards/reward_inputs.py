"""What a reward model reads, in one place for the trainer and the reference reward server, so that both score a
response alike: the PPO trainer's re-tokenizing scorer (trainer/reward_shaping.py) and `serve.py` build their inputs
here, and both read the score with `engine.role_engine.sequence_scores` (at the last real token: the response's EOS
when it ended at one).

* The rollout's own ids, when the reward model's tokenizer has the actor's vocabulary (`vocab_fingerprint` equal):
  the prompt's real tokens (its padding dropped) and the response's, the stop token included.
* Otherwise the text, re-encoded with the reward model's tokenizer (`encode_texts`): the prompt decoded without
  special tokens and encoded with the reward tokenizer's default ones, the response encoded without, plus the reward
  tokenizer's EOS when the response ended at a stop token (the layout the reward-model trainer trains on).
* Or the conversation [user: the data row's text, assistant: the response] through the reward tokenizer's chat
  template (`encode_conversations`).
A pair longer than the reward model's positions keeps the end of its prompt and of its response (`fit_positions`).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Optional, Sequence



def vocab_fingerprint(tokenizer: Any) -> str:
    """A digest of the token -> id map: equal digests, same ids (what `same_vocab` compares, sent over the wire)."""
    size = len(tokenizer)
    cached = getattr(tokenizer, "_rlhf_vocab_fingerprint", None)
    if cached and cached[0] == size:  # keyed by the size: a token added later changes the digest
        return cached[1]
    items = sorted(tokenizer.get_vocab().items())
    digest = "sha256:" + hashlib.sha256(json.dumps([size, items]).encode("utf-8")).hexdigest()
    try:
        tokenizer._rlhf_vocab_fingerprint = (size, digest)  # a 150k vocabulary takes ~0.1 s to hash
    except AttributeError:
        pass
    return digest


def pad_id_of(tokenizer: Any) -> int:
    """The id that fills padding (never attended): pad, else EOS, else 0."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def encode_texts(tokenizer: Any, prompts: Sequence[str], responses: Sequence[str],
                 ended: Sequence[bool]) -> tuple[list, list]:
    """(prompt ids, response ids): prompts with the tokenizer's default special tokens, responses without, plus its
    EOS where the response ended at a stop token. An empty part becomes one filler token (a row needs both)."""
    filler = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad_id_of(tokenizer)
    p_ids = [list(x) or [filler] for x in tokenizer(list(prompts), add_special_tokens=True)["input_ids"]]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    r_ids = [(list(x) + (eos if e else [])) or [filler]
             for x, e in zip(tokenizer(list(responses), add_special_tokens=False)["input_ids"], ended)]
    return p_ids, r_ids


def encode_conversations(tokenizer: Any, row_texts: Sequence[str], responses: Sequence[str]) -> tuple[list, list]:
    """(prompt ids, response ids) of [user: row text, assistant: response] in the tokenizer's chat template; the
    response part is what the assistant turn adds after the generation prompt (closing tokens included)."""
    p_ids, r_ids = [], []
    for text, response in zip(row_texts, responses):
        user = [{"role": "user", "content": text}]
        head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=False)
        h = tokenizer(head, add_special_tokens=False)["input_ids"]
        f = tokenizer(full, add_special_tokens=False)["input_ids"]
        if f[:len(h)] != h or len(f) == len(h):  # the template re-renders the head: split at the text instead
            tail = full[len(head):] if full.startswith(head) else full
            f = h + tokenizer(tail, add_special_tokens=False)["input_ids"]
        p_ids.append(list(h))
        r_ids.append(list(f[len(h):]) or [pad_id_of(tokenizer)])
    return p_ids, r_ids


def fit_positions(p_ids: Sequence[Sequence[int]], r_ids: Sequence[Sequence[int]],
                  limit: Optional[int]) -> tuple[list, list]:
    """Pairs cut to `limit` tokens: the end of the response (where the score is read) and of the prompt (the
    question) are kept. Pairs that fit are unchanged."""
    p_out, r_out = [list(p) for p in p_ids], [list(r) for r in r_ids]
    if not limit or limit < 2:
        return p_out, r_out
    for i, (p, r) in enumerate(zip(p_out, r_out)):
        if len(p) + len(r) > limit:
            r_out[i] = r = r[-(limit - 1):]
            p_out[i] = p[-(limit - len(r)):]
    return p_out, r_out


def reward_model_rollout(p_ids: Sequence[Sequence[int]], r_ids: Sequence[Sequence[int]], ended: Sequence[bool],
                         pad_token_id: int, limit: Optional[int] = None):
    """The canonical layout (rollout.py) of (prompt, response) id pairs, fitted to `limit` positions: prompts
    left-padded, responses right-padded, position ids from the mask: what the engine scores."""
    from ..rollout import Rollout, pad_prompts

    p_ids, r_ids = fit_positions(p_ids, r_ids, limit)
    ids, mask = pad_prompts(p_ids, pad_token_id)
    return Rollout.from_responses(ids, mask, r_ids, pad_token_id, ended_with_eos=list(ended))
