"""Step 1: supervised fine-tuning. The loss is the token mean of -log p(response token) over every response token of
the mini-batch on all ranks, the appended EOS included; prompt tokens and padding have weight exactly 0.

Each row is laid out as PPO lays out a rollout (prompt tokenized by the PPO data layer, left-padded; response + EOS,
right-padded; position ids from the mask), so the model learns the log-probs PPO's actor then computes for the same
ids. Metrics: `sft/loss` per optimizer step; `sft/eval_loss` and `sft/eval_ppl` (= exp(eval_loss)) at each epoch's end.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..config import SFTConfig
from ..data.supervised import SFTBatch, collate_sft, load_sft_data
from ..engine.role_engine import rollout_inputs
from ..hooks import TestHooks
from ..ppo_math import sft_loss
from .supervised import SupervisedTrainer, run_supervised, safe_exp


class SFTTrainer(SupervisedTrainer):
    name, kind, role = "sft", "causal_lm", "actor"
    plot_keys = ("sft/loss", "sft/eval_loss", "sft/eval_ppl")
    bar_keys = (("loss", "sft/loss"), ("eval_loss", "sft/eval_loss"))

    @classmethod
    def load_data(cls, cfg: SFTConfig, tokenizer: Any, verbose: bool):
        t = cfg.train
        return load_sft_data(cfg.data, tokenizer, t.max_prompt_seq_len, t.max_answer_seq_len,
                             response_column=cfg.response_column, long_response_policy=t.long_response_policy,
                             seed=cfg.seed, verbose=verbose)

    def collate(self, dataset, indices, row_mask=None) -> SFTBatch:
        return collate_sft(dataset, indices, self.pad_token_id, self.eos_token_id, row_mask)

    def count(self, batch: SFTBatch) -> torch.Tensor:
        return batch.num_tokens

    def forward_loss(self, batch: SFTBatch, denom: Optional[torch.Tensor]):
        r = batch.rollout.to(self.device)
        logits = self.engine(**rollout_inputs(r), use_cache=False).logits
        loss, s = sft_loss(logits, batch.labels.to(self.device), batch.loss_mask.to(self.device), num_tokens=denom)
        return loss, s

    def train_record(self, sums: dict) -> dict:
        return {"sft/loss": sums["nll_sum"] / max(sums["tokens"], 1.0), "sft/tokens": sums["tokens"]}

    def eval_record(self, sums: dict) -> dict:
        loss = sums["nll_sum"] / max(sums["tokens"], 1.0)
        return {"sft/eval_loss": loss, "sft/eval_ppl": safe_exp(loss)}


def run_sft(cfg: SFTConfig, argv: Optional[list] = None, hooks: Optional[TestHooks] = None) -> SFTTrainer:
    """Step 1 end to end: train, evaluate per epoch, export `<output_dir>/model` (train_ppo.py's actor)."""
    return run_supervised(cfg, SFTTrainer, argv, hooks)
