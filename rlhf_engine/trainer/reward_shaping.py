"""What happens to the scores between the reward model (or function) and the reward, and a reward model with its own
tokenizer.

Order, per iteration (every rank):
  1. raw scores [B] from the reward model / `reward_fn`, checked (one finite score per sequence);
  2. `normalize_reward`: the running statistics are updated with this iteration's scores of EVERY rank (one
     all-reduce of count, sum and sum of squares in float64, merged with Chan's formula), then
     score = (score - mean) / (std + 1e-8) with the updated mean and (population) std of every score seen so far;
  3a. DAPO's soft overlong penalty (`overlong_buffer_len` L > 0, `overlong_penalty_factor` F): a response of length
     n > max_answer_seq_len - L gets -F x (n - (max_answer_seq_len - L)) / L (reaching -F at the limit);
  3. `missing_eos_penalty` p >= 0: score -= p for every response that did not end with a stop token (it hit
     max_answer_seq_len), in the units of step 2's output;
  4. `ppo_math.compute_rewards` clamps the score to [-reward_clip, reward_clip] and adds it to the reward of the last
     real action.
`objective/score` logs the raw scores of step 1; `objective/shaped_score` the scores after step 3 (when 2, 3a or 3 is
on).
The normalizer's state (count, mean, M2) is a checkpoint state provider ("reward_normalizer"); it is identical on every
rank.

A reward model whose vocabulary differs from the actor's (`--reward_tokenizer_name_or_path`):
`RetokenizedRewardModel` decodes each row's prompt and response with the actor's tokenizer (special tokens skipped),
encodes them with the reward tokenizer (the prompt with its default special tokens, the response without, plus the
reward tokenizer's EOS when the response ended with a stop token: the layout the reward-model trainer trains on),
left-pads prompts and right-pads responses (`Rollout.from_responses`, position ids from the mask) and scores with
`RLHFEngine.reward_scores` (`role_engine.sequence_scores`: the score at the last real token). Prompts longer than the
reward model's positions allow are cut from the left.
With `--reward_use_chat_template` (any reward tokenizer, its own vocabulary or not) each sample is instead the
conversation [user: the data row's prompt text, assistant: the response] through the reward tokenizer's chat
template: the prompt part is the template with the generation prompt, the response part what the assistant turn
adds to it (closing tokens included, whether or not the response ended with a stop token).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch

from ..comm import all_reduce
from ..hf_fields import max_positions
from ..rewards.reward_inputs import encode_conversations, encode_texts, pad_id_of, reward_model_rollout
from ..rollout import Rollout
from .experience import decode_rollout

log = logging.getLogger(__name__)


class RewardNormalizer:
    """Running mean / std of every score seen, over all ranks (see the module docstring)."""

    def __init__(self, eps: float = 1e-8):
        self.eps = eps
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 1.0

    def update(self, scores: torch.Tensor) -> None:
        """Merge this rank's `scores` and every other rank's (collective: call on every rank)."""
        x = scores.detach().double().flatten()
        packed = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), x.sum(),
                              (x * x).sum()])
        n, s, ss = all_reduce(packed).tolist()
        if n <= 0:
            return
        mean_b = s / n
        m2_b = max(ss - n * mean_b * mean_b, 0.0)
        total = self.count + n
        delta = mean_b - self.mean
        self.mean += delta * n / total
        self.m2 += m2_b + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        return ((scores.double() - self.mean) / (self.std + self.eps)).to(scores.dtype)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """Update with this batch (all ranks), then normalize it."""
        self.update(scores)
        return self.normalize(scores)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def apply_missing_eos_penalty(scores: torch.Tensor, ended_with_eos: torch.Tensor, penalty: float) -> torch.Tensor:
    """score - penalty for every row that did not end with a stop token (penalty >= 0; 0 = unchanged)."""
    if not penalty:
        return scores
    return scores - penalty * (~ended_with_eos.bool()).to(scores.device, scores.dtype)


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """[B] DAPO's soft overlong penalty (<= 0): -factor x (n - (max_len - buffer_len)) / buffer_len for a response of
    n > max_len - buffer_len tokens, else 0 (buffer_len 0: off)."""
    n = response_lengths.float()
    if not buffer_len:
        return torch.zeros_like(n)
    return -float(factor) * (n - (max_len - buffer_len)).clamp(min=0) / float(buffer_len)


class ScoreShaper:
    """Steps 2, 3a and 3 of the module docstring for one trainer; `active` is False when all are off."""

    def __init__(self, normalize: bool, missing_eos_penalty: float, overlong_buffer_len: int = 0,
                 overlong_penalty_factor: float = 1.0, max_answer_seq_len: int = 0):
        self.normalizer = RewardNormalizer() if normalize else None
        self.missing_eos_penalty = float(missing_eos_penalty or 0.0)
        self.overlong = (int(overlong_buffer_len or 0), float(overlong_penalty_factor), int(max_answer_seq_len))

    @property
    def active(self) -> bool:
        return self.normalizer is not None or self.missing_eos_penalty != 0.0 or self.overlong[0] > 0

    def __call__(self, scores: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        if self.normalizer is not None:
            scores = self.normalizer(scores)
        buffer_len, factor, max_len = self.overlong
        if buffer_len:
            scores = scores + overlong_penalty(rollout.response_lengths, max_len, buffer_len, factor).to(scores.device)
        return apply_missing_eos_penalty(scores, rollout.ended_with_eos, self.missing_eos_penalty)


# ---- a reward model with its own tokenizer ---------------------------------------------------------------------
def same_vocab(a: Any, b: Any) -> bool:
    """Whether two tokenizers map every token to the same id."""
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()


class RetokenizedRewardModel:
    """A `RewardFn` scoring with the reward engine through the reward model's own tokenizer (module docstring)."""

    source_name = "reward model (re-tokenized)"

    def __init__(self, engine: Any, tokenizer: Any, max_positions: Optional[int] = None,
                 use_chat_template: bool = False):
        self.engine, self.tokenizer, self.max_positions = engine, tokenizer, max_positions
        self.use_chat_template = use_chat_template
        self.pad_token_id = pad_id_of(tokenizer)

    def encode(self, rollout: Rollout) -> Rollout:
        """The rows of `rollout` in the reward tokenizer's ids, canonical layout (on the rollout's device): built by
        rewards/reward_inputs.py, as the reference reward server builds them."""
        prompts, responses = decode_rollout(self.engine.tokenizer, rollout)
        ended = rollout.ended_with_eos.bool().tolist()
        if self.use_chat_template:
            if rollout.rows is None:
                raise ValueError("reward_use_chat_template needs each sample's data row (Rollout.rows): the rollout "
                                 "does not come from a prompt dataset")
            p_ids, r_ids = encode_conversations(self.tokenizer, [row.text for row in rollout.rows], responses)
        else:
            p_ids, r_ids = encode_texts(self.tokenizer, prompts, responses, ended)
        out = reward_model_rollout(p_ids, r_ids, ended, self.pad_token_id, self.max_positions)
        return out.to(rollout.sequences.device)

    def __call__(self, prompt_ids: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        return self.engine.reward_scores(self.encode(rollout))


def reward_model_scorer(engine: Any, cfg: Any) -> Optional[RetokenizedRewardModel]:
    """The re-tokenizing scorer when the run has a reward model with its own tokenizer
    (`reward_tokenizer_name_or_path`) whose vocabulary differs from the actor's, or that scores conversations
    (`reward_use_chat_template`); None otherwise (the actor's ids are the reward model's)."""
    chat = bool(cfg.reward.use_chat_template)
    path = cfg.reward.tokenizer_name_or_path or (cfg.reward.model_name_or_path if chat else "")
    if cfg.scored_without_model or not path or "reward" not in engine.engines:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if same_vocab(tok, engine.tokenizer) and not chat:
        return None
    module = engine.reward.module
    config = getattr(getattr(module, "hf_model", module), "config", None)
    limit = max_positions(config)
    if engine.dist.is_main:
        log.info("reward model has its own tokenizer (%s, %d tokens vs the actor's %d): prompts and responses are "
                 "decoded and re-encoded for it", path, len(tok), len(engine.tokenizer))
    if chat and engine.dist.is_main:
        log.info("reward model scores conversations through the chat template of %s", path)
    return RetokenizedRewardModel(engine, tok, limit, use_chat_template=chat)
