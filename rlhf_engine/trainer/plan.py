"""Plan, then build: one pass over the configuration produces an immutable run plan; the engines and the trainer take
it in their constructors, and nothing is planned twice.

`plan_ppo(cfg)` checks and resolves, in this order, everything that is cheap (no weight is read): the config, the
distributed environment, the model side (`engine.preflight.plan_engine`: roles with paths, ZeRO stages and resolved
dtypes, the tokenizer, stop tokens, the generation path), the reward function, the prompts (train and held-out), the
sampler and iteration counts (batch arithmetic), the ptx documents, the run fingerprint and the resume point (a
checkpoint of another run is refused here), and the run directory's policy. `plan_supervised` does the same for steps
1 and 2. The recipes (`trainer/run.py`, `trainer/supervised.py`) then prepare the run directory and build.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..comm import DistInfo
from ..config import TrainConfig
from ..data.columns import ColumnRequest
from ..data.prompts import PromptData, PromptDataset, load_prompt_data
from ..data.ptx import PtxDataset, check_fits, load_ptx_data
from ..data.sampler import PromptSampler
from ..engine import EnginePlan, RolePlan, init_distributed, plan_engine, plan_model
from ..errors import ConfigError, Problem, Problems
from ..outputs.run_dir import RunDir
from ..config.ppo import experience_from_update
from ..config.reward_source import DEFAULT as DEFAULT_SOURCE, reward_source_kind
from .reward_sources import LoadedSource, source_class
from .state import resolve_and_check, run_fingerprint, supervised_fingerprint

log = logging.getLogger("rlhf_engine")


@dataclass(frozen=True)
class RunPlan:
    """Everything a PPO run is built from (frozen: read it, never change it)."""

    cfg: TrainConfig = field(repr=False)  # validated, builtin names resolved
    dist: DistInfo
    engine: EnginePlan  # roles, tokenizer, stop tokens, generation path, LR-schedule length
    prompts: PromptDataset = field(repr=False)
    eval_prompts: Optional[PromptDataset] = field(repr=False)  # None: no evaluation in the loop
    sampler: PromptSampler = field(repr=False)  # this rank's order over `prompts`
    iterations: int  # PPO iterations of the run
    updates_per_iteration: int  # optimizer steps per trained engine per iteration
    ptx: Optional[PtxDataset] = field(repr=False)  # PPO-ptx documents (None: ptx off)
    reward: LoadedSource = field(repr=False)  # the run's reward source, loaded (trainer/reward_sources)
    env_factory: Optional[Callable] = field(repr=False)  # the loaded --environment factory, None: single-turn
    fingerprint: Mapping[str, Any]  # written into every checkpoint; a resume must match it
    resume_path: Optional[str]  # the checkpoint this run continues (None: a fresh start)
    run_dir: RunDir

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer


@dataclass(frozen=True)
class SupervisedPlan:
    """Everything an SFT or reward-model run is built from."""

    cfg: Any = field(repr=False)
    dist: DistInfo
    model: RolePlan
    tokenizer: Any = field(repr=False)
    data: PromptData = field(repr=False)
    sampler: PromptSampler = field(repr=False)
    total_steps: int
    fingerprint: Mapping[str, Any]
    resume_path: Optional[str]
    run_dir: RunDir


# ---- iteration counts ------------------------------------------------------------------------------------------------
def updates_per_iteration(cfg: TrainConfig) -> int:
    """Optimizer steps per trained engine per iteration (for the LR schedule)."""
    return cfg.ppo.ppo_epochs * (cfg.batch.rollout_size // cfg.batch.mini_batch_size)


def total_iterations(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """Iterations of the run: max_steps, or with num_train_epochs E > 0
    min(max_steps, floor(E x batches_per_epoch / generation_batches)), batches_per_epoch being the sampler's global
    generation batches per epoch (an iteration may straddle two epochs). Raises ConfigError when that is 0."""
    epochs = cfg.num_train_epochs
    if not epochs:
        return cfg.max_steps
    n = min(cfg.max_steps, epochs * batches_per_epoch // cfg.batch.generation_batches)
    if n < 1:
        raise ConfigError([Problem("num_train_epochs", epochs, f"{epochs} epoch(s) of {batches_per_epoch} generation "
                                   f"batches hold less than one iteration (generation_batches "
                                   f"{cfg.batch.generation_batches}); raise num_train_epochs or add prompts")],
                          "invalid configuration")
    return n


# ---- start-up ----------------------------------------------------------------------------------------------------
def setup_logging(is_main: bool) -> None:
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # per-role "Loading weights" bars on every rank are noise


def resolve_builtins(cfg: TrainConfig) -> None:
    """Replace `builtin:` model and data names (the embedded default) by local paths (part of resolving the config,
    before it is planned)."""
    from ..config import ROLES
    from ..pretrained import resolve_builtin

    p = Problems()
    fields = [(getattr(cfg, r), f, f"{r}_{f}") for r in ROLES for f in ("model_name_or_path", "tokenizer_name_or_path")]
    fields.append((cfg.data, "data_path", "data_path"))
    for owner, name, flag in fields:
        value = getattr(owner, name)
        if isinstance(value, str) and value.startswith("builtin:"):
            try:
                setattr(owner, name, resolve_builtin(value))
            except (ValueError, FileNotFoundError) as e:
                p.add(flag, value, str(e))
    p.raise_if_any("cannot start: builtin assets")


def start(cfg: Any) -> DistInfo:
    """Validate the config, join the process group, set up logging."""
    cfg.validate()
    dist = init_distributed(cfg.run.dist_timeout_minutes)
    setup_logging(dist.is_main)
    return dist


def _model_side(cfg: TrainConfig) -> tuple[EnginePlan, Optional[LoadedSource], Optional[Callable]]:
    """The engine plan, the reward source and the environment factory, every problem of all three in one error."""
    p = Problems()
    engine = reward = env_factory = None
    try:
        engine = plan_engine(cfg)
    except ConfigError as e:
        p.extend(e.problems)
    kind = reward_source_kind(cfg)
    try:  # the user's code imported and checked before any weight
        reward = LoadedSource(kind, source_class(kind).load(cfg))
    except ValueError as e:
        flag, value = next(iter(kind.chosen_by(cfg).items()), (kind.name, ""))
        p.add(flag, value, str(e))
    if kind.name == DEFAULT_SOURCE and cfg.reward.use_chat_template:
        _check_reward_chat_template(cfg, p)
    if cfg.env.on:
        from ..envs import load_environment_factory

        try:
            env_factory = load_environment_factory(cfg.env.environment)
        except ValueError as e:
            p.add("environment", cfg.env.environment, str(e))
        if engine is not None and cfg.data.use_chat_template:
            from ..envs.turns import wrapping

            try:
                wrapping(engine.tokenizer)
            except ValueError as e:
                p.add("use_chat_template", True, f"environment: {e}")
    p.raise_if_any("cannot start: model setup")
    return engine, reward, env_factory


def _check_reward_chat_template(cfg: TrainConfig, p: Problems) -> None:
    """--reward_use_chat_template needs a reward tokenizer with a chat template (read once here, before any
    weight)."""
    from transformers import AutoTokenizer

    path = cfg.reward.tokenizer_name_or_path or cfg.reward.model_name_or_path
    try:
        template = getattr(AutoTokenizer.from_pretrained(path), "chat_template", None)
    except Exception as e:  # noqa: BLE001  (the model-path checks name a missing folder; this names the rest)
        p.add("reward_use_chat_template", True, f"cannot load the reward tokenizer {path!r} "
              f"({type(e).__name__}: {e})")
        return
    if not template:
        p.add("reward_use_chat_template", True, f"the reward tokenizer {path!r} has no chat_template; give "
              "reward_tokenizer_name_or_path one with a template, or drop the flag")


def check_columns(columns: Optional[ColumnRequest], datasets: list) -> None:
    """Prompts given already tokenized must hold the reward function's required columns."""
    missing = sorted({c for d in datasets for c in (columns.required if columns else ()) if c not in d.columns})
    if missing:
        raise ConfigError([Problem("reward_fn", ", ".join(missing), "the reward function takes these data columns, "
                                   "which the given prompt data does not hold (PromptDataset.columns)")],
                          "cannot start: prompt data")


