"""What a PPO trainer is made of, each built by one function from the run's resolved plan and engine (the recipe's
setup, as torchtune's): `PPOTrainer.__init__` calls them in order and lists its checkpoint state in one place."""
from __future__ import annotations

from typing import Any, Optional

from ..ppo_math import AdaptiveKLController, FixedKLController
from .evaluation import Evaluator
from .guards import LogprobDiffGuard, StepGuard
from .objectives import ActorObjective, CriticObjective
from .plan import RunPlan
from .reward_shaping import ScoreShaper
from .reward_sources import build_reward_source
from .state import Checkpointer
from .update import ActorStep, CriticStep, MicroBatchPlanner


def kl_controller(ppo: Any) -> FixedKLController:
    """The KL coefficient of the reward's penalty: fixed, or adapted towards kl_target."""
    if ppo.adaptive_kl:
        return AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
    return FixedKLController(ppo.kl_coef)


def score_shaper(ppo: Any, max_answer_seq_len: int) -> ScoreShaper:
    """scores -> (normalized, missing-EOS and overlong penalties) -> the reward's score."""
    return ScoreShaper(ppo.normalize_reward, ppo.missing_eos_penalty, ppo.overlong_buffer_len,
                       ppo.overlong_penalty_factor, max_answer_seq_len)


def step_guard(engine, ppo: Any, hooks) -> StepGuard:
    """The trained engines step together or neither; non-finite losses stop every rank (trainer/guards.py)."""
    return hooks.wrap_guard(StepGuard(engine, engine.trained_roles, ppo.max_consecutive_skips))


def logprob_guard(engine, ppo: Any) -> Optional[LogprobDiffGuard]:
    """Stops the run when the backend's log-probs stay past max_rollout_logprob_diff (trainer/guards.py); None when
    it is 0 or the backend gives no log-probs."""
    if not ppo.max_rollout_logprob_diff or not engine.generator.gives_logprobs:
        return None
    return LogprobDiffGuard(ppo.max_rollout_logprob_diff, engine.generator.name, is_main=engine.dist.is_main)


def micro_batch_planner(engine, batch: Any, hooks) -> MicroBatchPlanner:
    """Micro-batches of `per_device_training_batch_size` rows or of the token budget; the counts' reduction (the
    all-reduce, or a test's negative control: each rank's own counts times the world size)."""
    planner = MicroBatchPlanner(engine, batch.per_device_training_batch_size, bool(batch.max_tokens_per_micro_batch))
    return hooks.wrap_planner(planner, engine.dist.world_size)


def actor_step(engine, cfg: Any, guard: StepGuard, ptx: Optional[Any], hooks) -> ActorStep:
    """The actor's part of a micro-batch: its objective (policy loss, KL loss, entropy; trainer/objectives.py) and
    the ptx term."""
    objective = ActorObjective(engine, cfg.ppo, cfg.response_budget)
    unsup_coef = cfg.ptx.unsup_coef if ptx is not None else 0.0
    return hooks.wrap_update_step(ActorStep(engine, objective, guard, unsup_coef))


def critic_step(engine, ppo: Any, guard: StepGuard, hooks) -> Optional[CriticStep]:
    """The critic's part of a micro-batch (None in a run without a critic)."""
    if not engine.has_critic:
        return None
    return hooks.wrap_update_step(CriticStep(engine, CriticObjective(engine, ppo), guard))


def reward_source(plan: RunPlan, engine):
    """What scores the rollouts, as the plan loaded it (trainer/reward_sources; the choice: config/reward_source.py)."""
    return build_reward_source(plan.reward, engine, plan.cfg)


def episode_runner(plan: RunPlan, engine):
    """Multi-turn rollouts (rlhf_engine/envs), or None without an environment. Played on the trainer's ranks; with
    rollout servers each turn's rows go to the servers as requests (ahead of training in a thread of each rank's,
    trainer/episodes_ahead.py)."""
    if plan.env_factory is None:
        return None
    from ..envs import EpisodeRunner
    from ..envs.calls import EnvCalls

    env = plan.cfg.env
    collective = engine.generator.collective_calls
    if plan.cfg.rollout.ahead:  # through servers, in a thread of this rank's: nothing collective there
        collective = _never
    return EpisodeRunner.for_run(plan.cfg, plan.env_factory, engine.tokenizer, engine.sample, collective,
                                 engine.sampling,
                                 EnvCalls(env.env_workers, env.env_timeout_s, env.env_max_abandoned_calls),
                                 device=engine.device)


def _never() -> bool:
    return False


def rollouts_ahead(plan: RunPlan, engine, cursor, iterations: int, episodes=None):
    """Rollout batches generated ahead of training by the rollout servers (`max_staleness >= 1`; none past the
    run's `iterations`), or None. `episodes`: the run's episode runner; through servers it plays each batch's
    episodes in a thread of this rank's (trainer/episodes_ahead.py)."""
    r = plan.cfg.rollout
    if not r.ahead:
        return None
    from .ahead import RolloutsAhead

    backend = engine.generator
    if episodes is not None:
        from .episodes_ahead import EpisodesAhead

        backend = EpisodesAhead(backend, episodes)
    return RolloutsAhead(backend, cursor, plan.prompts, plan.cfg.batch, engine.sampling, engine.pad_token_id,
                         r.max_staleness, iterations, episodes=plan.env_factory is not None)


def evaluator(plan: RunPlan, engine) -> Optional[Evaluator]:
    """The held-out prompts' evaluation, or None without an eval split. One greedy response per prompt, so a call
    takes as many prompts as a training call has rows (prompts x n_samples_per_prompt): the rows the memory plan
    budgets for, in the fewest calls (4 calls of 8 took 18.5 s against a training call's 11.6 s for 32 rows)."""
    if plan.eval_prompts is None:
        return None
    return Evaluator(plan.eval_prompts, plan.cfg.batch.generation_rollouts, engine.dist.rank, engine.dist.world_size)


def checkpointer(plan: RunPlan, engine, providers: dict, hooks) -> Checkpointer:
    """Checkpoints of the engines and `providers` (name -> state_dict()/load_state_dict(), in restore order)."""
    cfg = plan.cfg
    run = cfg.run
    return Checkpointer(engine, providers, plan.run_dir, plan.fingerprint, save_interval=run.save_interval,
                        keep_last=run.keep_last, seed=cfg.seed, save_interval_minutes=run.save_interval_minutes,
                        export_dir=(cfg.export_dir or plan.run_dir.final) if cfg.export_final else None, hooks=hooks)
