"""PPO-ptx (InstructGPT): a language-modelling loss on unsupervised text added to the actor's PPO loss.

The documents and their sharded, resumable stream are the data layer's (data/ptx.py). Every actor mini-batch draws
`gradient_accumulation_steps` ptx micro-batches, one per PPO micro-batch.

Loss: for micro-batch k of a mini-batch, `ptx_loss_k = sum of -log p(token) over its real tokens (all but the first
of each document: nothing predicts it) / N`, N = the real-token count of the mini-batch's ptx micro-batches on ALL
ranks (one all-reduce, shared with the PPO token count). The actor's loss of that micro-batch is
`policy_loss_k (+ entropy term) + unsup_coef * ptx_loss_k`, and ONE backward is made (DeepSpeed counts one backward
per accumulation step). So the ptx term is a token mean over the whole mini-batch (nats per token) for any micro-batch
split and rank count, like the policy loss. `ptx/loss` logs that token mean (without the coefficient), averaged over
the mini-batches of the iteration. Right-padded batches, position ids from the mask, temperature 1 (`ppo_math.sft_loss`,
the SFT loss). No ptx during critic warm-up (the actor does not train).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..data.ptx import PtxBatch, PtxData, PtxDataset
from ..ppo_math import sft_loss


def ptx_loss(engine: Any, batch: PtxBatch, num_tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The actor's training forward on a ptx batch -> (sum of -log p over its trained tokens / num_tokens, stats)."""
    actor = engine.actor
    actor.train()
    logits = actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   use_cache=False).logits
    return sft_loss(logits, batch.input_ids, batch.attention_mask, num_tokens=num_tokens)


def build_ptx(cfg: Any, engine: Any, data: Optional[PtxDataset]) -> Optional[PtxData]:
    """The run's ptx stream over the planned documents, or None without ptx."""
    if data is None:
        return None
    dist = engine.dist
    b = cfg.batch
    return PtxData(data, b.per_device_training_batch_size, b.gradient_accumulation_steps, dist.rank,
                   dist.world_size, cfg.seed, engine.pad_token_id)
