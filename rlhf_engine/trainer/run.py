"""The PPO recipe: validate -> distributed -> data -> engines -> train. `launch/train_ppo.py` only parses and calls this.

Cheap checks (config, data file, prompt lengths, model configs) all run before any weights are loaded.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Optional

import torch

from ..config import TrainConfig
from ..data.prompts import PromptSampler, load_prompt_data
from ..engine import RLHFEngine, barrier, init_distributed, load_tokenizer
from ..outputs.run_logger import RunLogger, prepare_output_dir, write_run_files
from ..rewards import load_reward_fn
from .evaluation import Evaluator
from .experience import text_reward
from .ppo_trainer import PPOTrainer, total_iterations, updates_per_iteration
from .ptx import PtxData, load_ptx_data
from .state import after_resume_cleanup, resolve_and_check, run_fingerprint

log = logging.getLogger("rlhf_engine")


def setup_logging(is_main: bool) -> None:
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # per-role "Loading weights" bars on every rank are noise


def resolve_builtins(cfg) -> None:
    """Replace `builtin:` model and data names (the embedded default) by local paths."""
    from ..config import ROLES
    from ..errors import Problems
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


def build_trainer(cfg: TrainConfig, argv: Optional[list] = None) -> PPOTrainer:
    cfg.validate()
    resolve_builtins(cfg)
    dist = init_distributed(cfg.dist_timeout_minutes)
    setup_logging(dist.is_main)
    from ..engine.preflight import plan_roles

    plan_roles(cfg)  # model-side checks before the data is tokenized
    tokenizer = load_tokenizer(cfg.actor.tokenizer_name_or_path or cfg.actor.model_name_or_path)
    data = load_prompt_data(cfg.data, tokenizer, cfg.generation.max_prompt_seq_len, seed=cfg.seed,
                            verbose=dist.is_main)
    dataset, eval_set = data.train, data.eval
    if cfg.eval_data_path:
        eval_cfg = dataclasses.replace(cfg.data, data_path=cfg.eval_data_path, eval_split=0.0)
        eval_set = load_prompt_data(eval_cfg, tokenizer, cfg.generation.max_prompt_seq_len, seed=cfg.seed,
                                    verbose=dist.is_main).train
    # too few prompts for one global batch is a batch-arithmetic error: report it before any weight is loaded
    sampler = PromptSampler(len(dataset), cfg.batch.per_device_generation_batch_size, dist.rank, dist.world_size,
                            cfg.seed)
    iterations = total_iterations(cfg, sampler.batches_per_epoch)  # max_steps, or fewer with num_train_epochs
    ptx_data = None
    if cfg.unsupervised_dataset_name:  # ptx documents: read and checked before any weight too
        g = cfg.generation
        ptx_data = load_ptx_data(cfg.unsupervised_dataset_name, tokenizer, g.max_prompt_seq_len + g.max_answer_seq_len,
                                 cfg.unsup_text_column, verbose=dist.is_main, data_cache_dir=cfg.data.data_cache_dir)
        PtxData(ptx_data, cfg.batch.per_device_training_batch_size, dist.rank, dist.world_size, cfg.seed, 0)  # fits?
    # --resume: find the checkpoint, and refuse one of another run (naming every differing key), before any weight
    resume_path, fingerprint = resolve_and_check(cfg, dist, run_fingerprint(cfg, dist.world_size, len(dataset)))
    prepare_run_dir(cfg, dist, argv)
    after_resume_cleanup(cfg, dist, resume_path)  # rank 0: records logged after the checkpoint are logged again
    barrier()
    # Anything drawn while the engines are built (a new critic head with critic_init_from=actor) depends on the seed
    # only, identically on every rank; the trainer then reseeds with seed + rank for sampling.
    torch.manual_seed(cfg.seed)
    engine = RLHFEngine(cfg, dist, num_training_steps=iterations * updates_per_iteration(cfg),
                        output_dir=cfg.output_dir)
    from ..cli import flat_dict

    logger = RunLogger.from_config(cfg, dist.is_main, flat_dict(cfg))
    trainer = PPOTrainer(cfg, engine, dataset, metrics=logger, ptx_dataset=ptx_data)
    if cfg.eval_interval and eval_set is not None:
        trainer.evaluator = Evaluator(eval_set, cfg.batch.per_device_generation_batch_size, dist.rank,
                                      dist.world_size)
    if cfg.reward_fn:
        trainer.reward_fn = text_reward(load_reward_fn(cfg.reward_fn), engine.tokenizer)
    trainer.checkpointer.fingerprint = fingerprint  # written into every checkpoint's marker
    if resume_path:  # last: the random generators are restored right before training continues
        trainer.checkpointer.load(resume_path, force=cfg.resume_force)
    return trainer


def prepare_run_dir(cfg, dist, argv: Optional[list]) -> None:
    """Refuse an output directory holding another run (unless resume/overwrite), then write the resolved config and
    the (redacted) command line. Shared by the PPO, SFT and reward-model recipes."""
    from ..cli import flat_dict

    prepare_output_dir(cfg.output_dir, resume=bool(getattr(cfg, "resume", "")), overwrite=cfg.overwrite_output_dir,
                       is_main=dist.is_main)
    barrier()  # only rank 0 creates the folder or moves old files aside
    if dist.is_main:
        write_run_files(cfg.output_dir, flat_dict(cfg), list(argv or []))


def run_ppo(cfg: TrainConfig, argv: Optional[list] = None) -> PPOTrainer:
    trainer = build_trainer(cfg, argv)
    trainer.train()
    return trainer


def shutdown_distributed(ok: bool) -> None:
    """End of a launch script (`if __name__ == "__main__"`, never in-process): tear the process group down on every
    rank together. Exiting with it alive let one gloo rank abort after a complete run while its peer was already gone
    ('terminate called without an active exception', exit code -6; 2 of 8 two-rank launches on a loaded machine)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if ok:
            torch.distributed.barrier()  # every rank has finished: nobody closes a connection a peer still uses
        torch.distributed.destroy_process_group()


def exit_process(rc: int) -> None:
    """The end of a launch script's `__main__`: tear the process group down on every rank together
    (`shutdown_distributed`), then exit with `rc`."""
    shutdown_distributed(ok=rc == 0)
    sys.exit(rc)
