"""Episodes played ahead of training through rollout servers (`--environment` with `--rollout_servers` and
`--max_staleness K >= 1`, docs/rollout-servers.md).

Each trainer rank plays its own episodes, as at K = 0, but in a thread of its own: every batch that trainer/ahead.py
submits is played there turn by turn while the trainer trains, each turn's requests sent straight to the servers on
the weights they hold then. The thread never pushes and calls nothing collective: the pushes stay on the trainer's
main thread, and a turn asked during a push waits in the server's queue until the push resumes it. Every token keeps
the weight version that sampled it, so an episode may span versions; ahead.py counts staleness per token and plays a
batch again when a token is past K.

Reproducible where it can be: a batch's sampling seeds come from one draw of this rank's torch stream at submission
(a generator of the batch's own), so a rerun samples the same however the thread is timed; batches are played one
after another in submission order (one runner, one pool of environment calls). The environments' own draws from
python's or numpy's global streams are not seeded here: a thread must not reseed the trainer's streams.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Optional

import torch

from .. import comm
from ..engine.generation.base import Generated, SamplingParams


class EpisodesAhead:
    """What trainer/ahead.py asks of a backend (submit, result, generate, sync_weights, actor_version) for episodes
    through rollout servers: `backend` is the ServersBackend, `runner` the run's envs.EpisodeRunner."""

    def __init__(self, backend: Any, runner: Any):
        self.backend, self.runner = backend, runner
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="episodes-ahead")
        self._tickets: dict = {}
        self._ticket = 0
        comm.at_shutdown(self.close)

    def close(self) -> None:
        """Batches not started are dropped; one being played ends with its current request or environment call
        (bounded by rollout_timeout_s / env_timeout_s: the interpreter joins the thread at exit)."""
        self._thread.shutdown(wait=False, cancel_futures=True)

    @property
    def actor_version(self) -> int:
        return self.backend.actor_version

    def sync_weights(self) -> bool:
        return self.backend.sync_weights()

    def submit(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
               rows: list) -> int:
        """Queue this batch's episodes (its data rows) on the thread and return at once: a ticket for `result`."""
        seed = int(torch.randint(0, 2**31 - 1, ())) if params.do_sample else 0  # the main thread's stream
        self._ticket += 1
        self._tickets[self._ticket] = self._thread.submit(self._play, prompt_ids, prompt_mask, list(rows), seed)
        return self._ticket

    def _play(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: list, seed: int) -> tuple:
        generator = torch.Generator().manual_seed(seed)
        return self.runner.play(prompt_ids, prompt_mask, rows,
                                sample=lambda ids, mask, p: self.backend.request(ids, mask, p, generator))

    def result(self, ticket: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               params: SamplingParams) -> Generated:
        """The ticket's episodes (waited for: ServersBackend.await_answers) with each action token's weight version.
        Collective: every rank learns whether any rank's thread failed (a server, or a bug), and then every rank
        stops; an environment failure is returned in `failure` as the trainer expects it."""
        t0 = time.perf_counter()
        played, wrong = None, None
        future = self._tickets.pop(ticket)
        self.backend.await_answers([future])  # with no server up, the ranks re-admit one that answers again
        try:
            played = future.result()
        except Exception as e:  # noqa: BLE001  (the peers must learn of it, or they wait in the gather below)
            lost = isinstance(e, self.backend.lost_errors)  # no server up, or an answer the run cannot train on
            wrong = ("servers", str(e)) if lost else ("bug", f"{type(e).__name__}: {e}")
        self.backend.trainer_wait += time.perf_counter() - t0
        wrong = next((w for w in comm.all_gather_object(wrong, group=self.backend.wait_group) if w), None)
        if wrong is not None:
            from ..errors import RolloutServersLost

            if wrong[0] == "servers":
                raise RolloutServersLost(f"playing episodes ahead of training: {wrong[1]}")
            raise RuntimeError(f"playing episodes ahead of training failed on a rank: {wrong[1]}")
        rollout, logprobs, stats, failure, versions = played
        now = self.backend.actor_version
        if failure is not None:  # the trainer stops every rank with it
            return Generated(None, episode_stats=stats, policy_version=now, failure=str(failure))
        mask = rollout.action_mask.bool()
        if versions is None:  # no turn was generated (every episode failed at its start under score_zero)
            versions = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
        spans = [set(versions[i][mask[i]].tolist()) for i in range(versions.shape[0])]
        self.backend.partial += sum(len(s) > 1 for s in spans)  # episodes whose turns met a push
        oldest = int(versions[mask].min()) if bool(mask.any()) else now
        return Generated(rollout, logprobs, stats, policy_version=oldest, token_versions=versions)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 rows: Optional[list] = None) -> Generated:
        """The batch's episodes played again on the current weights (ahead.py's guard against a token past K)."""
        self.sync_weights()
        return self.result(self.submit(prompt_ids, prompt_mask, params, rows), prompt_ids, prompt_mask, params)
