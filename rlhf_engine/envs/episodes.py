"""Playing a batch of episodes: generate a turn for every unfinished row, let each row's environment answer, append
its observation as context, until every episode is done, out of turns or out of tokens.

Each turn is one generation call over the unfinished rows, their whole context (prompt and every earlier turn) as the
prompt: the backend prefills it again (docs/environments.md has the measurement against continuing from the cache).
Every row of a call may write max_answer_seq_len tokens, or its own episode's room when that is less
(`SamplingParams.row_limits`): a row's turn never depends on its batch-mates or on the world size. A turn cut by its
episode's room goes to the environment like any other turn (as a response cut at max_answer_seq_len is scored) and
the episode is truncated: it ends there. One rule for a turn at a cap without a stop: the environment sees it; the
episode is truncated only where the episode's room, not the per-turn cap, cut it.
A turn is also cut at the environment's stop strings, on the sampled ids (a prefix of a sample is a sample). Under
ZeRO-3 on several ranks every generate call is collective, so the ranks agree each turn (one all-reduce) whether any
still plays, and a rank whose episodes are all over generates a throw-away token from a bare prompt while another
rank still plays.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..comm import all_reduce
from ..rollout import PromptRow, Rollout, pad_prompts
from .base import EnvironmentFailure, as_step
from .calls import EnvCalls
from .turns import TurnFormat, contains_stop_string, cut_at_stop_strings


@dataclass
class Episode:
    env: Any
    prompt: list[int]
    prompt_mask: list[int]
    tokens: list[int] = field(default_factory=list)  # after the prompt: actions and context
    actions: list[int] = field(default_factory=list)  # 1 = the model wrote it
    logprobs: list[float] = field(default_factory=list)  # generation-time, 0 at context
    versions: list[int] = field(default_factory=list)  # rollout servers: each token's weight version, 0 at context
    rewards: list[float] = field(default_factory=list)  # each turn's reward on its last action
    turn_rewards: list[float] = field(default_factory=list)
    observation_tokens: int = 0
    over: bool = False
    truncated: bool = False
    ended_with_eos: bool = False
    error: Optional[str] = None


@dataclass
class EpisodeStats:
    """Sums over one batch of episodes (trainer/ppo_metrics.py turns them into env/* metrics)."""

    episodes: int = 0
    turns: int = 0
    observation_tokens: int = 0
    truncated: int = 0
    errors: int = 0
    abandoned_calls: int = 0  # environment calls given up on after env_timeout_s in this batch (threads left alive)
    turn_reward_sums: list = field(default_factory=list)  # [k]: the summed reward of every episode's turn k
    turn_counts: list = field(default_factory=list)  # [k]: episodes that played a turn k

    def add_to(self, stats: Any) -> None:
        """Into a MetricSums (every key a sum, all-reduced with the iteration's metrics)."""
        for key in ("episodes", "turns", "observation_tokens", "truncated", "errors", "abandoned_calls"):
            stats.add(f"env_{key}", torch.tensor(float(getattr(self, key))))
        for k, (s, n) in enumerate(zip(self.turn_reward_sums, self.turn_counts)):
            stats.add(f"env_turn{k + 1}_reward_sum", torch.tensor(float(s)))
            stats.add(f"env_turn{k + 1}_count", torch.tensor(float(n)))


class EpisodeRunner:
    """Built once per run. `sample(ids, mask, params)` is the engine's generation (an object with `.rollout` and
    `.logprobs`, engine/generation); `collective()` says whether the ranks must make the same generate calls, of the
    same length; `params` the run's SamplingParams; `on_error` is env_errors."""

    def __init__(self, factory: Callable, turns: TurnFormat, sample: Callable[..., Any],
                 collective: Callable[[], bool], params: Any, *, max_turns: int, max_episode_tokens: int,
                 max_prompt_len: int, stop_token_ids: Sequence[int], pad_token_id: int, calls: EnvCalls,
                 on_error: str = "stop", device: Optional[torch.device] = None):
        self.factory, self.turns, self.sample, self.collective = factory, turns, sample, collective
        self.params = params  # the run's SamplingParams; each turn asks for at most the room the episodes have
        self.max_turns, self.budget, self.max_prompt_len = max_turns, max_episode_tokens, max_prompt_len
        self.stops, self.pad = set(int(t) for t in stop_token_ids), int(pad_token_id)
        self.calls, self.on_error, self.device = calls, on_error, device or torch.device("cpu")
        self.tokenizer = turns.tokenizer

    @classmethod
    def for_run(cls, cfg: Any, factory: Callable, tokenizer: Any, sample: Callable[..., Any],
                collective: Callable[[], bool], params: Any, calls: EnvCalls,
                device: Optional[torch.device] = None) -> "EpisodeRunner":
        """The runner of a run's config (`cfg`: TrainConfig)."""
        env, g = cfg.env, cfg.generation
        return cls(factory, TurnFormat(tokenizer, bool(cfg.data.use_chat_template)), sample, collective, params,
                   max_turns=env.max_turns, max_episode_tokens=cfg.response_budget, max_prompt_len=g.max_prompt_seq_len,
                   stop_token_ids=params.stop_token_ids, pad_token_id=params.pad_token_id, calls=calls,
                   on_error=env.env_errors, device=device)

    # ---- one batch ---------------------------------------------------------------------------------------------
    def run(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: Sequence[PromptRow]
            ) -> tuple[Optional[Rollout], Optional[torch.Tensor], EpisodeStats, Optional[EnvironmentFailure]]:
        """Episodes of a left-padded prompt batch [B, P] and its data rows -> (the rollout, its [B, R] generation
        log-probs (0 at context), the batch's sums, None), or (None, None, sums, the failure) after an environment
        failure under env_errors 'stop': the other episodes end at once and the trainer stops every rank
        together."""
        return self.play(prompt_ids, prompt_mask, rows)[:4]

    def play(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: Sequence[PromptRow],
             sample: Optional[Callable[..., Any]] = None) -> tuple:
        """As `run`, plus a fifth item: the [B, R] long weight version of every action token (0 at context and
        padding) where the generation stamps its tokens (`token_versions`: rollout servers), else None. `sample`
        replaces the runner's generation for this batch (episodes played ahead of training: their own seeds)."""
        sample = sample or self.sample
        stamped = False  # whether the generation stamped its tokens with weight versions (rollout servers)
        # one entry per possible turn on every rank: the metric keys must be the same everywhere
        stats = EpisodeStats(episodes=len(rows), turn_reward_sums=[0.0] * self.max_turns,
                             turn_counts=[0] * self.max_turns)
        failure: list[EnvironmentFailure] = []
        abandoned_before = self.calls.abandoned  # the resets' calls count too
        try:
            episodes = self._start(prompt_ids, prompt_mask, rows, stats, failure)
        except Exception as e:  # noqa: BLE001  (as in a turn below: end here, keep the protocol, stop together)
            failure[:0] = [EnvironmentFailure(f"starting the episodes: {type(e).__name__}: {e}")]
            # over, with the rows' own prompts (a throw-away turn for collective peers needs a real prompt)
            episodes = [Episode(None, prompt_ids[i].tolist(), prompt_mask[i].tolist(), over=True)
                        for i in range(len(rows))]
        for turn in range(self.max_turns):
            live = [e for e in episodes if not e.over]
            if not self._any_live(bool(live)):
                break
            # not inside the try: a failing generate call is not the environment's, and where generation is
            # collective the peers wait inside it, so this rank must not go on to the next turn's all-reduce (the
            # error ends this process, and the launcher the job)
            gen, limits = self._generate(live, episodes, sample)
            if not live:
                continue
            stamped = stamped or getattr(gen, "token_versions", None) is not None
            try:
                self._play_turn(live, episodes, turn, rows, stats, failure, gen, limits)
            except Exception as e:  # noqa: BLE001  (this rank's own step: it ends its episodes and keeps the
                # turn protocol with its peers; the trainer then stops every rank with this error)
                failure[:0] = [EnvironmentFailure(f"turn {turn + 1}: {type(e).__name__}: {e}")]
                for episode in episodes:
                    episode.over = True
        stats.abandoned_calls = self.calls.abandoned - abandoned_before
        if failure:
            return None, None, stats, failure[0], None
        for e in episodes:
            stats.turns += len(e.turn_rewards)
            stats.observation_tokens += e.observation_tokens
            stats.truncated += int(e.truncated)
        ids, mask = pad_prompts([e.prompt for e in episodes], self.pad, [e.prompt_mask for e in episodes])
        rollout = Rollout.from_responses(ids, mask, [e.tokens for e in episodes], self.pad,
                                         ended_with_eos=[e.ended_with_eos for e in episodes],
                                         actions=[e.actions for e in episodes],
                                         turn_rewards=[e.rewards for e in episodes])
        logprobs = torch.zeros(rollout.action_mask.shape, dtype=torch.float32)
        versions = torch.zeros(rollout.action_mask.shape, dtype=torch.long) if stamped else None
        for i, e in enumerate(episodes):
            logprobs[i, :len(e.logprobs)] = torch.tensor(e.logprobs, dtype=torch.float32)
            if versions is not None:
                versions[i, :len(e.versions)] = torch.tensor(e.versions, dtype=torch.long)
        if versions is not None:
            versions = (versions * rollout.action_mask.cpu().long()).to(self.device)
        return rollout.to(self.device), logprobs.to(self.device), stats, None, versions

    def _start(self, prompt_ids, prompt_mask, rows, stats, failure) -> list[Episode]:
        def start(row: PromptRow) -> tuple[Any, Optional[str]]:
            env = self.factory({**row.columns, "prompt": row.text})
            return env, env.reset()

        outcomes = self.calls.run([lambda r=r: start(r) for r in rows])
        episodes = []
        for i, (row, out) in enumerate(zip(rows, outcomes)):
            real = prompt_mask[i].bool()
            first = int(real.long().argmax()) if bool(real.any()) else prompt_mask.shape[1]
            ids, mask = prompt_ids[i, first:].tolist(), prompt_mask[i, first:].tolist()
            env, message = out.value if out.error is None else (None, None)
            if out.error is None and message is not None:
                if not isinstance(message, str) or not message:
                    out.error = f"reset() returned {message!r}; expected a non-empty first user message or None"
                else:
                    ids = self.turns.first_prompt(message)
                    mask = [1] * len(ids)
                    if len(ids) > self.max_prompt_len:
                        out.error = (f"reset()'s first message is {len(ids)} tokens, longer than max_prompt_seq_len "
                                     f"({self.max_prompt_len})")
            if out.error is not None:  # the row's own prompt (a first message that failed is not used)
                ids, mask = prompt_ids[i, first:].tolist(), prompt_mask[i, first:].tolist()
            e = Episode(env, ids, mask)
            if out.error is not None:  # under score_zero the row still plays one turn (every row needs a response)
                self._fail(e, f"environment reset for row {i} (prompt {row.text[:80]!r}): {out.error}", stats,
                           failure)
                e.env, e.over = None, False
            episodes.append(e)
        if failure:
            for e in episodes:
                e.over = True
        return episodes

    def _fail(self, e: Episode, message: str, stats: EpisodeStats, failure: list) -> None:
        # an episode that failed is an error, not also truncated (its last turn may have filled the room)
        e.over, e.error, e.truncated = True, message, False
        stats.errors += 1
        if self.on_error == "stop" and not failure:
            failure.append(EnvironmentFailure(message + " (env_errors 'score_zero' ends such an episode there, "
                                              "the failed turn scoring 0, instead of stopping)"))

    def _any_live(self, live: bool) -> bool:
        """Whether any rank still plays: one all-reduce where generate calls are collective, so that every rank
        makes the same number of calls."""
        if not self.collective():
            return live
        flag = torch.tensor([float(live)], device=self.device)
        return all_reduce(flag, "max").item() > 0

    def _generate(self, live: list[Episode], episodes: list[Episode], sample: Callable[..., Any]
                  ) -> tuple[Any, tuple]:
        """The turn's generate call through `sample`: (its output, each live row's token limit)."""
        if live:  # each row to its own room: no context outgrows the positions checked at start-up
            batch = [(e.prompt + e.tokens, e.prompt_mask + [1] * len(e.tokens)) for e in live]
            limits = tuple(min(self.budget - len(e.tokens), self.params.max_new_tokens) for e in live)
        else:  # keeping collective peers company: one token from a bare prompt (any context may be at its budget)
            batch, limits = [(episodes[0].prompt, episodes[0].prompt_mask)], (1,)
        ids, mask = pad_prompts([b[0] for b in batch], self.pad, [b[1] for b in batch])
        # max_new_tokens stays the run's on every rank: lockstep decoding (per-layer ZeRO-3) needs the same bound
        return sample(ids, mask, dataclasses.replace(self.params, row_limits=limits)), limits

    def _play_turn(self, live: list[Episode], episodes: list[Episode], turn: int, rows, stats, failure, gen: Any,
                   limits: tuple) -> None:
        r = gen.rollout
        responses = r.responses.tolist()
        lengths = r.response_lengths.tolist()
        lps = gen.logprobs.tolist() if gen.logprobs is not None else None
        stamps = getattr(gen, "token_versions", None)
        stamps = stamps.tolist() if stamps is not None else None
        texts = []
        for j, e in enumerate(live):
            resp = responses[j][:int(lengths[j])]
            stop_strings = getattr(e.env, "stop_strings", ()) or ()
            keep = cut_at_stop_strings(self.tokenizer, resp, stop_strings)
            closed_by = resp[keep - 1] if keep and resp[keep - 1] in self.stops else None
            ended = closed_by is not None or contains_stop_string(self.tokenizer, resp, stop_strings)
            resp = resp[:keep]
            e.tokens += resp
            e.actions += [1] * len(resp)
            e.logprobs += (lps[j][:keep] if lps is not None else [0.0] * keep)
            e.versions += (stamps[j][:keep] if stamps is not None else [0] * keep)
            e.rewards += [0.0] * len(resp)
            e.ended_with_eos = closed_by is not None
            # the turn filled the episode's room without ending itself: the budget cut the episode (a turn at the
            # per-turn cap with room left is not truncated: the episode goes on)
            e.truncated = len(e.tokens) >= self.budget and not ended
            texts.append(self.tokenizer.decode(resp, skip_special_tokens=True))
        # every turn goes to its environment, however it ended (a stop token, a stop string, the per-turn cap or the
        # episode's room), as a single-turn response cut at max_answer_seq_len is scored
        playing = [(e, t) for e, t in zip(live, texts) if e.env is not None]
        outcomes = iter(self.calls.run([lambda e=e, t=t: as_step(e.env.step(t)) for e, t in playing]))
        index = {id(e): i for i, e in enumerate(episodes)}
        for e in live:
            stats.turn_counts[turn] += 1
            if e.env is None:  # a failed reset (score_zero)
                e.turn_rewards.append(0.0)
                e.over = True
                continue
            out = next(outcomes)
            if out.error is not None:
                i = index[id(e)]
                self._fail(e, f"environment step {turn + 1} for row {i} (prompt {rows[i].text[:80]!r}): "
                              f"{out.error}", stats, failure)
                e.turn_rewards.append(0.0)
                continue
            step = out.value
            e.rewards[-1] += step.reward  # on the turn's last action
            e.turn_rewards.append(step.reward)
            stats.turn_reward_sums[turn] += step.reward
            if step.done or e.truncated or turn == self.max_turns - 1:
                e.over = True
                continue
            context = self.turns.context(step.observation, e.tokens[-1] if e.ended_with_eos else None)
            if len(e.tokens) + len(context) >= self.budget:  # no room for the observation and a model token
                e.over, e.truncated = True, True
                continue
            e.tokens += context
            e.actions += [0] * len(context)
            e.logprobs += [0.0] * len(context)
            e.versions += [0] * len(context)
            e.rewards += [0.0] * len(context)
            e.observation_tokens += len(context)
        if failure:
            for e in episodes:
                e.over = True
