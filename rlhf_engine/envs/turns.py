"""Token in, token out: the tokens an episode adds around the model's own, built once per observation.

The model's sampled ids are never decoded and encoded again (BPE is not a bijection: the ids of decode(ids) may
differ, and log-probs of other ids would describe another sample). Only what the model did not write is tokenised:
the end of its turn as the chat template closes it, and the observation inside the template's user-turn wrapping.

The wrapping is read from the template itself, with marker strings: render [user U, assistant A] and [user U,
assistant A, user O] (the second with the generation prompt); the second must start with the first (an append-only
template: one that rewrites earlier turns, like templates dropping earlier reasoning, is refused), and what follows
is the text around O. The turn's close is what the first rendering puts after A; when the model ended its turn with
a stop token that the close begins with (ChatML's <|im_end|>), the rest of the close is context.

Where the episode equals the template applied to the whole conversation: as text always (decode(episode) ==
template(conversation), the model's turns being the decoded sampled ids), for a template whose turn boundaries are
special tokens or whitespace that pre-tokenisation splits on (ChatML, Llama 3, Mistral's). As token ids, wherever the
model's sampled ids are the tokenizer's own encoding of their text: where they are not (the re-tokenisation case),
the episode keeps the sampled ids, which is what PPO must score.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

_U, _A, _O = "\x02USER\x02", "\x02ASSISTANT\x02", "\x02OBSERVATION\x02"


class TurnFormat:
    """`tokenizer` the actor's; `chat`: the prompts use the chat template (--use_chat_template)."""

    def __init__(self, tokenizer: Any, chat: bool, role: str = "user"):
        self.tokenizer, self.chat = tokenizer, chat
        self.close = self.before = self.after = ""
        if chat:
            self.close, self.before, self.after = wrapping(tokenizer, role)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def first_prompt(self, message: str) -> list[int]:
        """The prompt ids of a first user message from reset(), tokenised as the data's prompts are."""
        if self.chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.encode(text)
        return list(self.tokenizer(message, add_special_tokens=True)["input_ids"])

    def context(self, observation: Optional[str], closed_by: Optional[int]) -> list[int]:
        """The ids after a model turn and before the next: the rest of the turn's close and the observation in its
        wrapping. `closed_by`: the stop token the model ended its turn with (None: cut by a stop string or the
        length)."""
        obs = observation or ""
        if not self.chat:
            return self.encode(obs)
        close = self.close
        if closed_by is not None:
            stop_text = self.tokenizer.decode([closed_by], skip_special_tokens=False)
            if stop_text and close.startswith(stop_text):
                close = close[len(stop_text):]
        return self.encode(close + self.before + obs + self.after)


def wrapping(tokenizer: Any, role: str = "user") -> tuple[str, str, str]:
    """(close, before, after) of the chat template (module docstring). Raises ValueError when the template is not
    append-only or has no room for the markers."""
    first = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}]
    a = tokenizer.apply_chat_template(first, tokenize=False)
    b = tokenizer.apply_chat_template(first + [{"role": role, "content": _O}], tokenize=False,
                                      add_generation_prompt=True)
    if _A not in a or not b.startswith(a) or _O not in b[len(a):]:
        raise ValueError("the chat template is not append-only (rendering a conversation with one more turn changes "
                         "its earlier text), so observations cannot be appended token by token; use a template that "
                         "only appends, or turn use_chat_template off")
    close = a[a.index(_A) + len(_A):]
    before, after = b[len(a):].split(_O, 1)
    return close, before, after


def cut_at_stop_strings(tokenizer: Any, ids: Sequence[int], stop_strings: Sequence[str]) -> int:
    """The number of leading ids to keep: up to and including the first id whose text completes a stop string
    (len(ids) when none occurs). The kept ids are a prefix of the sample, so their log-probs are unchanged: cutting
    after sampling is the same distribution as stopping while sampling."""
    if not stop_strings or not ids:
        return len(ids)

    def has(k: int) -> bool:
        return contains_stop_string(tokenizer, ids[:k], stop_strings)

    if not has(len(ids)):
        return len(ids)
    lo, hi = 1, len(ids)  # has(hi) holds; find the smallest k with has(k)
    while lo < hi:
        mid = (lo + hi) // 2
        if has(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def contains_stop_string(tokenizer: Any, ids: Sequence[int], stop_strings: Sequence[str]) -> bool:
    """Whether the text of `ids` holds any of `stop_strings` (the turn ended at one)."""
    if not stop_strings or not ids:
        return False
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return any(s in text for s in stop_strings)