def log_estimator_defaults(cfg: TrainConfig, dist: DistInfo) -> None:
    """The estimator family's and the policy loss's defaults (config.run_defaults) and what is in effect, once at
    start-up."""
    from ..config.ppo import run_defaults

    from ..config.ppo import rollouts_ahead_of_training

    backend = cfg.engine.requested_backend[0]
    family = run_defaults(cfg.ppo, backend, rollouts_ahead_of_training(cfg))
    if family and dist.is_main:
        log.info("advantage_estimator %s, policy_loss %s, generation_backend %s: their defaults %s (explicit flags "
                 "win); in effect %s", cfg.ppo.advantage_estimator, cfg.ppo.policy_loss, backend,
                 ", ".join(f"{k} {v}" for k, v in family.items()),
                 ", ".join(f"{k} {getattr(cfg.ppo, k)}" for k in family))


def forwards_summary(cfg: TrainConfig, roles: Mapping[str, RolePlan], generation_backend: str) -> str:
    """One line: the forwards a PPO iteration does and why each, or why a role does none (logged once at start-up,
    `plan_ppo`)."""
    p = cfg.ppo
    where = "the rollout servers" if cfg.rollout.servers_on else f"generation_backend {generation_backend}"
    from_update = experience_from_update(cfg)
    if from_update:
        actor = ("no actor experience forward (every row is the update's one micro-batch: its training forward, "
                 "before any step, gives the old log-probs; the rewards and advantages are computed between that "
                 "forward and its loss: old_logprobs_from_update)")
    elif p.defers_old_logprobs:
        actor = ("actor experience forward on the rows after the first mini-batch (old log-probs: the ratio's "
                 "denominator; the first mini-batch's are its own training forward's, before any step: "
                 "old_logprobs_from_update)")
    else:
        actor = "actor experience forward (old log-probs: the ratio's denominator)"
    parts = [f"generation on {where}", actor]
    if "reference" in roles:
        readers = [what for on, what in ((p.kl_coef > 0, f"kl_coef {p.kl_coef:g}: the reward's KL penalty"),
                                          (p.adaptive_kl, "adaptive_kl"),
                                          (p.kl_loss_coef > 0, f"kl_loss_coef {p.kl_loss_coef:g}: the KL loss"),
                                          (True, "objective/kl"))
                   if on]
        how = " (the actor with its adapter disabled)" if cfg.engine.reference_from_actor_adapter else ""
        parts.append(f"reference forward{how} ({', '.join(readers)})")
    else:
        parts.append("no reference (kl_coef 0, kl_loss_coef 0: nothing reads it; --monitor_reference_kl builds it "
                     "for objective/kl)")
    if "critic" not in roles:
        parts.append(f"no critic ({p.advantage_estimator} needs none)")
    elif from_update:
        parts.append(f"no critic experience forward ({p.advantage_estimator}'s values from its training forward, "
                     "likewise)")
    else:
        parts.append(f"critic forward ({p.advantage_estimator}'s values)")
    if "reward" in roles:
        parts.append("reward model forward (the scores)")
    else:
        parts.append(f"no reward model ({reward_source_kind(cfg).what} scores)")
    trained = " and ".join(r for r in ("actor", "critic") if r in roles)
    parts.append(f"training forwards of the {trained}: every mini-batch of each of {p.ppo_epochs} epoch(s)")
    return "forwards per iteration: " + "; ".join(parts)


