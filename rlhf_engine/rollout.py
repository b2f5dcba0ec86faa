"""The canonical rollout layout, and the only conversion between full sequences and per-action tensors.

Layout of one batch (P = padded prompt length, R = padded response length, L = P + R):

    sequences       [B, L]  prompt left-padded | response right-padded (padding filled with pad_token_id)
    attention_mask  [B, L]  the prompt mask as the tokenizer returned it | the response's real tokens (right-padded)
    position_ids    [B, L]  attention_mask.cumsum(-1) - 1, clamped at 0: the first real token is position 0 whatever
                            the left padding, so absolute-position models see the same positions in every batch split
    action_mask     [B, R]  1 for every token the model wrote, the first stop token (EOS) included
    response_lengths [B]    real tokens of the response: attention_mask[:, P:].sum(-1)
    ended_with_eos  [B]     the response (an episode: its last turn) ended at a stop token (False: truncated)
    turn_rewards    [B, R]  episodes only (None otherwise): each turn's environment reward on its last action

A single-turn response is all actions: action_mask == attention_mask[:, P:]. A multi-turn episode (rlhf_engine/envs)
keeps its observation and chat-template tokens in the response as context: real tokens (attended, with positions)
whose action_mask is 0, so the action mask has holes between turns. Every consumer of the layout holds to this:
log-probs, KL, entropy, values and every loss are taken at actions only; rewards land on actions
(`ppo_math.compute_rewards`), GAE and returns pass over context tokens (`ppo_math.compute_gae`, the REINFORCE++
returns), trimming keeps every real token, and samples decode the whole episode.

Per-action tensors are `[B, R]`. Response token t sits at sequence position P + t and is predicted by the logits at
position P - 1 + t; the critic's value for action t is read at the same position P - 1 + t (the state before the
action). The reward model's score is read at the last real token of the sequence, P + len - 1.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

import torch


class PromptRow(NamedTuple):
    """What a sample's data row holds beside its tokens: the prompt text as the data has it (no templates), and the
    data columns a reward function asked for (data/columns.py)."""

    text: str
    columns: Mapping[str, Any]


def _check_01(name: str, mask: torch.Tensor) -> None:
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must hold only 0 and 1")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] 0/1 mask -> [B, L] long position ids: cumsum - 1, clamped at 0.

    Real tokens get 0, 1, 2, ... whatever the left padding. Left padding gets 0; right padding repeats the last real
    position (it is never attended to by a real token, so its value does not matter).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] 0/1 mask -> [B] index of the last real token of each row (any left/right padding).

    This is where a scalar-head model (reward model, and its training on pairs) reads its score: the PPO scorer and
    the reward-model trainer both call this function, so they read the same position. A row without real tokens gives
    index 0.
    """
    m = attention_mask.long()
    L = m.shape[-1]
    idx = L - 1 - torch.flip(m, dims=[-1]).argmax(dim=-1)
    return torch.where(m.sum(-1) > 0, idx, torch.zeros_like(idx))


def gather_at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, L] (or [B, L, 1]), index [B] -> [B]: values[b, index[b]]."""
    if values.dim() == 3:
        values = values.squeeze(-1)
    return values.gather(1, index.long().unsqueeze(1)).squeeze(1)


def response_mask(response_ids: torch.Tensor, stop_token_ids: Sequence[int],
                  limits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, G] generated ids -> (action_mask [B, G] long, ended_with_eos [B] bool).

    A response ends at its first stop token, which stays a real token; whatever follows it (the pad/EOS filler that
    `generate` emits for finished rows) is padding. Works when pad == EOS: only the first EOS counts as real.
    `limits` ([B] long, optional): row b's response is at most its first limits[b] tokens; what follows is filler
    even where it is a stop token (pad == EOS), so such a row did not end at a stop token unless one came first.
    """
    G = response_ids.shape[1]
    within = (torch.ones_like(response_ids, dtype=torch.bool) if limits is None else
              torch.arange(G, device=response_ids.device)[None, :] < limits.to(response_ids.device)[:, None])
    if not stop_token_ids:
        return within.long(), torch.zeros(response_ids.shape[0], dtype=torch.bool, device=response_ids.device)
    stops = torch.tensor(sorted(set(int(s) for s in stop_token_ids)), device=response_ids.device)
    is_stop = (torch.isin(response_ids, stops) & within).long()
    stops_before = is_stop.cumsum(-1) - is_stop  # stop tokens strictly before t
    return ((stops_before == 0) & within).long(), is_stop.any(-1)


