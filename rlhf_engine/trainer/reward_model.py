"""Step 2: a pairwise reward model. Loss: mean over the pairs of the mini-batch (all ranks) of
-log sigmoid(s_chosen - s_rejected - margin).

A score is read by `role_engine.sequence_scores` -- the function PPO's scorer (`RLHFEngine.reward_scores`) calls -- on
the canonical layout of (prompt + response + EOS): at the last real token, i.e. the EOS PPO responses end with. So the
reward model is trained on exactly the position, padding pattern and position ids PPO scores (DeepSpeed-Chat reads
PPO scores one position away from the one its reward model was trained on). Chosen and rejected rows go through one
forward (2B rows). Metrics: `rm/loss`, `rm/accuracy` (training pairs with s_chosen > s_rejected) per optimizer step;
`rm/eval_loss`, `rm/eval_accuracy`, `rm/score_gap` (mean s_chosen - s_rejected), `rm/chosen_score`,
`rm/rejected_score` on the held-out pairs at each epoch's end.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..config import RewardTrainConfig
from ..data.supervised import PairBatch, collate_pairs, load_preference_data
from ..engine.role_engine import sequence_scores
from ..hooks import TestHooks
from ..ppo_math import pairwise_loss
from ..rollout import Rollout
from .supervised import SupervisedTrainer, run_supervised


class RewardModelTrainer(SupervisedTrainer):
    name, kind, role = "rm", "scalar", "reward"
    plot_keys = ("rm/loss", "rm/accuracy", "rm/eval_accuracy", "rm/score_gap")
    bar_keys = (("loss", "rm/loss"), ("acc", "rm/accuracy"), ("eval_acc", "rm/eval_accuracy"))

    @classmethod
    def load_data(cls, cfg: RewardTrainConfig, tokenizer: Any, verbose: bool):
        t = cfg.train
        return load_preference_data(cfg.data, tokenizer, t.max_prompt_seq_len, t.max_answer_seq_len,
                                    chosen_column=cfg.chosen_column, rejected_column=cfg.rejected_column,
                                    long_response_policy=t.long_response_policy, seed=cfg.seed, verbose=verbose)

    def collate(self, dataset, indices, row_mask=None) -> PairBatch:
        return collate_pairs(dataset, indices, self.pad_token_id, self.eos_token_id, row_mask)

    def count(self, batch: PairBatch) -> torch.Tensor:
        return batch.pair_mask.sum()

    def scores(self, rollout: Rollout) -> torch.Tensor:
        """[B] scores of a layout: the step-2 scorer, i.e. `sequence_scores` (PPO's scoring function)."""
        return sequence_scores(self.engine, rollout.to(self.device))

    def forward_loss(self, batch: PairBatch, denom: Optional[torch.Tensor]):
        s = self.scores(batch.rollout)
        B = batch.num_pairs
        return pairwise_loss(s[:B], s[B:], margin=self.cfg.margin, pair_mask=batch.pair_mask.to(self.device),
                             num_pairs=denom)

    def train_record(self, sums: dict) -> dict:
        n = max(sums["pairs"], 1.0)
        return {"rm/loss": sums["loss_sum"] / n, "rm/accuracy": sums["correct"] / n}

    def eval_record(self, sums: dict) -> dict:
        n = max(sums["pairs"], 1.0)
        return {"rm/eval_loss": sums["loss_sum"] / n, "rm/eval_accuracy": sums["correct"] / n,
                "rm/score_gap": sums["gap_sum"] / n, "rm/chosen_score": sums["chosen_sum"] / n,
                "rm/rejected_score": sums["rejected_sum"] / n}


def run_reward_model(cfg: RewardTrainConfig, argv: Optional[list] = None,
                     hooks: Optional[TestHooks] = None) -> RewardModelTrainer:
    """Step 2 end to end: train, evaluate per epoch, export `<output_dir>/model` (a *ForSequenceClassification that
    train_ppo.py loads as reward model and critic)."""
    return run_supervised(cfg, RewardModelTrainer, argv, hooks)