def warn_kl_in_group_returns(cfg: TrainConfig, dist: DistInfo) -> None:
    """A group estimator's return holds kl_coef x the response's KL: in a group whose scores are all equal, the KL
    differences alone become the advantages (grpo divides them by a tiny std). Said once at start-up."""
    from ..estimators import GROUP_ESTIMATORS

    if cfg.ppo.advantage_estimator in GROUP_ESTIMATORS and cfg.ppo.kl_coef > 0 and dist.is_main:
        log.warning("advantage_estimator %s with kl_coef %g: each response's return includes its KL penalty, so in a "
                    "group of equal scores the KL differences become the advantages; for GRPO-style runs consider "
                    "--kl_coef 0 with --kl_loss_coef instead", cfg.ppo.advantage_estimator, cfg.ppo.kl_coef)


def plan_ppo(cfg: TrainConfig, prompt_data: Optional[PromptData] = None) -> RunPlan:
    """The plan of a PPO run (module docstring). Every rank calls it; raises one `ConfigError` per stage.
    `prompt_data`: already tokenized prompts (a benchmark's, a notebook's) instead of loading `cfg.data`."""
    dist = start(cfg)
    resolve_builtins(cfg)
    engine, reward, env_factory = _model_side(cfg)  # model-side checks before the data is tokenized
    if cfg.engine.generation_backend_auto and dist.is_main:  # resolved by parse_args, or by the engine's plan
        log.info("generation_backend %s", cfg.engine.generation_backend_auto)
    log_estimator_defaults(cfg, dist)
    warn_kl_in_group_returns(cfg, dist)
    if dist.is_main:
        log.info("%s", forwards_summary(cfg, engine.roles, engine.generation_backend))
    tok, g = engine.tokenizer, cfg.generation
    # the data columns the reward source takes (an environment's factory gets every column), kept with every row
    columns = source_class(reward.kind).columns(reward.loaded)
    data = prompt_data or load_prompt_data(cfg.data, tok, g.max_prompt_seq_len, seed=cfg.seed, verbose=dist.is_main,
                                           columns=columns)
    eval_prompts = data.eval
    if cfg.eval_data_path:
        eval_cfg = dataclasses.replace(cfg.data, data_path=cfg.eval_data_path, eval_split=0.0)
        eval_prompts = load_prompt_data(eval_cfg, tok, g.max_prompt_seq_len, seed=cfg.seed,
                                        verbose=dist.is_main, columns=columns).train
    if prompt_data is not None:
        check_columns(columns, [data.train] + ([data.eval] if data.eval is not None else []))
    # too few prompts for one global batch is a batch-arithmetic error: reported before any weight is loaded
    sampler = PromptSampler(len(data.train), cfg.batch.per_device_generation_batch_size, dist.rank, dist.world_size,
                            cfg.seed)
    iterations = total_iterations(cfg, sampler.batches_per_epoch)  # max_steps, or fewer with num_train_epochs
    updates = updates_per_iteration(cfg)
    ptx = None
    if cfg.ptx.unsupervised_dataset_name:  # ptx documents: read and checked before any weight too
        ptx = load_ptx_data(cfg.ptx.unsupervised_dataset_name, tok, g.max_prompt_seq_len + g.max_answer_seq_len,
                            cfg.ptx.unsup_text_column, verbose=dist.is_main, data_cache_dir=cfg.data.data_cache_dir)
        check_fits(ptx, cfg.batch.mini_batch_size, dist.world_size)
    run_dir = RunDir(cfg.run.output_dir)
    run_dir.check(resume=bool(cfg.run.resume), overwrite=cfg.run.overwrite_output_dir)
    # --resume: find the checkpoint, and refuse one of another run (naming every differing key), before any weight
    fingerprint = run_fingerprint(cfg, engine.roles, dist.world_size, len(data.train))
    resume_path = resolve_and_check(cfg, dist, fingerprint)
    # last before any weight: the rollout servers are asked what they serve
    link = check_rollout_servers(cfg, dist, engine) if cfg.rollout.servers_on else None
    return RunPlan(cfg=cfg, dist=dist, engine=dataclasses.replace(engine, num_training_steps=iterations * updates,
                                                                  rollout_link=link),
                   prompts=data.train, eval_prompts=eval_prompts if cfg.eval_interval else None, sampler=sampler,
                   iterations=iterations, updates_per_iteration=updates, ptx=ptx, reward=reward,
                   env_factory=env_factory,
                   fingerprint=fingerprint, resume_path=resume_path, run_dir=run_dir)


