"""Rollout sampling and the batch arithmetic of a PPO iteration."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import Problems
from .fields import check_positive, is_number, opt


@dataclass
class GenerationConfig:
    """Rollout sampling controls: rollouts are sampled from exactly the distribution PPO's log-probs describe. The
    model's own generation_config is not used (its sampling fields are named in a start-up warning)."""

    max_prompt_seq_len: int = opt(256, "Longest prompt in tokens; longer prompts are rejected by the data layer.")
    max_answer_seq_len: int = opt(256, "Maximum number of generated tokens per response.")
    min_answer_seq_len: int = opt(0, "Minimum number of generated tokens before a stop token may be sampled; every "
                                  "log-prob the trainer computes masks the stop tokens at those positions too.")
    temperature: float = opt(1.0, "Sampling temperature; the same temperature divides the logits in every log-prob "
                             "(old, reference, training).")
    top_p: float = opt(1.0, "Nucleus sampling mass: must stay 1.0 when sampling (a truncated distribution is not "
                       "the full softmax PPO's log-probs describe); used only with do_sample false, where it "
                       "does nothing.")
    top_k: int = opt(0, "Top-k sampling: must stay 0 (off) when sampling, for the same reason as top_p.")
    do_sample: bool = opt(True, "Sample (True) or decode greedily (False).")
    stop_token_ids: list = opt([], "Extra token ids that end a response. A response ends at the first of: these, the "
                               "tokenizer's EOS, the model generation_config's eos_token_id(s), and with "
                               "use_chat_template the template's end-of-turn token.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        check_positive(p, prefix, self, "max_prompt_seq_len", "max_answer_seq_len", "temperature")
        check_positive(p, prefix, self, "min_answer_seq_len", "top_k", allow_zero=True)
        if not (is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            p.add(prefix + "top_p", self.top_p, "must lie in (0, 1]")
        elif self.do_sample is True and self.top_p < 1.0:
            p.add(prefix + "top_p", self.top_p, "must be 1.0 when sampling: nucleus sampling draws from a truncated "
                  "distribution while PPO's log-probs describe the full softmax (every rollout would be off-policy); "
                  "lower temperature instead")
        if self.do_sample is True and isinstance(self.top_k, int) and self.top_k > 0:
            p.add(prefix + "top_k", self.top_k, "must be 0 when sampling: top-k sampling draws from a truncated "
                  "distribution while PPO's log-probs describe the full softmax; lower temperature instead")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            p.add(prefix + "stop_token_ids", self.stop_token_ids, "must be a list of token ids (integers >= 0)")
        if (is_number(self.min_answer_seq_len) and is_number(self.max_answer_seq_len)
                and self.min_answer_seq_len > self.max_answer_seq_len):
            p.add(prefix + "min_answer_seq_len", self.min_answer_seq_len,
                  f"must be <= max_answer_seq_len ({self.max_answer_seq_len})")


@dataclass
class BatchConfig:
    """Batch arithmetic of one iteration (per rank unless said otherwise)."""

    per_device_generation_batch_size: int = opt(4, "Prompts each rank generates for in one generate() call.")
    generation_batches: int = opt(1, "Rollout batches buffered per iteration before training on them.")
    per_device_training_batch_size: int = opt(4, "Micro-batch size of each actor/critic forward/backward.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step (one mini-batch).")
    experience_micro_batch_size: int = opt(0, "Micro-batch of the experience forwards (0 = the rollouts of one "
                                           "generation batch).")
    max_tokens_per_micro_batch: int = opt(0, "Micro-batches by a token budget instead of a row count: each mini-batch "
                                          "(per_device_training_batch_size x gradient_accumulation_steps rollouts) is "
                                          "cut, in order, into micro-batches of at most N real tokens (a longer "
                                          "rollout is one of its own); the ranks agree on the count (a rank with "
                                          "fewer runs empty ones). The experience forwards use the same "
                                          "micro-batches. 0 = per_device_training_batch_size rows.")
    n_samples_per_prompt: int = opt(1, "Responses sampled per prompt, on the same rank, one after another (a group). "
                                    "per_device_generation_batch_size keeps counting prompts; every rollout count "
                                    "(rollout_size, mini-batches) counts rollouts = prompts x n_samples_per_prompt. "
                                    "The group estimators need >= 2.")

    def validate(self, p: Problems, prefix: str = "") -> None:
        names = ("per_device_generation_batch_size", "generation_batches", "per_device_training_batch_size",
                 "gradient_accumulation_steps", "n_samples_per_prompt")
        check_positive(p, prefix, self, *names)
        check_positive(p, prefix, self, "experience_micro_batch_size", "max_tokens_per_micro_batch", allow_zero=True)
        for n in names + ("experience_micro_batch_size", "max_tokens_per_micro_batch"):  # 2.5 is no batch size
            if is_number(getattr(self, n)) and not isinstance(getattr(self, n), int):
                p.add(prefix + n, getattr(self, n), "must be a whole number")
        if any(not isinstance(getattr(self, n), int) or getattr(self, n) <= 0 for n in names):
            return
        rollout, mini = self.rollout_size, self.mini_batch_size
        samples = f" x n_samples_per_prompt ({self.n_samples_per_prompt})" if self.n_samples_per_prompt > 1 else ""
        if rollout % mini:
            p.add(prefix + "per_device_training_batch_size", self.per_device_training_batch_size,
                  f"per_device_generation_batch_size ({self.per_device_generation_batch_size}) x generation_batches "
                  f"({self.generation_batches}){samples} = {rollout} rollouts per rank must be a multiple of "
                  f"per_device_training_batch_size ({self.per_device_training_batch_size}) x "
                  f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) = {mini}; e.g. set "
                  f"generation_batches to a multiple of {mini // math.gcd(mini, self.generation_rollouts)}")

    @property
    def rollout_size(self) -> int:
        """Rollouts per rank per iteration (prompts x n_samples_per_prompt)."""
        return self.generation_rollouts * self.generation_batches

    @property
    def generation_rollouts(self) -> int:
        """Rollouts per rank of one generate() call: prompts x n_samples_per_prompt."""
        return self.per_device_generation_batch_size * self.n_samples_per_prompt

    @property
    def mini_batch_size(self) -> int:
        """Samples per rank per optimizer step."""
        return self.per_device_training_batch_size * self.gradient_accumulation_steps

    def describe(self, world_size: int) -> str:
        steps = self.rollout_size // self.mini_batch_size
        return (f"batch: {self.rollout_size} rollouts/rank/iteration x {world_size} ranks = "
                f"{self.rollout_size * world_size} per iteration; mini-batch {self.mini_batch_size}/rank "
                f"({self.per_device_training_batch_size} x {self.gradient_accumulation_steps} accumulation) -> "
                f"{steps} optimizer steps per PPO epoch")
