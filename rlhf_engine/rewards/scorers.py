"""What the reference reward server (serve.py) scores a request body with: a reward function by the calling rule, or
a reward model read exactly as the PPO reward engine reads it (reward_inputs.py builds the inputs,
`engine.role_engine.sequence_scores` reads the score, the model loads with the engine's `load_scalar_model`).

`score(body)` takes the parsed request (remote.py has the protocol), returns one float per response, and raises
`BadRequest` (answered 400) for a request it cannot score. It is called from several server threads at once: a
reward model runs one forward at a time (a lock), a reward function `concurrency` calls at a time (1 by default:
a user's function need not be thread-safe).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from ..hf_fields import max_positions
from .loader import call_reward_fn, reward_signature
from .reward_inputs import (encode_conversations, encode_texts, pad_id_of, reward_model_rollout,
                            vocab_fingerprint)


class BadRequest(ValueError):
    """A request that cannot be scored as sent (answered 400 with this message)."""


def _list_of(body: dict, key: str, n: int, kind: type, where: str = "") -> list:
    v = body.get(key)
    if not isinstance(v, list) or len(v) != n or not all(isinstance(x, kind) for x in v):
        raise BadRequest(f"{where}{key} must be a list of {n} {kind.__name__} values, one per response")
    return v


def texts_of(body: Any) -> tuple[list, list, dict]:
    """(prompts, responses, columns) of a request body, checked."""
    if not isinstance(body, dict) or not isinstance(body.get("responses"), list):
        raise BadRequest("expected JSON {\"prompts\": [...], \"responses\": [...], \"columns\": {...}}")
    n = len(body["responses"])
    responses = _list_of(body, "responses", n, str)
    prompts = _list_of(body, "prompts", n, str)
    columns = body.get("columns") or {}
    if not isinstance(columns, dict) or any(not isinstance(v, list) or len(v) != n for v in columns.values()):
        raise BadRequest(f"columns must map each name to a list of {n} values, one per response")
    return prompts, responses, columns


def rollout_of(body: dict, n: int) -> dict | None:
    """The request's "rollout" part, checked (None when it has none)."""
    ro = body.get("rollout")
    if ro is None:
        return None
    if not isinstance(ro, dict):
        raise BadRequest("rollout must be an object (remote.py describes it)")
    for key in ("prompt_ids", "response_ids"):
        rows = _list_of(ro, key, n, list, "rollout.")
        if not all(r and all(isinstance(t, int) and t >= 0 for t in r) for r in rows):
            raise BadRequest(f"rollout.{key}: every row must be a non-empty list of token ids")
    _list_of(ro, "ended_with_eos", n, bool, "rollout.")
    _list_of(ro, "plain_prompts", n, str, "rollout.")
    if ro.get("row_texts") is not None:
        _list_of(ro, "row_texts", n, str, "rollout.")
    return ro


class FunctionScorer:
    """A reward function by the calling rule: its declared columns come from the request's "columns"."""

    def __init__(self, fn: Callable, concurrency: int = 1):
        self.fn, self.sig = fn, reward_signature(fn)
        self.slots = threading.Semaphore(max(int(concurrency), 1))
        self.__rlhf_spec__ = getattr(fn, "__rlhf_spec__", getattr(fn, "__qualname__", repr(fn)))

    def score(self, body: Any) -> list[float]:
        prompts, responses, given = texts_of(body)
        missing = [c for c in self.sig.required if c not in given]
        if missing:
            raise BadRequest(f"the reward function needs the columns {missing}; the request has {sorted(given)}")
        wanted = (given if self.sig.all_columns
                  else {c: v for c, v in given.items() if c in self.sig.required + self.sig.optional})
        with self.slots:
            return call_reward_fn(self.fn, prompts, responses, wanted)


DTYPES = ("float32", "bfloat16", "float16")


class ModelScorer:
    """A reward model folder (`*ForSequenceClassification`, as step 2 exports it) scored as the reward engine scores
    it: the rollout's own ids when the request carries them in this tokenizer's vocabulary, else the text
    re-encoded (or the conversation, `use_chat_template`), read at the last real token (reward_inputs.py)."""

    def __init__(self, path: str, batch_size: int = 8, device: str = "cpu", dtype: str = "float32",
                 use_chat_template: bool = False):
        import torch
        from transformers import AutoTokenizer

        from ..engine.models import load_scalar_model
        from ..engine.role_engine import sequence_scores

        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r}: choose one of {DTYPES}")
        self.torch, self.sequence_scores = torch, sequence_scores
        self.device, self.batch_size, self.use_chat_template = device, max(int(batch_size), 1), use_chat_template
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if use_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"--use_chat_template: the tokenizer of {path} has no chat_template")
        self.pad_token_id = pad_id_of(self.tokenizer)
        self.vocab = vocab_fingerprint(self.tokenizer)
        self.model = load_scalar_model(path, getattr(torch, dtype), None, self.pad_token_id).to(device).eval()
        self.model.requires_grad_(False)
        self.limit = max_positions(self.model.hf_model.config)
        self.lock = threading.Lock()  # one forward at a time: requests arrive on several threads
        self.__rlhf_spec__ = f"reward model {path}"

    def score(self, body: Any) -> list[float]:
        prompts, responses, _ = texts_of(body)
        n = len(responses)
        ro = rollout_of(body, n)
        ended = ro["ended_with_eos"] if ro else [True] * n  # plain text: complete responses
        if self.use_chat_template:
            texts = (ro or {}).get("row_texts")
            if texts is None:
                raise BadRequest("this server scores conversations (--use_chat_template): the request needs each "
                                 "sample's data-row text (rollout.row_texts, which the trainer sends)")
            p_ids, r_ids = encode_conversations(self.tokenizer, texts, responses)
        elif ro is not None and ro.get("vocab") == self.vocab:  # the actor's ids are this model's: score them as is
            p_ids, r_ids = ro["prompt_ids"], ro["response_ids"]
            top = max(max(r) for r in p_ids + r_ids)
            if top >= len(self.tokenizer):
                raise BadRequest(f"rollout: token id {top} is outside the vocabulary ({len(self.tokenizer)} tokens)")
        else:
            p_ids, r_ids = encode_texts(self.tokenizer, ro["plain_prompts"] if ro else prompts, responses, ended)
        return self.forward(p_ids, r_ids, ended)

    def forward(self, p_ids: list, r_ids: list, ended: list) -> list[float]:
        out: list[float] = []
        for i in range(0, len(r_ids), self.batch_size):
            rows = slice(i, i + self.batch_size)
            batch = reward_model_rollout(p_ids[rows], r_ids[rows], ended[rows], self.pad_token_id, self.limit)
            with self.lock, self.torch.no_grad():
                out += self.sequence_scores(self.model, batch.to(self.device)).float().tolist()
        return out