@dataclass
class Rollout:
    """One batch of prompts and responses in the canonical layout (see module docstring)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    action_mask: torch.Tensor
    response_lengths: torch.Tensor
    ended_with_eos: torch.Tensor
    prompt_length: int
    # per sample, its data row (PromptRow: prompt text, requested columns); None when the batch does not come from
    # a prompt dataset. Not a tensor: it travels with the rows through select and cat, never to a device.
    rows: Optional[list[PromptRow]] = None
    turn_rewards: Optional[torch.Tensor] = None  # [B, R] fp32, episodes only (module docstring)

    def with_rows(self, rows: Optional[Sequence[PromptRow]]) -> "Rollout":
        if rows is not None and len(rows) != self.batch_size:
            raise ValueError(f"{len(rows)} data rows for a batch of {self.batch_size}")
        return dataclasses.replace(self, rows=None if rows is None else list(rows))

    @classmethod
    def from_generation(cls, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor,
                        generated_ids: torch.Tensor, stop_token_ids: Sequence[int], pad_token_id: int,
                        includes_prompt: Optional[bool] = None, limits: Optional[torch.Tensor] = None) -> "Rollout":
        """Build the layout from left-padded prompts and what `generate` returned.

        prompt_ids [B, P], prompt_attention_mask [B, P] (as the tokenizer returned it: never derived from ids != pad,
        which breaks when BOS == pad), generated_ids [B, G] new tokens only, or [B, P + G] with the prompt in front
        (then its first P columns must equal prompt_ids). The response is cut at its first stop token and the
        padding columns shared by every row are dropped, so R = the longest response.

        `includes_prompt`: None detects the prompt in front (first P columns equal to prompt_ids); True/False says
        so explicitly (detection is ambiguous when a response-only batch happens to start with its own prompt, as
        short prompts and repetitive models can). Every row needs at least one real prompt token: the logits that
        predict response token 0 are read at position P - 1.
        """
        if prompt_ids.dim() != 2 or prompt_attention_mask.shape != prompt_ids.shape:
            raise ValueError(f"prompt_ids and prompt_attention_mask must both be [B, P]; got "
                             f"{tuple(prompt_ids.shape)} and {tuple(prompt_attention_mask.shape)}")
        if generated_ids.dim() != 2 or generated_ids.shape[0] != prompt_ids.shape[0]:
            raise ValueError(f"generated_ids must be [B, G] with B={prompt_ids.shape[0]}; got {tuple(generated_ids.shape)}")
        _check_01("prompt_attention_mask", prompt_attention_mask)
        pm = prompt_attention_mask.long()
        if (pm[:, 1:] < pm[:, :-1]).any():
            raise ValueError("prompt_attention_mask must be left-padded (each row 0...0 1...1): tokenize prompts with "
                             "tokenizer.padding_side = 'left'")
        P = prompt_ids.shape[1]
        if P == 0 or not bool((pm[:, -1] == 1).all()):
            rows = [] if P == 0 else (pm[:, -1] != 1).nonzero().flatten().tolist()
            raise ValueError(f"prompt_attention_mask: every row needs at least one real prompt token (rows without "
                             f"one: {rows if P else 'all, P = 0'}); the first response token is predicted at P - 1")
        if includes_prompt is None:
            includes_prompt = generated_ids.shape[1] >= P and torch.equal(generated_ids[:, :P], prompt_ids)
        elif includes_prompt and (generated_ids.shape[1] < P or not torch.equal(generated_ids[:, :P], prompt_ids)):
            raise ValueError("generated_ids: includes_prompt=True but its first P columns differ from prompt_ids")
        if includes_prompt:
            generated_ids = generated_ids[:, P:]
        if generated_ids.shape[1] == 0:
            raise ValueError("generated_ids holds no response tokens (generate returned the prompt only)")
        action_mask, ended = response_mask(generated_ids, stop_token_ids, limits)
        lengths = action_mask.sum(-1)
        R = max(int(lengths.max()), 1)
        action_mask = action_mask[:, :R]
        response = torch.where(action_mask.bool(), generated_ids[:, :R], torch.full_like(generated_ids[:, :R], pad_token_id))
        sequences = torch.cat([prompt_ids, response], dim=1)
        attention_mask = torch.cat([pm, action_mask], dim=1)
        return cls(sequences=sequences, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask), action_mask=action_mask,
                   response_lengths=lengths, ended_with_eos=ended, prompt_length=P)

    @classmethod
    def from_responses(cls, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor,
                       responses: Sequence[Sequence[int]], pad_token_id: int,
                       ended_with_eos: Optional[Sequence[bool]] = None,
                       actions: Optional[Sequence[Sequence[int]]] = None,
                       turn_rewards: Optional[Sequence[Sequence[float]]] = None) -> "Rollout":
        """The layout of known responses (SFT and preference data, and episodes), exactly as if the actor had
        generated them.

        prompt_ids, prompt_attention_mask [B, P] left-padded (e.g. `pad_prompts`); `responses` B lists of token ids,
        each non-empty and already ending with its EOS when it has one (every id is a real token: nothing is cut at
        a stop token, unlike `from_generation`). `ended_with_eos[b]` defaults to True. Episodes: `actions` B 0/1
        lists as long as their responses (1 = the model wrote the token; default all 1) and `turn_rewards` B lists
        of per-token rewards, nonzero only at actions.
        """
        if prompt_ids.dim() != 2 or prompt_attention_mask.shape != prompt_ids.shape:
            raise ValueError(f"prompt_ids and prompt_attention_mask must both be [B, P]; got "
                             f"{tuple(prompt_ids.shape)} and {tuple(prompt_attention_mask.shape)}")
        B, P = prompt_ids.shape
        if len(responses) != B:
            raise ValueError(f"{len(responses)} responses for {B} prompts")
        pm = prompt_attention_mask.long()
        if P == 0 or not bool((pm[:, -1] == 1).all()):
            raise ValueError("prompt_attention_mask: every row needs at least one real prompt token, left-padded")
        lengths = [len(r) for r in responses]
        if min(lengths, default=0) == 0:
            raise ValueError(f"responses: rows {[i for i, n in enumerate(lengths) if n == 0]} are empty")
        R = max(lengths)
        response = torch.full((B, R), pad_token_id, dtype=torch.long, device=prompt_ids.device)
        action_mask = torch.zeros((B, R), dtype=torch.long, device=prompt_ids.device)
        for i, r in enumerate(responses):
            response[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            action_mask[i, : len(r)] = 1
        real = action_mask.clone()
        rewards = None
        if actions is not None:
            action_mask = _per_token(actions, lengths, R, torch.long, "actions", prompt_ids.device)
            if ((action_mask != 0) & (action_mask != 1)).any() or not bool((action_mask.sum(-1) > 0).all()):
                raise ValueError("actions: expected 0/1 lists with at least one 1 (a model-written token) per row")
        if turn_rewards is not None:
            rewards = _per_token(turn_rewards, lengths, R, torch.float32, "turn_rewards", prompt_ids.device)
            if bool(((rewards != 0) & (action_mask == 0)).any()):
                raise ValueError("turn_rewards: a reward sits on a token the model did not write (actions 0)")
        ended = torch.ones(B, dtype=torch.bool) if ended_with_eos is None else torch.as_tensor(
            list(ended_with_eos), dtype=torch.bool)
        attention_mask = torch.cat([pm, real], dim=1)
        return cls(sequences=torch.cat([prompt_ids.long(), response], dim=1), attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask), action_mask=action_mask,
                   response_lengths=real.sum(-1), ended_with_eos=ended.to(prompt_ids.device), prompt_length=P,
                   turn_rewards=rewards)

    # ---- the conversions every consumer uses -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_width(self) -> int:
        return self.action_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        """[B, R] response ids (padding = pad_token_id)."""
        return self.sequences[:, self.prompt_length:]

    @property
    def prompts(self) -> torch.Tensor:
        """[B, P] left-padded prompt ids."""
        return self.sequences[:, : self.prompt_length]

    def action_slice(self, per_position: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] per-position model output -> [B, R, ...]: the outputs at positions P-1 .. P+R-2.

        For logits these predict response tokens 0..R-1; for a value head they are V(state before action t).
        """
        P, R = self.prompt_length, self.response_width
        return per_position[:, P - 1: P - 1 + R]

    @property
    def response_attention(self) -> torch.Tensor:
        """[B, R] the response's real tokens (actions and, in episodes, context), right-padded."""
        return self.attention_mask[:, self.prompt_length:]

    @property
    def is_episode(self) -> bool:
        return self.turn_rewards is not None

    def score_index(self) -> torch.Tensor:
        """[B] sequence index of the last real token (EOS included) where the reward model reads its score."""
        return last_token_index(self.attention_mask)

    def trimmed(self) -> "Rollout":
        """The same rows without the columns that are padding in every row: the leading prompt columns no row uses
        and the response columns after the longest response. Real tokens keep their positions (position ids are
        sliced, not recomputed), so a forward of the trimmed batch computes what the full one does at every real
        token, on fewer positions. One host sync (two numbers read together)."""
        P, R = self.prompt_length, self.response_width
        first_used = self.attention_mask[:, :P].any(0).long().argmax()  # column P - 1 always is used
        lead, width = torch.stack([first_used, self.response_lengths.max().long()]).tolist()
        width = max(width, 1)
        if lead == 0 and width == R:
            return self
        cols = slice(lead, P + width)
        return dataclasses.replace(self, sequences=self.sequences[:, cols], attention_mask=self.attention_mask[:, cols],
                                   position_ids=self.position_ids[:, cols], action_mask=self.action_mask[:, :width],
                                   prompt_length=P - lead,
                                   turn_rewards=None if self.turn_rewards is None else self.turn_rewards[:, :width])

    # ---- batching ----------------------------------------------------------------------------------------------
    def select(self, index: torch.Tensor | slice | Sequence[int]) -> "Rollout":
        """Rows `index`, keeping P and R (positions and masks are unchanged by construction)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, v in kw.items():
            if isinstance(v, torch.Tensor):
                kw[name] = v[index]
        if self.rows is not None:
            picked = torch.arange(self.batch_size)[index].reshape(-1).tolist()
            kw["rows"] = [self.rows[i] for i in picked]
        return type(self)(**kw)

    def split(self, micro_batch_size: int) -> list["Rollout"]:
        return [self.select(slice(i, i + micro_batch_size)) for i in range(0, self.batch_size, micro_batch_size)]

    def to(self, device: torch.device | str) -> "Rollout":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    @classmethod
    def cat(cls, rollouts: Iterable["Rollout"], pad_token_id: int) -> "Rollout":
        """Concatenate batches with different P and R: prompts re-padded on the left, responses on the right.

        Position ids are recomputed from the mask, so every real token keeps its position.
        """
        rs = list(rollouts)
        P = max(r.prompt_length for r in rs)
        R = max(r.response_width for r in rs)
        seqs, masks, amasks = [], [], []
        for r in rs:
            lp, rp = P - r.prompt_length, R - r.response_width
            seq = torch.nn.functional.pad(r.prompts, (lp, 0), value=pad_token_id)
            seqs.append(torch.cat([seq, torch.nn.functional.pad(r.responses, (0, rp), value=pad_token_id)], 1))
            pm = torch.nn.functional.pad(r.attention_mask[:, : r.prompt_length], (lp, 0), value=0)
            real = torch.nn.functional.pad(r.response_attention, (0, rp), value=0)
            masks.append(torch.cat([pm, real], 1))
            amasks.append(torch.nn.functional.pad(r.action_mask, (0, rp), value=0))
        attention_mask = torch.cat(masks)
        return cls(sequences=torch.cat(seqs), attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask), action_mask=torch.cat(amasks),
                   response_lengths=torch.cat([r.response_lengths for r in rs]),
                   ended_with_eos=torch.cat([r.ended_with_eos for r in rs]), prompt_length=P,
                   rows=None if any(r.rows is None for r in rs) else [row for r in rs for row in r.rows],
                   turn_rewards=None if any(r.turn_rewards is None for r in rs) else torch.cat(
                       [torch.nn.functional.pad(r.turn_rewards, (0, R - r.response_width)) for r in rs]))


@dataclass
class Experience:
    """A rollout with everything PPO needs; every per-action tensor is [B, R] fp32 aligned with `rollout.action_mask`.
    `values` and `returns` are None in a run without a critic (an estimator that needs none), `ref_logprobs` in a run
    without a reference (nothing reads it: no KL term)."""

    rollout: Rollout
    old_logprobs: torch.Tensor  # [B, R] actor log-probs at rollout time
    ref_logprobs: Optional[torch.Tensor]  # [B, R] reference log-probs (None: no reference)
    values: Optional[torch.Tensor]  # [B, R] critic values at rollout time (None: no critic)
    scores: torch.Tensor  # [B] reward-model (or reward function) scores
    rewards: torch.Tensor  # [B, R] per-token rewards (KL penalty + clipped score on the last real token)
    kl: torch.Tensor  # [B, R] per-token KL estimate used in the rewards (0 on padding)
    advantages: torch.Tensor  # [B, R]
    returns: Optional[torch.Tensor]  # [B, R] value targets (None: no critic, or an estimator without returns)
    # [B, R] generation-time log-probs of the sampled tokens (None: the generation backend gives none)
    rollout_logprobs: Optional[torch.Tensor] = None
    # --rollout_correction: [B, R] weights of the advantages in the policy loss, and the policy loss's own mask (the
    # mask modes' tokens out; --filter_uniform_groups' groups out); None: no correction or filter
    advantage_weights: Optional[torch.Tensor] = None
    policy_mask: Optional[torch.Tensor] = None

    _PER_ACTION = ("old_logprobs", "ref_logprobs", "values", "rewards", "kl", "advantages", "returns",
                   "rollout_logprobs", "advantage_weights", "policy_mask")

    @property
    def batch_size(self) -> int:
        return self.rollout.batch_size

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> "Experience":
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw["rollout"] = self.rollout.select(index)
        for name in self._PER_ACTION + ("scores",):
            if kw[name] is not None:
                kw[name] = kw[name][index]
        return type(self)(**kw)

    def split(self, micro_batch_size: int) -> list["Experience"]:
        return [self.select(slice(i, i + micro_batch_size)) for i in range(0, self.batch_size, micro_batch_size)]

    @classmethod
    def cat(cls, items: Iterable["Experience"], pad_token_id: int) -> "Experience":
        """Concatenate experiences of different widths: per-action tensors are right-padded with 0."""
        xs = list(items)
        rollout = Rollout.cat([x.rollout for x in xs], pad_token_id)
        R = rollout.response_width
        kw = {"rollout": rollout, "scores": torch.cat([x.scores for x in xs])}
        for name in cls._PER_ACTION:
            if getattr(xs[0], name) is None:  # optional (values, returns, ...): absent in every item alike
                kw[name] = None
                continue
            kw[name] = torch.cat([torch.nn.functional.pad(getattr(x, name), (0, R - getattr(x, name).shape[1]))
                                  for x in xs])
        return cls(**kw)


def _per_token(values: Sequence[Sequence[float]], lengths: Sequence[int], width: int, dtype: torch.dtype, name: str,
               device: torch.device) -> torch.Tensor:
    """B lists, each as long as its response -> [B, width] right-padded with 0."""
    if len(values) != len(lengths):
        raise ValueError(f"{name}: {len(values)} lists for {len(lengths)} responses")
    out = torch.zeros((len(lengths), width), dtype=dtype, device=device)
    for i, (v, n) in enumerate(zip(values, lengths)):
        if len(v) != n:
            raise ValueError(f"{name}[{i}]: {len(v)} entries for a response of {n} tokens")
        out[i, :n] = torch.as_tensor(list(v), dtype=dtype)
    return out


def pad_prompts(prompts: Sequence[Sequence[int]], pad_token_id: int,
                attention_masks: Optional[Sequence[Sequence[int]]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists to the batch maximum -> (ids [B, P], attention_mask [B, P])."""
    if not prompts:
        raise ValueError("pad_prompts: empty batch")
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
            m = attention_masks[i] if attention_masks is not None else [1] * len(p)
            if len(m) != len(p):
                raise ValueError(f"attention_masks[{i}] has {len(m)} entries for a prompt of {len(p)} tokens")
            mask[i, P - len(p):] = torch.tensor(list(m), dtype=torch.long)
    return ids, mask
