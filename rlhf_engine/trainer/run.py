"""The PPO recipe: plan (every cheap check, trainer/plan.py) -> run directory -> engines -> trainer -> train.
`launch/train_ppo.py` only parses and calls this.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from ..comm import barrier
from ..config import TrainConfig, flat_dict
from ..data.prompts import PromptData
from ..engine import RLHFEngine
from ..hooks import TestHooks
from ..outputs.run_logger import RunLogger
from .plan import RunPlan, SupervisedPlan, plan_ppo
from .ppo_trainer import PPOTrainer
from .preemption import clear_markers
from .state import after_resume_cleanup

log = logging.getLogger(__name__)


def build_trainer(cfg: TrainConfig, argv: Optional[list] = None, prompt_data: Optional[PromptData] = None,
                  hooks: Optional[TestHooks] = None) -> PPOTrainer:
    """The plan, then the run directory, the engines, the logger and the trainer. `prompt_data`: tokenized prompts
    given instead of loading `cfg.data` (trainer/plan.plan_ppo). `hooks`: test switches (rlhf_engine/hooks.py), off
    by default."""
    plan = plan_ppo(cfg, prompt_data)  # raises before the run directory changes or any weight is read
    prepare_run_dir(plan, argv)
    # Anything drawn while the engines are built (a new critic head with critic_init_from=actor) depends on the seed
    # only, identically on every rank; the trainer then reseeds with seed + rank for sampling.
    torch.manual_seed(cfg.seed)
    engine = RLHFEngine(cfg, plan.dist, plan.engine, hooks=hooks)
    write_ds_configs(plan, engine.ds_configs)
    logger = RunLogger.from_config(cfg, plan.dist.is_main, flat_dict(cfg), total_iterations=plan.iterations)
    return PPOTrainer(plan, engine, metrics=logger, hooks=engine.hooks)  # resumes last: its random generators come back right before
    # training continues


def prepare_run_dir(plan: RunPlan | SupervisedPlan, argv: Optional[list]) -> None:
    """The run directory's policy applied (rank 0 creates it or moves another run's files aside; others wait), the
    resolved config and the (redacted) command line written; after a resume, the records logged after the checkpoint
    are moved aside. Shared by the PPO, SFT and reward-model recipes."""
    cfg, dist = plan.cfg, plan.dist
    plan.run_dir.prepare(resume=bool(cfg.run.resume), overwrite=cfg.run.overwrite_output_dir, is_main=dist.is_main)
    barrier()
    if dist.is_main:
        plan.run_dir.write_run_files(flat_dict(cfg), list(argv or []))
        clear_markers(plan.run_dir.root)  # a new attempt: the last one's PREEMPTED / request are answered
        warn_unsaved_slurm_run(cfg)
    after_resume_cleanup(cfg, dist, plan.resume_path)
    barrier()


def warn_unsaved_slurm_run(cfg: Any) -> None:
    """A SLURM job (preemptible, time-limited) whose only checkpoint is the last one loses everything to a kill that
    comes without a signal: say so once at start."""
    if os.environ.get("SLURM_JOB_ID") and not cfg.run.save_interval and not cfg.run.save_interval_minutes:
        log.warning("running under SLURM (job %s) with neither save_interval nor save_interval_minutes set: a "
                    "preemption signal still saves, but a kill without one (node failure, scancel -9) loses the "
                    "whole run; set --save_interval_minutes 30 (or --save_interval N)", os.environ["SLURM_JOB_ID"])


def write_ds_configs(plan: RunPlan | SupervisedPlan, configs: dict[str, Any]) -> None:
    if plan.dist.is_main:
        plan.run_dir.write_ds_configs(configs)


def run_ppo(cfg: TrainConfig, argv: Optional[list] = None, hooks: Optional[TestHooks] = None) -> PPOTrainer:
    trainer = build_trainer(cfg, argv, hooks=hooks)
    trainer.train()
    return trainer
