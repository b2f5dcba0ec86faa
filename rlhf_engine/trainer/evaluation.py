"""Evaluation in the loop: greedy generation on held-out prompts, scored like training rollouts.

Every rank takes an equal share of the eval prompts (the last share is filled by repeating prompts, and repeated rows
are not counted), so every rank makes the same number of `generate` calls, which ZeRO-3 needs.

Metrics: eval/score, eval/response_length, eval/eos_rate. No eval/kl: the actor-reference log-ratio summed along a
GREEDY response is not an estimate of KL(actor || reference) (that needs responses sampled from the actor), so it is
not reported; the training rollouts' objective/kl is the KL of the sampled responses.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from ..data.prompts import PromptDataset, collate_prompts
from ..outputs.run_dir import RunDir
from .experience import decode_rollout


class Evaluator:
    def __init__(self, dataset: PromptDataset, batch_size: int, rank: int, world_size: int):
        self.dataset = dataset
        n = len(dataset)
        per_rank = -(-n // world_size)  # ceil
        pad = per_rank * world_size - n
        order = list(range(n)) + [i % n for i in range(pad)]
        real = [True] * n + [False] * pad
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        self.indices, self.real = order[shard], real[shard]
        self.batch_size = batch_size

    def run(self, engine, source) -> tuple[dict, list[dict]]:
        """-> (metrics eval/score, eval/response_length, eval/eos_rate over all ranks; this rank's samples)."""
        from ..comm import all_reduce

        sums = torch.zeros(4, dtype=torch.float64, device=engine.device)  # count, score, length, ended with a stop
        samples = []
        params = engine.sampling.greedy()  # its own sampling parameters: the run's config is never changed
        for start in range(0, len(self.indices), self.batch_size):
            idx = self.indices[start:start + self.batch_size]
            real = torch.tensor(self.real[start:start + self.batch_size], device=engine.device)
            ids, mask = collate_prompts(self.dataset, idx, engine.pad_token_id)
            rollout = engine.generate(ids, mask, params).with_rows(self.dataset.rows(idx))
            scores = torch.as_tensor(source(rollout.prompts, rollout)).to(engine.device, torch.float64)
            w = real.double()
            sums += torch.stack([w.sum(), (scores * w).sum(), (rollout.response_lengths.double() * w).sum(),
                                 (rollout.ended_with_eos.double() * w).sum()])
            prompts, responses = decode_rollout(engine.tokenizer, rollout)
            samples += [{"prompt": p, "response": r, "score": float(s)}
                        for p, r, s, keep in zip(prompts, responses, scores.tolist(), real.tolist()) if keep]
        n, score, length, eos = all_reduce(sums).tolist()
        n = max(n, 1.0)
        return {"eval/score": score / n, "eval/response_length": length / n, "eval/eos_rate": eos / n}, samples


def write_eval_samples(output_dir: str, iteration: int, samples: list[dict], limit: Optional[int] = 8) -> None:
    """Append this evaluation's first samples to `<output_dir>/eval_samples.jsonl` (before/after comparisons)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(RunDir(output_dir).eval_samples, "a", encoding="utf-8") as f:
        for s in samples[:limit]:
            f.write(json.dumps({"iteration": iteration, **s}) + "\n")
