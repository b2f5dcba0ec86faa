"""Rollouts generated ahead of training (`--max_staleness K >= 1` with rollout servers, docs/rollout-servers.md).

At iteration k the trainer takes the batches of iteration k (submitted earlier), then pushes its current weights and
submits iterations up to k + K, which the servers generate while the trainer computes the experience of k and trains
on it. Servers stamp every token with the weight version that sampled it: a token's staleness is the trainer's
version when it trains on it minus that version, at most K by construction (a response with a token past K is
generated again by the backend, `async/dropped_responses`; a batch still past K here is generated again whole,
`async/dropped_batches`). The PPO objective is decoupled, as AReaL's: the proximal policy is the trainer's own
recompute at the start of the update (the old log-probs), the behaviour policy the servers' log-probs, corrected by
`--rollout_correction` (token_truncate by default with K >= 1). With an environment each batch goes with its data
rows and its episodes are played ahead in a thread of this rank's (trainer/episodes_ahead.py).

The data position a checkpoint saves is the first prompt not trained on: the prompts of batches in flight are drawn
again after a resume (their rollouts are discarded). Nothing is submitted past the run's last iteration.

A push waits for the requests in flight (vLLM's pause mode wait), so without `--partial_rollouts` K >= 2 overlaps no
more than K = 1; with it the push pauses them where they are (mode keep) and a response may span two versions.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

from .. import comm
from ..data.prompts import collate_prompts


class RolloutsAhead:
    """Iterations of rollout batches in flight on the servers; `take(iteration)` gives one iteration's, as
    `PPOTrainer.rollout_phase` would have generated them."""

    strict_on_resume = True  # takes the checkpointer's strict flag (--resume_force remaps the data position)

    def __init__(self, backend: Any, cursor: Any, dataset: Any, batch_cfg: Any, sampling: Any, pad_token_id: int,
                 max_staleness: int, iterations: int, episodes: bool = False):
        self.backend, self.cursor, self.dataset = backend, cursor, dataset
        self.episodes = episodes  # an environment: each batch's episodes are played ahead (its rows go along)
        self.batch_cfg, self.sampling, self.pad = batch_cfg, sampling, pad_token_id
        self.max_staleness, self.iterations = max_staleness, iterations
        self.next_iteration = 0  # the iteration the next submission is for
        self.pending: collections.deque = collections.deque()  # per iteration: (data position before it, batches)
        # of the last taken iteration: per token where the backend stamps each token's version, else per batch
        self.staleness: list = []
        self.dropped = 0

    def _draw(self) -> list:
        """One iteration's prompt batches: (ids, mask, rows) each, in the data order."""
        n = self.batch_cfg.n_samples_per_prompt
        out = []
        for _ in range(self.batch_cfg.generation_batches):
            _, _, idx = next(self.cursor)
            ids, mask = collate_prompts(self.dataset, idx, self.pad)
            if n > 1:
                ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
            out.append((ids, mask, self.dataset.rows(idx, repeat=n)))
        return out

    def _submit(self) -> None:
        position = self.cursor.state_dict()
        batches = [(self.backend.submit(ids, mask, self.sampling, self._rows(rows)), ids, mask, rows)
                   for ids, mask, rows in self._draw()]
        self.pending.append((position, batches))
        self.next_iteration += 1

    def take(self, iteration: int) -> list:
        """The iteration's Generated batches (rows attached); then the current weights go out and the next
        iterations are submitted. Collective on the trainer's ranks."""
        if not self.pending:  # the first iteration, or the first after a resume
            self.backend.sync_weights()
            self.next_iteration = iteration
            self._submit()
        _, batches = self.pending.popleft()
        version = self.backend.actor_version
        taken = [self.backend.result(ticket, ids, mask, self.sampling) for ticket, ids, mask, _ in batches]
        # a batch played again and an environment failure both lead into collectives: every rank takes the same path
        every = comm.all_gather_object(([version - g.policy_version > self.max_staleness for g in taken],
                                        any(g.failure is not None for g in taken)))
        failed = any(f for _, f in every)
        gens, self.staleness = [], []
        for i, (gen, (_, ids, mask, rows)) in enumerate(zip(taken, batches)):
            if not failed and any(stale[i] for stale, _ in every):  # cannot happen in this pipeline: guarded anyway
                self.dropped += 1
                gen = self.backend.generate(ids, mask, self.sampling, self._rows(rows))
            if gen.token_versions is not None:
                mask = gen.rollout.action_mask.bool()
                self.staleness.extend((version - gen.token_versions[mask]).tolist())
            else:
                self.staleness.append(version - gen.policy_version)
            if gen.rollout is not None:  # None: an environment failed (gen.failure; the trainer stops with it)
                gen = dataclasses.replace(gen, rollout=gen.rollout.with_rows(rows))
            gens.append(gen)
        if failed:  # an environment failed on some rank: the trainer stops every rank with it
            return gens
        self.backend.sync_weights()  # the weights of this iteration's update are the next batches' policy
        while len(self.pending) < self.max_staleness and self.next_iteration < self.iterations:
            self._submit()
        return gens

    def _rows(self, rows: list):
        return list(rows) if self.episodes else None

    def take_counts(self) -> dict:
        out = {"async/dropped_batches": self.dropped}
        self.dropped = 0
        return out

    # ---- checkpoint: the first prompt not trained on ---------------------------------------------------------
    def state_dict(self) -> dict:
        return self.pending[0][0] if self.pending else self.cursor.state_dict()

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        self.pending.clear()  # rollouts in flight belong to the interrupted run
        self.cursor.load_state_dict(state, strict)