def check_rollout_servers(cfg: TrainConfig, dist: DistInfo, engine: EnginePlan) -> Any:
    """The rollout servers checked for this run (collective; a server that cannot serve is a ConfigError here)."""
    from transformers import AutoConfig

    from ..engine.generation.servers import probe_servers

    actor = engine.roles["actor"]
    config = AutoConfig.from_pretrained(actor.path) if dist.is_main else None
    return probe_servers(cfg, dist, actor.dtype, config, engine.longest_sequence)


def plan_supervised(cfg: Any, trainer_cls: type) -> SupervisedPlan:
    """The plan of an SFT or reward-model run: the same stages as `plan_ppo` for one trained model, its data loaded
    by `trainer_cls.load_data`."""
    dist = start(cfg)
    t = cfg.train
    model, tokenizer = plan_model(cfg.model, t.max_prompt_seq_len + t.max_answer_seq_len, name=trainer_cls.role)
    data = trainer_cls.load_data(cfg, tokenizer, verbose=dist.is_main)
    sampler = PromptSampler(len(data.train), t.mini_batch_size, dist.rank, dist.world_size, cfg.seed,
                            batch_field="per_device_training_batch_size x gradient_accumulation_steps")
    total = sampler.batches_per_epoch * t.num_train_epochs
    if t.max_steps:
        total = min(total, t.max_steps)
    run_dir = RunDir(cfg.run.output_dir)
    run_dir.check(resume=bool(cfg.run.resume), overwrite=cfg.run.overwrite_output_dir)
    fingerprint = supervised_fingerprint(cfg, model, dist.world_size, len(data.train))
    resume_path = resolve_and_check(cfg, dist, fingerprint)
    return SupervisedPlan(cfg=cfg, dist=dist, model=model, tokenizer=tokenizer, data=data, sampler=sampler,
                          total_steps=total, fingerprint=fingerprint, resume_path=resume_path, run_dir=run_dir)
